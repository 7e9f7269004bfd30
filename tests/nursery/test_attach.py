"""attach_llm: a second API-side LLM over an engine that open_llm owns (``--api-processes``)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from tests.guards import HANG_GUARD
from tests.nursery.conftest import ENGINE, eventually
from tests.processes import process_gone
from tserve import EngineDeadError, SamplingParams, open_llm
from tserve.nursery import ClientSettings, attach_llm

pytestmark = pytest.mark.anyio

PARAMS = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0)


async def test_attached_llm_shares_the_engine_and_never_stops_it(tiny_model_dir: Path) -> None:
    """Both LLMs generate the same text through one engine; leaving the
    attached one sends no Shutdown: the owner still generates afterwards."""
    with anyio.fail_after(HANG_GUARD):
        async with open_llm(tiny_model_dir, **ENGINE) as owner:
            async with attach_llm(owner.engine_address, owner.engine_pid) as attached:
                assert attached.engine_pid == owner.engine_pid
                assert attached.model == owner.model
                ours, theirs = (
                    await owner.complete("hi", PARAMS),
                    await attached.complete("hi", PARAMS),
                )
                assert ours.token_ids == theirs.token_ids and len(ours.token_ids) == 5
            for _ in range(3):  # a Shutdown would have reached the engine by now
                assert (await owner.complete([1, 2], PARAMS)).finish_reason == "length"
            assert owner.engine_alive


async def test_attached_llm_sees_the_engine_die(tiny_model_dir: Path) -> None:
    """kill -9 of the engine: the attached LLM (not its parent) fails its live
    request with EngineDeadError and reports the engine dead. The echo engine
    at 10 steps a second needs 40 s for the request, so it is mid-stream at
    the kill."""
    with anyio.fail_after(HANG_GUARD):
        async with (
            open_llm(tiny_model_dir, engine_kind="echo", echo_step_time=0.1, **ENGINE) as owner,
            attach_llm(
                owner.engine_address,
                owner.engine_pid,
                settings=ClientSettings(heartbeat_timeout=60),
            ) as attached,
        ):
            long = SamplingParams(max_tokens=400, ignore_eos=True)
            async with attached.generate([1, 2, 3], long) as stream:
                await stream.__anext__()
                owner.kill_engine()
                with pytest.raises(EngineDeadError, match="exited"):
                    async for _ in stream:
                        pass
            assert not attached.engine_alive
            assert "exited" in (await attached.wait_engine_dead())
            await eventually(lambda: process_gone(owner.engine_pid), "the engine is gone")


async def test_attach_to_a_dead_address_raises_engine_dead(tiny_model_dir: Path) -> None:
    with anyio.fail_after(HANG_GUARD):
        async with open_llm(tiny_model_dir, **ENGINE) as owner:
            address, pid = owner.engine_address, owner.engine_pid
        with pytest.raises(EngineDeadError):
            async with attach_llm(address, pid, settings=ClientSettings(startup_timeout=5)):
                pass
