"""LLM.embed through a real embedding engine process (all-MiniLM-L6-v2), on both backends.

One ``open_llm`` (tiny generation model + the default embedding model) per
backend serves the module; the test that kills the embedding engine runs last.
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from tests.guards import HANG_GUARD
from tests.markers import needs_embedding_model
from tests.nursery.conftest import ENGINE, eventually
from tests.processes import process_gone
from tserve import LLM, EngineDeadError, InvalidRequest, Overloaded, SamplingParams, open_llm
from tserve.nursery import Embedder
from tserve.nursery._admission import Overload

pytestmark = [
    pytest.mark.anyio,
    needs_embedding_model,
]

DIM = 384


@pytest.fixture(scope="module")
async def llm(anyio_backend: str, tiny_model_dir: Path) -> AsyncIterator[LLM]:
    async with open_llm(
        tiny_model_dir, max_pending=100, embedding_model="default", **ENGINE
    ) as llm:
        yield llm


def embedder_of(llm: LLM) -> Embedder:
    assert llm.embedder is not None
    return llm.embedder


async def embedder_settled(embedder: Embedder) -> None:
    """Nothing live or waiting, and the engine has counted every abort we sent."""
    mux = embedder._mux

    def idle() -> bool:
        engine = mux.engine_stats
        return (
            mux.open_mailboxes == 0
            and engine.waiting == 0
            and engine.aborts_received == mux.stats.aborts_sent
        )

    await eventually(idle, "the embedding engine settles")
    assert embedder.live == 0


async def test_one_call_is_one_frame_and_vectors_come_in_input_order(llm: LLM) -> None:
    embedder = embedder_of(llm)
    assert (embedder.model, embedder.dimensions, embedder.max_input_tokens) == (
        "all-MiniLM-L6-v2",
        DIM,
        256,
    )
    texts = ["A man is eating food.", "A man is eating a piece of bread.", "Stocks fell."]
    frames = embedder._mux.stats.frames_sent
    result = await llm.embed(texts)
    assert embedder._mux.stats.frames_sent == frames + 1, "all inputs travel in one frame"
    vectors = result.vectors()
    assert len(vectors) == 3 and all(len(v) == DIM for v in vectors)
    assert all(math.isclose(sum(x * x for x in v), 1.0, abs_tol=1e-5) for v in vectors)
    alone = [(await llm.embed(t)).vectors()[0] for t in texts]
    for v, w in zip(vectors, alone, strict=True):
        assert v == pytest.approx(w, abs=1e-5)
    assert result.prompt_tokens == sum(len(ids) for ids in embedder.tokenize(texts))
    ids = await llm.embed([[101, 7592, 102]])
    assert ids.prompt_tokens == 3
    assert ids.vectors()[0] == pytest.approx((await llm.embed("hello")).vectors()[0], abs=1e-6)
    await embedder_settled(embedder)


@pytest.mark.parametrize(
    "inputs",
    [[], "", ["ok", ""], "word " * 300, [[101, 30522]], [[]], ["text", [101]], [[True, 1]]],
    ids=["no-input", "empty", "empty-item", "too-long", "bad-id", "empty-ids", "mixed", "bools"],
)
async def test_bad_inputs_are_refused_before_the_engine(llm: LLM, inputs: object) -> None:
    embedder = embedder_of(llm)
    adds = embedder._mux.stats.adds_sent
    with pytest.raises(InvalidRequest) as info:
        await llm.embed(inputs)  # type: ignore[arg-type]
    assert info.value.param == "input"
    assert embedder._mux.stats.adds_sent == adds
    assert embedder.live == 0


async def test_admission(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    embedder = embedder_of(llm)
    with pytest.raises(InvalidRequest, match="at most 100") as info:
        await llm.embed(["x"] * 101)
    assert info.value.param == "input"
    monkeypatch.setattr(embedder.admission, "running", embedder.max_pending)
    monkeypatch.setattr(embedder.admission, "overload", Overload.RAISE)
    with pytest.raises(Overloaded):
        await llm.embed("x")
    monkeypatch.setattr(llm, "embedder", None)
    with pytest.raises(InvalidRequest, match="no embedding model") as info:
        await llm.embed("x")
    assert info.value.param == "model"


async def test_cancelling_a_call_aborts_every_unanswered_input(llm: LLM) -> None:
    embedder = embedder_of(llm)
    mux = embedder._mux
    adds, aborts = mux.stats.adds_sent, mux.stats.aborts_sent
    texts = [f"sentence {i} " + "about nothing in particular " * 10 for i in range(64)]
    async with anyio.create_task_group() as tg:
        tg.start_soon(embedder.embed, texts)
        # The engine needs a forward pass of all 64 before it can answer any.
        await eventually(lambda: mux.stats.adds_sent == adds + 64, "the adds are sent")
        tg.cancel_scope.cancel()
    assert embedder.live == 0 and mux.open_mailboxes == 0
    await eventually(lambda: mux.stats.aborts_sent == aborts + 64, "one abort per input")
    await embedder_settled(embedder)
    assert len((await llm.embed("still works")).raw) == 1


async def test_a_dead_embedding_engine_ends_generation_too(llm: LLM) -> None:
    """Last in the module: it kills this backend's embedding engine. Either
    engine's death is the LLM's: live generation streams end with
    EngineDeadError naming the embedding engine, and the generation engine,
    asked to shut down, exits. The generation engine is stopped (SIGSTOP)
    from before the streams start until they have failed, so none can finish
    first."""
    embedder = embedder_of(llm)
    failures: list[str] = []

    async def stream() -> None:
        with pytest.raises(EngineDeadError) as caught:
            async for _ in llm.generate("Hello", SamplingParams(max_tokens=500, ignore_eos=True)):
                pass
        failures.append(str(caught.value))

    os.kill(llm.engine_pid, signal.SIGSTOP)
    try:
        with anyio.fail_after(HANG_GUARD):
            async with anyio.create_task_group() as tg:
                for _ in range(5):
                    tg.start_soon(stream)
                await eventually(lambda: llm.stats.live_requests == 5, "five streams are live")
                embedder.kill_engine()
    finally:
        os.kill(llm.engine_pid, signal.SIGCONT)
    assert len(failures) == 5
    assert all(f.startswith("embedding engine: ") and "SIGKILL" in f for f in failures)
    assert not llm.engine_alive
    assert (llm.engine_dead_reason or "").startswith("embedding engine: ")
    with pytest.raises(EngineDeadError):
        await llm.embed("x")
    with pytest.raises(EngineDeadError):
        await llm.complete("Hello", SamplingParams(max_tokens=3))
    await eventually(lambda: process_gone(embedder.engine_pid), "the embedding engine is reaped")
    await eventually(lambda: process_gone(llm.engine_pid), "the generation engine exits")
