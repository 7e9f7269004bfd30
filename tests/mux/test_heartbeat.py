"""The heartbeat watch: a stalled event loop is not a silent engine (rules in mux/_heartbeat.py).

The rules alone, on times the test chooses; then a real fake-engine process
behind a real mux while the test blocks the event loop with ``time.sleep``.
"""

from __future__ import annotations

import time

import anyio
import pytest

from tests.guards import HANG_GUARD
from tests.mux.test_mux import _engine_and_mux, _open, _read_all
from tserve.mux import EngineDeadError
from tserve.mux._heartbeat import Silence, SilenceClock

TIMEOUT = 0.5  # s of engine silence that count as its death in these tests
STALL = 2.0  # s the tests block the event loop: four heartbeat timeouts


def test_a_frame_heard_moves_the_deadline() -> None:
    clock = SilenceClock(TIMEOUT, now=10.0)
    assert clock.deadline == 10.5
    clock.heard(10.3)
    clock.heard(10.1)  # an older time never moves it back
    assert clock.deadline == 10.8
    assert clock.look(10.5, frames_waiting=False, planned=10.5) is Silence.HEARD
    assert clock.excused == 0


def test_silence_with_nothing_waiting_is_death() -> None:
    clock = SilenceClock(TIMEOUT, now=10.0)
    assert clock.look(10.5, frames_waiting=False, planned=10.5) is Silence.DEAD


def test_frames_waiting_after_a_late_wakeup_are_the_engine_speaking() -> None:
    clock = SilenceClock(TIMEOUT, now=10.0)
    assert clock.look(13.0, frames_waiting=True, planned=10.5) is Silence.HEARD
    assert clock.excused == 1
    assert clock.max_lateness == 2.5
    assert clock.deadline == 13.5  # heard when the loop came back
    assert clock.look(13.5, frames_waiting=False, planned=13.5) is Silence.DEAD
    assert clock.max_lateness == 2.5


def test_the_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError):
        SilenceClock(0.0, now=0.0)


@pytest.mark.anyio
async def test_a_stalled_loop_does_not_kill_a_healthy_engine(ipc_address: str) -> None:
    async with _engine_and_mux(
        ipc_address, heartbeat_timeout=TIMEOUT, heartbeat_interval=0.05
    ) as mux:
        before = await _read_all(_open(mux, "before", 7, 5))
        time.sleep(STALL)  # noqa: ASYNC251 (the point: the loop stalls)
        await anyio.sleep(TIMEOUT)  # the watch looks at least once after the stall
        assert not mux.dead, mux.dead_reason
        assert mux.silence.max_lateness >= STALL - TIMEOUT
        after = await _read_all(_open(mux, "after", 7, 5))
        assert before == after == [7, 8, 9, 10, 11]


@pytest.mark.anyio
async def test_a_silent_engine_is_dead_even_when_the_loop_stalls_too(ipc_address: str) -> None:
    """The engine goes quiet after its first step; the loop then stalls past
    the timeout: nothing is waiting in the socket, so this silence is the
    engine's, and the open request fails at the first look."""
    async with _engine_and_mux(
        ipc_address, heartbeat_timeout=TIMEOUT, heartbeat_interval=0.05, hang_after_steps=1
    ) as mux:
        mailbox = _open(mux, "r", 0, 10_000)
        await mailbox.get()
        time.sleep(STALL)  # noqa: ASYNC251 (the point: the loop stalls)
        started = anyio.current_time()
        with anyio.fail_after(HANG_GUARD), pytest.raises(EngineDeadError) as caught:
            await _read_all(mailbox)
        print(f"declared dead {anyio.current_time() - started:.3f} s after the stall ended")
        assert str(caught.value) == f"no message from the engine for {TIMEOUT:g} s"
        assert mux.dead
