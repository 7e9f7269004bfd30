"""The embeddable API against a real engine process with the tiny model, on both backends.

One engine per backend serves the module; every test leaves it idle.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from tests.guards import HANG_GUARD
from tests.nursery.conftest import ENGINE, Wire, eventually, settled
from tserve import (
    LLM,
    InvalidRequest,
    Overloaded,
    RequestTimeout,
    SamplingParams,
    ShuttingDown,
    open_llm,
)
from tserve.gpu.engine._core import STALL_FAULT_ENV
from tserve.nursery import RequestState
from tserve.nursery._admission import Overload
from tserve.nursery._tokenizer import INLINE_TOKENIZE_CHARS
from tserve.protocol import FinishReason

pytestmark = pytest.mark.anyio

MAX_NUM_SEQS = 8
LONG = SamplingParams(max_tokens=480, ignore_eos=True)  # the context is 512


@pytest.fixture(scope="module")
async def llm(anyio_backend: str, tiny_model_dir: Path) -> AsyncIterator[LLM]:
    async with open_llm(
        tiny_model_dir, max_pending=1000, max_num_seqs=MAX_NUM_SEQS, **ENGINE
    ) as llm:
        yield llm


async def test_complete_returns_exactly_max_tokens(llm: LLM) -> None:
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    result = await llm.complete("Hello there", params)
    assert len(result.token_ids) == 7
    assert result.finish_reason == "length"
    assert result.usage.completion_tokens == 7
    assert result.usage.prompt_tokens == len(result.prompt_token_ids) > 0
    assert result.text == llm.decode(result.token_ids)
    await settled(llm)


async def test_streamed_text_equals_the_whole_text(llm: LLM) -> None:
    """Same seeded request twice: the streamed deltas joined equal the
    non-streamed text, which equals decoding all the ids at once (no U+FFFD
    from a character split between deltas)."""
    params = SamplingParams(max_tokens=120, seed=1234, temperature=1.0, ignore_eos=True)
    prompt = "Once upon a time, ünïcödé ✓"
    whole = await llm.complete(prompt, params)
    pieces: list[str] = []
    ids: list[int] = []
    async for delta in llm.generate(prompt, params):
        pieces.append(delta.text)
        ids += delta.token_ids
    assert ids == whole.token_ids
    assert "".join(pieces) == whole.text == llm.decode(ids)
    await settled(llm)


async def test_stop_string_split_across_tokens_is_honoured(
    llm: LLM, wire: Wire, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop string made of the end of one token and the start of the next:
    the text stops before it, nothing past it is ever streamed, and the
    engine (still generating) gets exactly one abort.

    The stream runs on an engine of its own whose step ``cut + 10`` is held
    (the stall hook) until the stream has ended, so the engine cannot finish
    on its own before the API process finds the stop string, however busy
    the machine."""
    base = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    prompt = "The quick brown fox"
    full = await llm.complete(prompt, base)
    texts = [llm.decode([t]) for t in full.token_ids]
    # The first boundary between two clean (ASCII, non-empty) tokens, after a few tokens.
    cut = next(
        i
        for i in range(3, len(texts) - 60)
        if texts[i].isascii() and texts[i + 1].isascii() and texts[i] and texts[i + 1]
    )
    stop = texts[cut][-1] + texts[cut + 1][0]
    expected = full.text[: full.text.index(stop)]
    params = SamplingParams(
        max_tokens=480, temperature=0.0, ignore_eos=True, stop=("never matches", stop)
    )
    # Step 1 writes token 0, step s token s - 1: token cut + 1 comes at step cut + 2.
    monkeypatch.setenv(STALL_FAULT_ENV, f"{cut + 10}:progress:{tmp_path}")
    async with open_llm(tiny_model_dir, **ENGINE) as held:
        streamed: list[str] = []
        finish = None
        stream = held.generate(prompt, params)
        async for delta in stream:
            streamed.append(delta.text)
            finish = delta.finish_reason
        (tmp_path / "release").touch()
        assert "".join(streamed) == expected
        assert finish == "stop"
        assert stream.state is RequestState.ABORTED
        await settled(held)
        assert wire.aborts == [stream.request_id]


async def test_chat_applies_the_template(llm: LLM) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
    ]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    result = await llm.complete_chat(messages, params)
    template = llm.tokenizer.render_chat(messages, add_generation_prompt=True)
    assert result.prompt_token_ids == llm.encode(template)
    assert template.endswith("<|im_start|>assistant\n")
    assert len(result.token_ids) == 5
    with pytest.raises(InvalidRequest):
        llm.chat(["not a message"])  # type: ignore[list-item]
    await settled(llm)


