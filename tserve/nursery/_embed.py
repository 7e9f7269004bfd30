"""Embeddings through a second engine process: :class:`Embedder`, :func:`open_embedder`.

The embedding engine is an engine process like the generation one (``python
-m tserve.gpu`` with ``EngineConfig.task = "embed"``), with its own mux in
this process; everything else is shared design: one socket, batched frames,
per-request mailboxes, engine death as an error in every live request.

One call of :meth:`Embedder.embed` is one engine request per input, all
submitted at once (so they travel in one frame and are embedded in the same
forward pass when they fit). Every way out of the call closes every mailbox
synchronously, which aborts in the engine whatever it has not answered yet:
a cancelled or timed-out call leaves nothing behind.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import sys
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import anyio

from tserve.mux import Mailbox, Mux, MuxClosedError
from tserve.nursery._engine_process import EngineRef, start_engine
from tserve.nursery._errors import (
    InvalidRequest,
    Overloaded,
    RequestFailed,
    RequestTimeout,
    ShuttingDown,
)
from tserve.nursery._llm import EngineClient, engine_session
from tserve.nursery._request import ENGINE_DEADLINE_SLACK
from tserve.protocol import (
    AddRequest,
    EngineConfig,
    EngineReady,
    FinishReason,
    RequestOutput,
    SamplingParams,
)
from tserve.validity import embedding_problem

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "Embedder",
    "EmbeddingInput",
    "EmbeddingResult",
    "attach_embedder",
    "embedding_config",
    "open_embedder",
]

EmbeddingInput = str | Sequence[str] | Sequence[Sequence[int]]
"""A text, texts, or token ids per input (as the encoder's tokenizer makes them)."""

# The embedding engine's bounds of one forward pass: inputs, and tokens once
# padded to the longest input. 4096 is 16 inputs of MiniLM's full 256 tokens,
# or 64 of a typical sentence.
EMBED_MAX_NUM_SEQS: Final = 64
EMBED_MAX_NUM_BATCHED_TOKENS: Final = 4096
# Options an embedding engine takes over from the generation engine's.
_SHARED_OPTIONS: Final = ("threads", "device", "cpu_gemm", "heartbeat_interval")
_PARAMS: Final = SamplingParams(max_tokens=1)  # the engine ignores them


@dataclasses.dataclass(frozen=True, slots=True)
class EmbeddingResult:
    """One vector per input, in input order.

    ``raw[i]`` is the unit-norm vector of input ``i`` as little-endian
    float32 bytes (exactly what OpenAI's ``encoding_format="base64"``
    carries); :meth:`vectors` gives them as Python floats.
    ``prompt_tokens`` counts the tokens of every input.
    """

    raw: list[bytes]
    prompt_tokens: int
    model: str

    def vectors(self) -> list[list[float]]:
        out = []
        for data in self.raw:
            values = array.array("f", data)
            if sys.byteorder == "big":
                values.byteswap()
            out.append(values.tolist())
        return out


def embedding_config(model: str, engine_options: Mapping[str, Any]) -> EngineConfig:
    """The embedding engine's config: ``threads``, ``device``, ``cpu_gemm`` and
    ``heartbeat_interval`` from the generation engine's options, batch bounds of its own."""
    shared = {k: engine_options[k] for k in _SHARED_OPTIONS if k in engine_options}
    return EngineConfig(
        model=model,
        task="embed",
        max_num_seqs=EMBED_MAX_NUM_SEQS,
        max_num_batched_tokens=EMBED_MAX_NUM_BATCHED_TOKENS,
        **shared,
    )


class Embedder(EngineClient):
    """Embed text with the embedding engine behind one mux. Create with :func:`open_embedder`.

    Admission: at most ``max_pending`` inputs are live at once (each input is
    one engine request); a call that would go past it raises
    :class:`Overloaded` at once, and one with more inputs than that raises
    :class:`InvalidRequest`. Call it from the event loop thread that opened it.
    """

    _dead = "the embedding engine is dead"
    _closed = "the embedding model is closed"

    def __init__(
        self,
        mux: Mux,
        engine: EngineRef,
        ready: EngineReady,
        tokenizer: Tokenizer,
        *,
        max_pending: int,
        request_timeout: float | None,
        mux_done: anyio.Event,
    ) -> None:
        super().__init__(
            mux,
            engine,
            ready,
            max_pending=max_pending,
            request_timeout=request_timeout,
            mux_done=mux_done,
            id_prefix=f"emb-{uuid.uuid4().hex[:8]}",
        )
        self.tokenizer = tokenizer
        # Invariant: 0 <= live <= max_pending; inputs of calls in progress.
        self.live = 0
        # Tokenizer calls in worker threads; more wait for a thread (they are
        # admitted, so at most max_pending inputs' worth of calls wait).
        self._tokenizer_limiter = anyio.CapacityLimiter(2)

    @property
    def dimensions(self) -> int:
        return self.ready.embedding_dim

    @property
    def max_input_tokens(self) -> int:
        return self.ready.max_model_len

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, special tokens included, never truncated. Blocking."""
        return [list(e.ids) for e in self.tokenizer.encode_batch(texts)]

    async def embed(self, inputs: EmbeddingInput) -> EmbeddingResult:
        """Embed every input; return the vectors in input order.

        A checkpoint. Raises at once (before any work) InvalidRequest for
        bad inputs (``param`` "input"), Overloaded, ShuttingDown or
        EngineDeadError. Texts are tokenized in a worker thread; an input
        longer than :attr:`max_input_tokens` is refused (InvalidRequest),
        never truncated. ``request_timeout`` (if set) ends the call with
        RequestTimeout; for a shorter bound, cancel it (``anyio.fail_after``).
        Cancellation, a timeout or any error aborts in the engine what it
        has not answered.
        """
        items = _inputs(inputs)
        self._admit(len(items))
        self.live += len(items)
        try:
            timeout = self.request_timeout
            if timeout is None:
                return await self._embed(items, None)
            deadline = time.time() + timeout + ENGINE_DEADLINE_SLACK
            with anyio.move_on_after(timeout):
                return await self._embed(items, deadline)
            raise RequestTimeout(f"the embedding request passed its deadline ({timeout:g} s)")
        finally:
            self.live -= len(items)

    def _admit(self, count: int) -> None:
        self._check_running()
        if count > self.max_pending:
            raise InvalidRequest(
                f"{count} inputs in one request; the server takes at most {self.max_pending}",
                param="input",
            )
        if self.live + count > self.max_pending:
            raise Overloaded(f"{self.max_pending} embedding inputs are already in flight")

    async def _embed(
        self, items: list[str] | list[list[int]], deadline: float | None
    ) -> EmbeddingResult:
        if items and isinstance(items[0], str):
            texts = [t for t in items if isinstance(t, str)]
            ids = await anyio.to_thread.run_sync(
                self.tokenize, texts, limiter=self._tokenizer_limiter
            )
        else:
            ids = [list(t) for t in items if not isinstance(t, str)]
        self._check(ids)
        mailboxes: list[Mailbox] = []
        try:
            try:
                for tokens in ids:
                    rid = self._next_request_id()
                    mailboxes.append(self._mux.open_mailbox(rid, 1))
                    self._mux.submit(AddRequest(rid, tokens, _PARAMS, deadline))
                raw = [_vector(await mailbox.get(), deadline) for mailbox in mailboxes]
            except MuxClosedError:
                raise ShuttingDown("the embedding model was closed during the request") from None
        finally:
            for mailbox in mailboxes:
                mailbox.close()  # aborts in the engine what it has not answered
        return EmbeddingResult(raw, sum(len(t) for t in ids), self.model)

    def _check(self, ids: list[list[int]]) -> None:
        """Refuse what the engine would refuse, naming the input."""
        vocab = self.ready.vocab_size
        for i, tokens in enumerate(ids):
            problem = embedding_problem(
                tokens, vocab_size=vocab, max_len=self.max_input_tokens, label=f"input[{i}]"
            )
            if problem is not None:
                raise InvalidRequest(problem.message, param=problem.param)


def _inputs(inputs: EmbeddingInput) -> list[str] | list[list[int]]:
    """A list of texts or of token-id lists; raises InvalidRequest for anything else."""
    if isinstance(inputs, str):
        inputs = [inputs]
    items = list(inputs)
    if not items:
        raise InvalidRequest("input must not be empty", param="input")
    if all(isinstance(t, str) for t in items):
        texts = [t for t in items if isinstance(t, str)]
        empty = next((i for i, t in enumerate(texts) if not t), None)
        if empty is not None:
            raise InvalidRequest(f"input[{empty}] is an empty string", param="input")
        return texts
    lists: list[list[int]] = []
    for t in items:
        if isinstance(t, str) or not isinstance(t, Sequence):
            break
        ids = [x for x in t if type(x) is int]  # not bools
        if len(ids) != len(t):
            break
        lists.append(ids)
    else:
        return lists
    raise InvalidRequest(
        "input must be a string, a list of strings, or a list of token-id lists", param="input"
    )


def _vector(output: RequestOutput, deadline: float | None) -> bytes:
    """The embedding of a final output, or the error it stands for."""
    if output.finish_reason is FinishReason.STOP and output.embedding is not None:
        return bytes(output.embedding)
    if output.finish_reason is FinishReason.ERROR:
        raise RequestFailed(output.error or "the engine failed this input")
    if output.finish_reason is FinishReason.ABORT and deadline is not None:
        raise RequestTimeout("the embedding request passed its deadline")
    if output.finish_reason is FinishReason.ABORT:
        raise ShuttingDown("the embedding engine is stopping")
    raise RequestFailed(f"unexpected output from the embedding engine: {output!r}")


@contextlib.asynccontextmanager
async def open_embedder(
    config: EngineConfig,
    *,
    max_pending: int = 1024,
    request_timeout: float | None = None,
    startup_timeout: float = 600.0,
    heartbeat_timeout: float = 30.0,
    shutdown_grace: float = 5.0,
    log_level: str = "INFO",
) -> AsyncIterator[Embedder]:
    """Start an embedding engine process for ``config`` and yield an :class:`Embedder`.

    ``config.task`` must be "embed" (see :func:`embedding_config`). Startup,
    shutdown and engine death behave as in :func:`tserve.open_llm`: enters
    once the engine is ready (EngineDeadError naming the reason if it cannot
    start, e.g. a missing directory); leaving the block in any way sends
    Shutdown and stops the process (at most ``shutdown_grace`` s + the
    SIGTERM/SIGKILL fallbacks; shielded); an exception from the block
    propagates unchanged.
    """
    if config.task != "embed":
        raise ValueError(f"an embedding engine needs task='embed', not {config.task!r}")
    async with (
        start_engine(config, log_level=log_level, stop_grace=shutdown_grace) as engine,
        _connect_embedder(
            engine,
            owned=True,
            what=f"the embedding model {config.model}",
            max_pending=max_pending,
            request_timeout=request_timeout,
            startup_timeout=startup_timeout,
            heartbeat_timeout=heartbeat_timeout,
        ) as embedder,
    ):
        yield embedder


@contextlib.asynccontextmanager
async def attach_embedder(
    address: str,
    engine_pid: int,
    *,
    max_pending: int = 1024,
    request_timeout: float | None = None,
    startup_timeout: float = 600.0,
    heartbeat_timeout: float = 30.0,
) -> AsyncIterator[Embedder]:
    """Yield an :class:`Embedder` over a running embedding engine that another
    process owns (see :func:`tserve.nursery.attach_llm`: the same rules; leaving
    the block never stops the engine)."""
    async with _connect_embedder(
        EngineRef(address, engine_pid),
        owned=False,
        what=f"the embedding engine at {address}",
        max_pending=max_pending,
        request_timeout=request_timeout,
        startup_timeout=startup_timeout,
        heartbeat_timeout=heartbeat_timeout,
    ) as embedder:
        yield embedder


@contextlib.asynccontextmanager
async def _connect_embedder(
    engine: EngineRef,
    *,
    owned: bool,
    what: str,
    max_pending: int,
    request_timeout: float | None,
    startup_timeout: float,
    heartbeat_timeout: float,
) -> AsyncIterator[Embedder]:
    async with engine_session(
        engine,
        owned=owned,
        what=what,
        startup_timeout=startup_timeout,
        heartbeat_timeout=heartbeat_timeout,
    ) as (mux, mux_done):
        tokenizer = await anyio.to_thread.run_sync(_load_tokenizer, mux.ready.model_path)
        yield Embedder(
            mux,
            engine,
            mux.ready,
            tokenizer,
            max_pending=max_pending,
            request_timeout=request_timeout,
            mux_done=mux_done,
        )


def _load_tokenizer(path: str) -> Tokenizer:
    """The encoder's fast tokenizer with truncation and padding off (we check lengths).

    Blocking (a worker thread). ``tokenizer.json`` when the directory has
    one, else whatever fast tokenizer transformers makes of it.
    """
    from tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json"
    if file.is_file():
        tokenizer = Tokenizer.from_file(str(file))
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True).backend_tokenizer
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer
