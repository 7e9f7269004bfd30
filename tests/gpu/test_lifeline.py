"""``tserve engine``'s own stop: a signal, mid-load or serving; a peer's Shutdown is not one.

Signal handlers are process-wide, so the lifeline runs in a fresh interpreter
(no torch: a few hundred ms).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, cast

import pytest

from tests.guards import HANG_GUARD
from tserve.gpu.engine._process import _apply, _Stop
from tserve.protocol import Shutdown, encode

REPO_ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import os, signal, time
    from tserve.gpu.engine._lifeline import SignalLifeline

    lifeline = SignalLifeline()
    finished = []

    def load():
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while "loading"
        time.sleep(30)
        finished.append("loaded")
        return "loaded"

    print(lifeline.load(load), finished == [])  # interrupted: the load never got this far
    print(lifeline.load(lambda: "loaded"))  # stopped already: no second load
    """
)


def test_a_signal_interrupts_the_load_and_then_stops_the_loop() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
        cwd=REPO_ROOT,
        check=True,
    ).stdout.split("\n")
    assert out[:2] == ["None True", "None"]


def test_a_signal_after_the_load_is_a_stop_reason() -> None:
    script = (
        "import os, signal; from tserve.gpu.engine._lifeline import SignalLifeline\n"
        "lifeline = SignalLifeline(); assert lifeline.load(lambda: 1) == 1\n"
        "print(lifeline.stop_reason()); os.kill(os.getpid(), signal.SIGINT)\n"
        "print(lifeline.stop_reason())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
        cwd=REPO_ROOT,
        check=True,
    )
    assert done.stdout.split("\n")[:2] == ["None", "the engine was stopped (SIGINT)"]


def test_a_shared_engine_ignores_a_peers_shutdown() -> None:
    """One API server leaving must not stop the engine the others use; the
    engine an API process started still obeys its Shutdown."""
    nothing = cast(Any, None)  # Shutdown touches neither the core nor the outbox
    frame = bytes(encode(Shutdown("API process leaving")))
    _apply(nothing, nothing, b"peer", frame, True)
    with pytest.raises(_Stop):
        _apply(nothing, nothing, b"peer", frame, False)
