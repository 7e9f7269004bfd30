"""The heartbeat watch against a real engine process: a stalled event loop is
not a dead engine, a stopped engine is (rules in tserve/mux/_heartbeat.py)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import anyio
import pytest

from tests.guards import HANG_GUARD
from tests.nursery.conftest import ENGINE, eventually
from tests.processes import process_gone
from tserve import EngineDeadError, SamplingParams, open_llm
from tserve.gpu.engine._core import STALL_FAULT_ENV

pytestmark = pytest.mark.anyio

TIMEOUT = 1.0  # s of engine silence that count as its death here
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


async def test_a_stalled_loop_keeps_the_engine_and_a_stopped_engine_dies(
    tiny_model_dir: Path,
) -> None:
    async with open_llm(tiny_model_dir, heartbeat_timeout=TIMEOUT, **ENGINE) as llm:
        before = await llm.complete("Hello", GREEDY)
        time.sleep(3 * TIMEOUT)  # noqa: ASYNC251 (the point: the loop stalls)
        await anyio.sleep(TIMEOUT)  # the heartbeat watch looks after the stall
        assert llm.engine_alive, llm.engine_dead_reason
        assert llm._mux.silence.max_lateness >= 2 * TIMEOUT
        assert (await llm.complete("Hello", GREEDY)).token_ids == before.token_ids

        pid = llm.engine_pid
        os.kill(pid, signal.SIGSTOP)  # alive, and silent
        stopped = anyio.current_time()
        with anyio.fail_after(HANG_GUARD):
            reason = await llm.wait_engine_dead()
        print(f"a stopped engine declared dead {anyio.current_time() - stopped:.2f} s after")
        assert reason == f"no message from the engine for {TIMEOUT:g} s"
        await eventually(lambda: process_gone(pid), "the silent engine is killed")


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + HANG_GUARD
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.01)


async def test_a_long_step_is_alive_and_a_wedged_step_is_dead(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's second step is held far past the heartbeat timeout while it
    progresses: the engine stays alive and the request completes. Then a step
    that never returns and never progresses is declared dead one heartbeat
    timeout after its last progress, and the wedged engine is killed."""
    held, wedged = tmp_path / "held", tmp_path / "wedged"
    held.mkdir()
    wedged.mkdir()
    monkeypatch.setenv(STALL_FAULT_ENV, f"2:progress:{held}")
    async with open_llm(tiny_model_dir, heartbeat_timeout=TIMEOUT, **ENGINE) as llm:
        async with anyio.create_task_group() as tg:
            results = []

            async def complete() -> None:
                results.append(await llm.complete("Hello", GREEDY))

            tg.start_soon(complete)
            await anyio.to_thread.run_sync(_wait_for, held / "held")
            await anyio.sleep(5 * TIMEOUT)  # five timeouts inside one step
            assert llm.engine_alive, llm.engine_dead_reason
            (held / "release").touch()
        assert len(results[0].token_ids) == GREEDY.max_tokens

    monkeypatch.setenv(STALL_FAULT_ENV, f"2:wedge:{wedged}")
    async with open_llm(tiny_model_dir, heartbeat_timeout=TIMEOUT, **ENGINE) as llm:
        pid = llm.engine_pid
        with pytest.raises(EngineDeadError) as raised, anyio.fail_after(HANG_GUARD):
            await llm.complete("Hello", GREEDY)
        assert raised.value.reason == f"no message from the engine for {TIMEOUT:g} s"
        await eventually(lambda: process_gone(pid), "the wedged engine is killed")
