"""tserve._host: a child's own process group, in its parent's session."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.guards import HANG_GUARD

_REPORT = (
    "import os; from tserve._host import own_process_group; own_process_group(); "
    "print(os.getpid(), os.getpgid(0), os.getsid(0))"
)


@pytest.mark.parametrize("new_session", [False, True])
def test_a_child_leads_a_group_of_its_own_in_the_session_it_was_given(new_session: bool) -> None:
    """Started in our group it leaves it for one of its own, in our session (a
    terminal's Ctrl-C to our group passes it by, nice values still weigh
    against ours); started as a session leader it stays as it is."""
    out = subprocess.run(
        [sys.executable, "-c", _REPORT],
        capture_output=True,
        text=True,
        check=True,
        timeout=HANG_GUARD,
        start_new_session=new_session,
    ).stdout.split()
    pid, group, session = (int(v) for v in out)
    assert group == pid != os.getpgid(0)
    assert (session == pid) if new_session else (session == os.getsid(0))
