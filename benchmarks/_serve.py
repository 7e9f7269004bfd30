"""Starting ``python -m tserve serve`` for a benchmark and finding its URL."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

__all__ = ["serve"]

_URL = re.compile(r"serving '.*' at (http://\S+)/v1")


def serve(
    model: str,
    log: Path,
    *options: str,
    said: list[str] | None = None,
    own_session: bool = False,
) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``python -m tserve serve MODEL --port 0 OPTIONS``, stderr to ``log``
    (in a session of its own with ``own_session``); its process and root URL,
    once it says it is serving (blocks until then). The lines it printed
    before that go to ``said``. RuntimeError naming ``log`` if it exits first."""
    command = [sys.executable, "-m", "tserve", "serve", model, "--port", "0", *options]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=log.open("wb"), start_new_session=own_session
    )
    assert process.stdout is not None
    for raw in process.stdout:
        found = _URL.search(raw.decode())
        if found:
            return process, found.group(1)
        if said is not None:
            said.append(raw.decode())
    raise RuntimeError(f"the server exited ({process.wait()}): see {log}")
