"""Load, cancellation and engine death through ``open_llm`` with a real engine process.

One engine per backend serves the whole module (starting one takes
seconds); the kill -9 test ends it, so it runs last.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from tests.guards import HANG_GUARD
from tests.nursery.conftest import (
    ENGINE,
    Wire,
    eventually,
    fd_count,
    settled,
)
from tests.processes import process_gone
from tserve import LLM, EngineDeadError, RequestTimeout, SamplingParams, open_llm
from tserve.protocol import FinishReason

pytestmark = pytest.mark.anyio

MAX_NUM_SEQS = 256
KV_TOKENS = 1 << 17  # room for every running request's whole context


@pytest.fixture(scope="module")
async def llm(anyio_backend: str, tiny_model_dir: Path) -> AsyncIterator[LLM]:
    async with open_llm(
        tiny_model_dir,
        max_pending=20_000,
        max_num_seqs=MAX_NUM_SEQS,
        kv_cache_tokens=KV_TOKENS,
        max_num_batched_tokens=4096,
        **ENGINE,
    ) as llm:
        yield llm


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(rng.randrange(1, 12))]


@pytest.mark.usefixtures("no_gc")
async def test_ten_thousand_concurrent_generates(llm: LLM, wire: Wire) -> None:
    """The seed's load test, embedded: 10,000 concurrent requests of exactly N
    tokens (EOS ignored) through one mux; none errors, every one gets N
    tokens, and the fd count with 10,000 in flight equals that with one."""
    n_requests, n_tokens = 10_000, 6
    params = SamplingParams(max_tokens=n_tokens, ignore_eos=True, temperature=0)
    rng = random.Random(1)
    # One request in flight, with the tokenizer's thread and the grammar
    # worker started: the baseline.
    await settled(llm)
    async with llm.generate("warm up", params) as stream:
        await stream.__anext__()
        baseline = fd_count()
        async for _ in stream:
            pass
    counts: list[int] = []
    failures: list[BaseException] = []
    fds: list[int] = []
    all_admitted = False

    async def one(prompt: str | list[int]) -> None:
        nonlocal all_admitted
        tokens = 0
        try:
            stream = llm.generate(prompt, params)
            if llm.stats.live_requests == n_requests:
                all_admitted = True  # nothing can finish before all are admitted
                fds.append(fd_count())
            async for delta in stream:
                tokens += len(delta.token_ids)
        except Exception as exc:
            failures.append(exc)
        counts.append(tokens)

    async def watch_fds() -> None:
        while True:
            fds.append(fd_count())
            await anyio.sleep(0.05)

    with anyio.fail_after(HANG_GUARD * 3):
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_fds)
            async with anyio.create_task_group() as requests:
                for i in range(n_requests):
                    # Every tenth prompt is text, tokenized in a worker thread.
                    requests.start_soon(one, f"request {i}" if i % 10 == 0 else _prompt(rng))
            tg.cancel_scope.cancel()
    assert failures == []
    assert counts == [n_tokens] * n_requests
    assert all_admitted  # they really were all in flight at once
    assert set(fds) == {baseline}
    assert wire.aborts == []  # finished requests are never aborted
    await settled(llm)


async def test_cancellation_storm(llm: LLM, wire: Wire) -> None:
    """1,000 streams end at random points: cancel scopes, ``break`` out of the
    iterator, deadlines, and some run to the end. Afterwards the engine runs
    nothing and has its whole KV budget free, and the aborts add up exactly.

    The accounting: a request gets an abort iff it was closed before its
    final output reached this process. Such a final (the engine's answer to
    the abort, or, if the engine finished the request while the abort was
    on its way, its normal ending) arrives after the close: it is "late".
    So the aborts on the wire are exactly the late finals, one each, and
    the engine counts every abort it received. An abort that crossed a
    finishing request on the wire (the only race: the engine's copy of a
    deadline expires a second after ours) is idempotent in the engine; its
    final shows a reason other than ABORT.
    """
    await settled(llm)
    aborts_before = llm._mux.engine_stats.aborts_received
    rng = random.Random(7)
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    short = SamplingParams(max_tokens=4, ignore_eos=True)
    outcomes: Counter[str] = Counter()

    async def cancelled_by_scope(prompt: list[int], after: float) -> None:
        with anyio.move_on_after(after):
            async for _ in llm.generate(prompt, long):
                pass
            outcomes["finished"] += 1
            return
        outcomes["cancelled"] += 1

    async def broken_off(prompt: list[int] | str, deltas: int) -> None:
        async for _ in llm.generate(prompt, long):
            deltas -= 1
            if deltas <= 0:
                break
        outcomes["break"] += 1

    async def deadline(prompt: list[int], seconds: float) -> None:
        try:
            async for _ in llm.generate(prompt, long, timeout=seconds):
                pass
        except RequestTimeout:
            outcomes["timeout"] += 1
        else:
            outcomes["finished"] += 1

    async def to_the_end(prompt: list[int]) -> None:
        async for _ in llm.generate(prompt, short):
            pass
        outcomes["finished"] += 1

    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            for i in range(1000):
                prompt = _prompt(rng)
                kind = i % 4
                if kind == 0:
                    tg.start_soon(cancelled_by_scope, prompt, rng.uniform(0, 0.5))
                elif kind == 1:
                    text_or_ids = f"story {i}" if i % 8 == 1 else prompt
                    tg.start_soon(broken_off, text_or_ids, rng.randrange(1, 40))
                elif kind == 2:
                    tg.start_soon(deadline, prompt, rng.uniform(0, 0.5))
                else:
                    tg.start_soon(to_the_end, prompt)
                if i % 50 == 0:
                    await anyio.sleep(0.01)  # arrivals spread over time
    assert sum(outcomes.values()) == 1000
    await settled(llm)  # zero running, zero waiting, the whole KV budget free
    await eventually(lambda: len(wire.finals) == wire.adds, "one final per request")
    counts = wire.abort_counts()
    assert set(counts.values()) <= {1}, "a request was aborted twice"
    assert set(counts) == wire.late
    assert llm._mux.engine_stats.aborts_received - aborts_before == len(wire.aborts)
    assert llm.stats.aborts_sent >= len(wire.aborts)
    crossed = [rid for rid in wire.late if wire.finals[rid] is not FinishReason.ABORT]
    print(f"storm: {dict(outcomes)}, {len(wire.aborts)} aborts, {len(crossed)} crossed")
    assert outcomes["cancelled"] + outcomes["break"] + outcomes["timeout"] > 500


async def test_kill_9_fails_every_stream(llm: LLM) -> None:
    """kill -9 of the engine while 500 requests stream: every one raises
    EngineDeadError (none hangs), a new request is refused at once, and the
    LLM reports the engine dead. Ends the module's engine."""
    await settled(llm)
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    rng = random.Random(3)
    errors: list[BaseException] = []
    streaming = 0

    async def stream() -> None:
        nonlocal streaming
        first = True
        try:
            async for _ in llm.generate(_prompt(rng), params):
                if first:
                    streaming += 1
                    first = False
        except BaseException as exc:  # the test asserts on exactly what arrived
            errors.append(exc)
            if not isinstance(exc, Exception):
                raise

    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            for _ in range(500):
                tg.start_soon(stream)
            await eventually(lambda: streaming >= MAX_NUM_SEQS // 2, "requests stream")
            pid = llm.engine_pid
            llm.kill_engine()
            reason = await llm.wait_engine_dead()
    assert len(errors) == 500
    assert all(isinstance(e, EngineDeadError) for e in errors), Counter(map(type, errors))
    assert "SIGKILL" in reason
    assert not llm.engine_alive
    with pytest.raises(EngineDeadError):
        llm.generate("hello", params)
    await eventually(lambda: process_gone(pid), "the killed engine is reaped")
