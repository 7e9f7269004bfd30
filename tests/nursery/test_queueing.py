"""Admission that waits, through ``open_llm`` with default options and a real engine.

Many more concurrent ``generate`` calls than ``max_pending`` slots all
complete with exact token counts (the tiny model for 2,000, the echo engine
for 20,000), on both backends; a call cancelled while it waits leaves no
trace in the mux or the engine. ``open_llm(overload="raise")`` still refuses
exactly the calls beyond its slots and its queue.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.guards import HANG_GUARD
from tests.nursery.conftest import ENGINE, eventually, fd_count, settled
from tserve import LLM, Overloaded, SamplingParams, open_llm
from tserve.nursery import RequestStream

pytestmark = pytest.mark.anyio


async def _run_all(llm: LLM, n_requests: int, n_tokens: int) -> tuple[list[int], int]:
    """``n_requests`` concurrent generate calls; their token counts and the peak queued."""
    params = SamplingParams(max_tokens=n_tokens, ignore_eos=True, temperature=0)
    counts: list[int] = []
    peak = 0

    async def one(i: int) -> None:
        nonlocal peak
        stream = llm.generate([3 + i % 300, 4 + i % 7], params)
        peak = max(peak, llm.stats.queued_requests)
        tokens = 0
        async for delta in stream:
            tokens += len(delta.token_ids)
        counts.append(tokens)

    with anyio.fail_after(HANG_GUARD * 5):
        async with anyio.create_task_group() as tg:
            for i in range(n_requests):
                tg.start_soon(one, i)
    return counts, peak


# A machine shared with other work can stall this process for many seconds
# while 20,000 tasks run; the engine is not dead for that.
PATIENT: dict[str, Any] = {"heartbeat_timeout": 600.0}


@pytest.fixture(scope="module")
async def tiny(anyio_backend: str, tiny_model_dir: Path) -> AsyncIterator[LLM]:
    async with open_llm(tiny_model_dir, **PATIENT, **ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module")
async def echo(anyio_backend: str, tiny_model_dir: Path) -> AsyncIterator[LLM]:
    async with open_llm(
        tiny_model_dir, engine_kind="echo", echo_step_time=0.001, **PATIENT, **ENGINE
    ) as llm:
        yield llm


async def test_two_thousand_generates_wait_their_turn(tiny: LLM) -> None:
    assert tiny.max_pending == 1024  # the default: fewer slots than calls
    counts, peak = await _run_all(tiny, 2000, 4)
    assert counts == [4] * 2000
    assert peak == 2000 - tiny.max_pending  # every call beyond the slots waited
    await settled(tiny)


async def test_twenty_thousand_generates_on_the_echo_engine(echo: LLM) -> None:
    await settled(echo)
    baseline = fd_count()
    counts, peak = await _run_all(echo, 20_000, 3)
    assert counts == [3] * 20_000
    assert peak == 20_000 - echo.max_pending
    assert fd_count() == baseline
    await settled(echo)


async def test_a_cancelled_waiter_releases_nothing_it_never_held(echo: LLM) -> None:
    await settled(echo)
    mux = echo._mux
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    holders = [echo.generate([5], long) for _ in range(echo.max_pending)]
    adds = mux.stats.adds_sent
    aborts = mux.stats.aborts_sent
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:

            async def wait_in_vain() -> None:
                async for _ in echo.generate([6, 7, 8], long):
                    raise AssertionError("a waiter was given a slot")

            for _ in range(50):
                tg.start_soon(wait_in_vain)
            await eventually(lambda: echo.stats.queued_tokens == 150, "all 50 wait")
            tg.cancel_scope.cancel()
    stats = echo.stats
    assert (stats.live_requests, stats.queued_requests, stats.queued_tokens) == (1024, 0, 0)
    assert echo.admission.running == echo.max_pending  # the holders' slots, untouched
    assert (mux.stats.adds_sent, mux.stats.aborts_sent) == (adds, aborts)  # nothing on the wire
    assert mux.open_mailboxes == 0
    for stream in holders:
        stream.close()
    assert echo.stats.live_requests == 0
    await settled(echo)


@pytest.mark.parametrize("max_queued", [0, 200])
async def test_raise_mode_refuses_exactly_the_excess(tiny_model_dir: Path, max_queued: int) -> None:
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    async with open_llm(
        tiny_model_dir,
        max_pending=100,
        overload="raise",
        max_queued=max_queued,
        engine_kind="echo",
        echo_step_time=0.001,
        **ENGINE,
    ) as llm:
        streams: list[RequestStream] = []
        refused = 0
        for i in range(1000):  # no checkpoint between the calls: none ends meanwhile
            try:
                streams.append(llm.generate([3 + i % 300], params))
            except Overloaded as exc:
                assert exc.retry_after > 0
                refused += 1
        assert refused == 1000 - 100 - max_queued
        assert llm.stats.queued_requests == max_queued
        counts: list[int] = []

        async def read(stream: RequestStream) -> None:
            tokens = 0
            async for delta in stream:
                tokens += len(delta.token_ids)
            counts.append(tokens)

        with anyio.fail_after(HANG_GUARD):
            async with anyio.create_task_group() as tg:
                for stream in streams:
                    tg.start_soon(read, stream)
        assert counts == [3] * len(streams)
        await settled(llm)
