"""Either engine's death ends every call of the LLM, in every state it can be in.

One ``open_llm`` per test (the echo engine, so that generation is paced,
and the packaged embedding model); one engine process is killed for real
(SIGKILL) while requests are held in each state, by things that cannot move
on their own: both engines are stopped (SIGSTOP) once the streams that need
the engine to get going have got there, tokenizers wait on gates that never
open, and slots are full. So nothing races the kill, and every ending is
the kill's. Then every call must end with EngineDeadError naming the kill
(``SIGKILL``; the other engine's calls name the dead one), except the one
whose final output had arrived before the kill: it had finished, and it
ends as it would have (the contract in ``tserve/mux/_lifecycle.py``, rule 4).

States held, generation: reading mid-stream; a reader that stopped reading
while deltas merged in its mailbox; finished but not read; sent and waiting
for the first token; tokenizing; queued for a slot. Embedding: sent and
waiting for the vectors; tokenizing; queued for a slot.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.guards import HANG_GUARD
from tests.markers import needs_embedding_model
from tests.nursery.conftest import ENGINE, eventually
from tserve import LLM, EngineDeadError, SamplingParams, open_llm
from tserve.nursery import Embedder, RequestState, RequestStream

pytestmark = [pytest.mark.anyio, pytest.mark.slow, needs_embedding_model]

SLOTS = 8  # each engine's admission: max_pending
WAITING = SLOTS - 4  # sent, waiting for the first token: with 4 more, every slot is taken
HELD = {
    "reading",
    "merged",
    "finished",
    *(f"first token {i}" for i in range(WAITING)),
    "tokenizing",
    "queued",
    "embedding",
    "embedding tokenizing",
    "embedding queued",
}


class Gate:
    """A tokenizer that never finishes: ``entered`` once it is called."""

    def __init__(self) -> None:
        self.entered = anyio.Event()

    async def wait_forever(self) -> list[int]:
        self.entered.set()
        await anyio.Event().wait()
        raise AssertionError("the gate opened")


class GatedEncoder:
    """The embedder's tokenizer, held at its gate (the rest of it as it is)."""

    def __init__(self, real: Any, gate: Gate) -> None:
        self.tokenizer = real.tokenizer
        self._gate = gate

    async def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [await self._gate.wait_forever()]


class Endings:
    """How each held call ended: "error: <message>", or the finish reason."""

    def __init__(self) -> None:
        self.by_name: dict[str, str] = {}
        self.killed = anyio.Event()

    async def stream(
        self, name: str, stream: RequestStream, pause_after_first: bool = False
    ) -> None:
        """Read ``stream`` to its end; with ``pause_after_first``, stop reading
        after the first delta until the kill."""
        try:
            async with stream:
                finish = None
                async for delta in stream:
                    finish = delta.finish_reason
                    if pause_after_first:
                        pause_after_first = False
                        await self.killed.wait()
                self.by_name[name] = f"finished: {finish}"
        except EngineDeadError as exc:
            self.by_name[name] = f"error: {exc}"

    async def call(self, name: str, call: Callable[[], Awaitable[object]]) -> None:
        try:
            await call()
            self.by_name[name] = "finished"
        except EngineDeadError as exc:
            self.by_name[name] = f"error: {exc}"


def _stopped(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


def _embedder(llm: LLM) -> Embedder:
    assert llm.embedder is not None
    return llm.embedder


@pytest.mark.parametrize("killed", ["generation", "embedding"])
async def test_a_killed_engine_ends_every_call_in_every_state(
    tiny_model_dir: Path, killed: str
) -> None:
    async with open_llm(
        tiny_model_dir,
        max_pending=SLOTS,
        embedding_model="default",
        engine_kind="echo",
        echo_step_time=0.05,
        **ENGINE,
    ) as llm:
        embedder = _embedder(llm)
        pids = {"generation": llm.engine_pid, "embedding": embedder.engine_pid}
        survivor = "embedding" if killed == "generation" else "generation"
        endings = Endings()
        long = SamplingParams(max_tokens=llm.ready.max_model_len - 8, ignore_eos=True)
        routed = llm._mux.stats
        with anyio.fail_after(HANG_GUARD):
            async with anyio.create_task_group() as tg:
                # While the engines run: the streams that need them to get going.
                reading, merged = llm.generate([1], long), llm.generate([1], long)
                tg.start_soon(endings.stream, "reading", reading)
                tg.start_soon(endings.stream, "merged", merged, True)
                finished = llm.generate([1], SamplingParams(max_tokens=3, ignore_eos=True))
                tg.start_soon(endings.stream, "finished", finished, True)
                await eventually(lambda: merged.state is RequestState.STREAMING, "merged streams")
                since = routed.deltas_routed
                await eventually(
                    lambda: routed.deltas_routed >= since + 8, "deltas merge in a mailbox"
                )
                await eventually(lambda: finished.state is RequestState.FINISHED, "a finish")
                # Nothing moves from here on but what the kill does.
                for pid in pids.values():
                    _stopped(pid)
                waiting = [llm.generate([1], long) for _ in range(WAITING)]
                for i, stream in enumerate(waiting):
                    tg.start_soon(endings.stream, f"first token {i}", stream)
                gate = Gate()
                tokenizing = llm._admit(gate.wait_forever, long, None, None)
                tg.start_soon(endings.stream, "tokenizing", tokenizing)
                queued = llm.generate([1], long)
                tg.start_soon(endings.stream, "queued", queued)
                # The embeddings: one call in the engine, one tokenizing, one queued.
                tg.start_soon(endings.call, "embedding", lambda: llm.embed([[101, 102]] * 4))
                embed_gate = Gate()
                embedder._tokens = GatedEncoder(embedder._tokens, embed_gate)  # type: ignore[assignment]
                tg.start_soon(endings.call, "embedding tokenizing", lambda: llm.embed("held"))
                await eventually(lambda: embedder.admission.running == 5, "embeddings admitted")
                tg.start_soon(endings.call, "embedding queued", lambda: llm.embed(["a"] * 4))
                await eventually(
                    lambda: (
                        all(s.state is RequestState.SUBMITTED for s in waiting)
                        and gate.entered.is_set()
                        and embed_gate.entered.is_set()
                        and llm.admission.queued == 1
                        and embedder.admission.queued == 4
                        and embedder._mux.open_mailboxes == 4
                    ),
                    "every call held in its state",
                )
                os.kill(pids[killed], signal.SIGKILL)
                await eventually(lambda: not llm.engine_alive, "the engines are dead")
                with contextlib.suppress(ProcessLookupError):  # let it take its Shutdown
                    os.kill(pids[survivor], signal.SIGCONT)
                endings.killed.set()
        reason = llm._mux.dead_reason or ""
    assert set(endings.by_name) == HELD
    assert endings.by_name.pop("finished") == "finished: length"
    assert "SIGKILL" in reason
    for name, ending in endings.by_name.items():
        assert ending.startswith("error: ") and "SIGKILL" in ending, (name, ending)
        kind = "embedding" if name.startswith("embedding") else "generation"
        # The other engine's calls fail with the killed engine's name and reason.
        named = ending.startswith(f"error: {killed} engine: ")
        assert named == (kind != killed), (name, ending)