async def test_short_prompts_tokenize_on_the_loop(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below INLINE_TOKENIZE_CHARS a prompt or chat is tokenized in the loop's
    own thread (cheaper than the hop to a worker), with the same ids."""
    loop_thread = threading.get_ident()
    threads: list[int] = []
    encode = llm._tokens.encode

    def recording_encode(text: str, param: str = "prompt", *, special: bool = True) -> list[int]:
        threads.append(threading.get_ident())
        return encode(text, param, special=special)

    monkeypatch.setattr(llm._tokens, "encode", recording_encode)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    short = "ab " * ((INLINE_TOKENIZE_CHARS - 1) // 3)  # fewer tokens than the context
    result = await llm.complete(short, params)
    assert result.prompt_token_ids == encode(short)
    chat = await llm.complete_chat([{"role": "user", "content": "hi"}], params)
    assert chat.finish_reason == "length"
    assert await llm.tokenize("hello") == encode("hello")
    assert len(threads) == 3 and set(threads) == {loop_thread}
    await settled(llm)


async def test_long_tokenization_runs_in_a_worker_thread(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long prompt is tokenized in a worker thread, and a tokenization that
    blocks holds no other request up: one with token ids runs to completion
    meanwhile."""
    loop_thread = threading.get_ident()
    entered, release = threading.Event(), threading.Event()
    threads: list[int] = []
    encode = llm._tokens.encode

    def blocking_encode(text: str, *, special: bool = True) -> list[int]:
        threads.append(threading.get_ident())
        entered.set()
        release.wait(HANG_GUARD)
        return encode(text, special=special)

    monkeypatch.setattr(llm._tokens, "encode", blocking_encode)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    results: list[str] = []

    async def slow() -> None:
        prompt = "slow " * (INLINE_TOKENIZE_CHARS // 5 + 1)  # long: a worker thread
        results.append((await llm.complete(prompt, params)).finish_reason)

    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            tg.start_soon(slow)
            await eventually(entered.is_set, "tokenization started")
            other = await llm.complete([5, 6, 7], params)  # the loop is free
            assert other.finish_reason == "length"
            assert results == []
            release.set()
    assert results == ["length"]
    assert threads and loop_thread not in threads
    await settled(llm)


async def test_deadline_raises_request_timeout_and_aborts(llm: LLM, wire: Wire) -> None:
    """A request queued behind long ones passes its deadline: RequestTimeout,
    and one abort removes it from the engine (its final output is ABORT)."""
    stop_hogs = anyio.Event()

    async def hog() -> None:
        with anyio.CancelScope() as scope:
            async with llm.generate([9, 9, 9], LONG) as stream:
                async for _ in stream:
                    if stop_hogs.is_set():
                        scope.cancel()

    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            for _ in range(MAX_NUM_SEQS):
                tg.start_soon(hog)
            await eventually(lambda: llm.stats.engine.running == MAX_NUM_SEQS, "hogs run")
            stream = llm.generate([1, 2, 3], LONG, timeout=0.2)
            with pytest.raises(RequestTimeout):
                async for _ in stream:
                    pass
            stop_hogs.set()
    await settled(llm)
    assert wire.abort_counts()[stream.request_id] == 1
    assert wire.finals[stream.request_id] is FinishReason.ABORT
    assert stream.request_id in wire.late
    assert set(wire.abort_counts().values()) == {1}
    assert set(wire.abort_counts()) == wire.late  # hogs cancelled mid-stream, and the late one


async def test_break_and_drop_abort_once(llm: LLM, wire: Wire) -> None:
    """``break`` out of ``async for`` (no other reference to the stream) aborts
    it; a stream dropped before it was iterated only frees its slot; a
    request whose final output arrived but was never read is not aborted."""
    async for _ in llm.generate([4, 5, 6], LONG):
        break
    await eventually(lambda: len(wire.aborts) == 1, "the abandoned stream is aborted")
    llm.generate("never iterated", LONG)
    finished = llm.generate([7, 8], SamplingParams(max_tokens=2, ignore_eos=True))
    await finished.__anext__()
    await eventually(lambda: finished.request_id in wire.finals, "the engine finishes it")
    finished.close()
    await settled(llm)  # also: no slot is left taken
    assert len(wire.aborts) == 1


async def test_bad_prompt_is_refused_and_frees_its_slot(llm: LLM) -> None:
    with pytest.raises(InvalidRequest) as info:
        await llm.complete([1] * 10, SamplingParams(max_tokens=10_000))
    assert info.value.param == "max_tokens"
    with pytest.raises(InvalidRequest):
        await llm.complete([], SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequest):
        await llm.complete([1, 10**6], SamplingParams(max_tokens=1))
    assert llm.stats.live_requests == 0


async def test_over_admission_is_refused_at_once(llm: LLM) -> None:
    """max_pending=100 and 1,000 simultaneous requests: exactly 900 are refused
    with Overloaded by the call itself (no await), the 100 admitted complete."""
    saved = llm.max_pending
    llm.max_pending = 100
    llm.admission.overload = Overload.RAISE
    go, all_called = anyio.Event(), anyio.Event()
    calls = refused = 0
    completed: list[int] = []

    def called() -> None:
        nonlocal calls
        calls += 1
        if calls == 1000:
            all_called.set()

    async def one(i: int) -> None:
        nonlocal refused
        await go.wait()
        try:
            stream = llm.generate([i % 400 + 3], SamplingParams(max_tokens=4, ignore_eos=True))
        except Overloaded as exc:
            assert exc.retry_after > 0
            refused += 1
            called()
            return
        called()
        async with stream:
            await all_called.wait()  # none ends before all have asked
            tokens = 0
            async for delta in stream:
                tokens += len(delta.token_ids)
        completed.append(tokens)

    try:
        with anyio.fail_after(HANG_GUARD):
            async with anyio.create_task_group() as tg:
                for i in range(1000):
                    tg.start_soon(one, i)
                await anyio.lowlevel.checkpoint()
                go.set()
    finally:
        llm.max_pending = saved
        llm.admission.overload = Overload.WAIT
    assert refused == 900
    assert completed == [4] * 100
    await settled(llm)


async def test_draining_refuses_new_requests(llm: LLM) -> None:
    llm.draining = True
    try:
        with pytest.raises(ShuttingDown):
            llm.generate("hi")
    finally:
        llm.draining = False
    assert llm.engine_alive
