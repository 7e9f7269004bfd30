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
from tests.nursery.conftest import ENGINE, eventually, process_gone
from tserve import SamplingParams, open_llm

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
