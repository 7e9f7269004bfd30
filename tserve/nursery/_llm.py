"""The embeddable LLM: an engine process, one mux, and admission control.

``open_llm`` runs three things for the duration of its block, in one task
group: the engine process (and a watcher that notices when it exits), the
mux task that owns the socket to it, and the caller's body. Leaving the block
in any way — normal exit, exception, cancellation, KeyboardInterrupt — sends
Shutdown, gives the engine ``shutdown_grace`` seconds, then terminates it; no
child process outlives the block.

The engine is not restarted when it dies: every live request fails with
EngineDeadError, new requests are refused with it, and the caller decides
(the HTTP server exits non-zero so that its supervisor restarts it whole).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import anyio
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tserve.mux import EngineDeadError, Mux
from tserve.nursery._engine_process import EngineProcess, start_engine
from tserve.nursery._errors import InvalidRequest, Overloaded, ShuttingDown
from tserve.nursery._request import Prompt, RequestStream
from tserve.nursery._results import Completion
from tserve.protocol import EngineConfig, EngineReady, EngineStats, SamplingParams

__all__ = ["LLM", "LLMStats", "open_llm"]

log = logging.getLogger("tserve")

Message = dict[str, Any]


@dataclasses.dataclass(frozen=True, slots=True)
class LLMStats:
    """Live numbers for /metrics. ``engine`` is the engine's latest report."""

    live_requests: int
    aborts_sent: int
    engine: EngineStats
    engine_alive: bool


class LLM:
    """Generate text with the engine behind one mux. Create with :func:`open_llm`.

    Admission: at most ``max_pending`` requests are live (admitted and not
    yet closed); one more raises :class:`Overloaded` at once. Nothing waits
    without bound.
    """

    def __init__(
        self,
        mux: Mux,
        engine: EngineProcess,
        ready: EngineReady,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_pending: int,
        request_timeout: float | None,
    ) -> None:
        self._mux = mux
        self._engine = engine
        self.ready = ready
        self.tokenizer = tokenizer
        self.max_pending = max_pending
        self.request_timeout = request_timeout
        self.draining = False
        # Invariant: len(self._live) <= max_pending; a stream is in it from
        # admission until its close().
        self._live: set[RequestStream] = set()
        self._ids = itertools.count()
        self._id_prefix = uuid.uuid4().hex[:8]

    # -- state -------------------------------------------------------------------

    @property
    def model(self) -> str:
        return self.ready.model

    @property
    def engine_alive(self) -> bool:
        return not self._mux.dead

    @property
    def engine_pid(self) -> int:
        return self._engine.pid

    def kill_engine(self) -> None:
        """SIGKILL the engine process: for fault-injection tests and drills."""
        self._engine.kill()

    @property
    def stats(self) -> LLMStats:
        return LLMStats(
            live_requests=len(self._live),
            aborts_sent=self._mux.stats.aborts_sent,
            engine=self._mux.engine_stats,
            engine_alive=self.engine_alive,
        )

    # -- requests ----------------------------------------------------------------

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> RequestStream:
        """Start a request; iterate the result for its deltas.

        Synchronous and immediate: raises Overloaded, ShuttingDown or
        EngineDeadError before anything is queued. ``prompt`` is text or token
        ids. ``timeout`` (seconds, default ``request_timeout``) ends the
        request with RequestTimeout and aborts it in the engine.
        """
        if isinstance(prompt, str):
            text = prompt
            return self._admit(lambda: self.encode(text), params, request_id, timeout)
        ids = list(prompt)
        return self._admit(lambda: ids, params, request_id, timeout)

    def chat(
        self,
        messages: Sequence[Message],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> RequestStream:
        """Like :meth:`generate` with the model's chat template applied to ``messages``.

        Raises InvalidRequest at once when ``messages`` is not a list of mappings.
        """
        if isinstance(messages, str | bytes) or not all(isinstance(m, Mapping) for m in messages):
            raise InvalidRequest("messages must be a list of objects", param="messages")
        chat = [dict(m) for m in messages]
        return self._admit(lambda: self.apply_chat_template(chat), params, request_id, timeout)

    async def complete(
        self, prompt: Prompt, params: SamplingParams | None = None, **kwargs: Any
    ) -> Completion:
        """The whole result of :meth:`generate` at once."""
        return await _collect(self.generate(prompt, params, **kwargs))

    async def complete_chat(
        self, messages: Sequence[Message], params: SamplingParams | None = None, **kwargs: Any
    ) -> Completion:
        """The whole result of :meth:`chat` at once."""
        return await _collect(self.chat(messages, params, **kwargs))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``. Blocking (tokenizer work): call it in a thread."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def apply_chat_template(self, messages: list[Message]) -> list[int]:
        """Prompt ids for a chat. Blocking; raises InvalidRequest for bad messages."""
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:
            raise InvalidRequest(f"messages: {exc}", param="messages") from None
        return self.encode(str(text))

    # -- internals -----------------------------------------------------------------

    def _admit(
        self,
        make_prompt: Callable[[], list[int]],
        params: SamplingParams | None,
        request_id: str | None,
        timeout: float | None,
    ) -> RequestStream:
        if self._mux.dead:
            raise EngineDeadError(self._mux.dead_reason or "the engine is dead")
        if self.draining:
            raise ShuttingDown("the server is shutting down")
        if len(self._live) >= self.max_pending:
            raise Overloaded(f"{self.max_pending} requests are already in flight")
        timeout = self.request_timeout if timeout is None else timeout
        deadline = None if timeout is None else time.time() + timeout
        rid = request_id or f"{self._id_prefix}-{next(self._ids)}"
        stream = RequestStream(self, rid, make_prompt, params or SamplingParams(), deadline)
        self._live.add(stream)
        return stream

    def _release(self, stream: RequestStream) -> None:
        self._live.discard(stream)

    def _check_prompt(self, prompt: list[int], params: SamplingParams) -> None:
        """Reject what the engine would reject, with the field it concerns."""
        limit = self.ready.max_model_len
        if not prompt:
            raise InvalidRequest("prompt is empty", param="prompt")
        if len(prompt) + params.max_tokens > limit:
            raise InvalidRequest(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"the context length of {limit} tokens",
                param="max_tokens" if len(prompt) < limit else "prompt",
            )
        vocab = self.ready.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", param="prompt")


async def _collect(stream: RequestStream) -> Completion:
    text: list[str] = []
    ids: list[int] = []
    logprobs = []
    finish, usage = None, None
    async with stream:
        async for delta in stream:
            text.append(delta.text)
            ids.extend(delta.token_ids)
            if delta.logprobs is not None:
                logprobs.extend(delta.logprobs)
            finish, usage = delta.finish_reason, delta.usage
    assert finish is not None and usage is not None, "a stream always ends with a finish"
    return Completion(
        "".join(text),
        ids,
        finish,
        usage,
        logprobs if logprobs else None,
        stream.prompt_token_ids,
    )


@contextlib.asynccontextmanager
async def open_llm(
    model: str | os.PathLike[str] = "default",
    *,
    max_pending: int = 1024,
    request_timeout: float | None = None,
    startup_timeout: float = 600.0,
    heartbeat_timeout: float = 30.0,
    shutdown_grace: float = 5.0,
    log_level: str = "INFO",
    **engine_options: Any,
) -> AsyncIterator[LLM]:
    """Start an engine for ``model`` and yield an :class:`LLM` over it.

    ``engine_options`` are fields of :class:`tserve.protocol.EngineConfig`
    (max_num_seqs, kv_cache_tokens, threads, device, dtype, ...). Waiting for
    the engine to load (the engine logs its progress) is bounded by
    ``startup_timeout``; an engine that exits first raises EngineDeadError
    with its reason.
    """
    config = EngineConfig(model=os.fspath(model), **engine_options)
    mux = Mux(heartbeat_timeout=heartbeat_timeout)

    def engine_exited(code: int) -> None:
        mux.engine_died(f"engine process exited with code {code}")

    async with (
        start_engine(config, engine_exited, log_level=log_level, stop_grace=shutdown_grace) as proc,
        anyio.create_task_group() as tg,
    ):
        try:
            await tg.start(mux.run, proc.address)
            with anyio.fail_after(startup_timeout):
                ready = await mux.wait_ready()
            tokenizer = await anyio.to_thread.run_sync(_load_tokenizer, ready.model_path)
            llm = LLM(
                mux,
                proc,
                ready,
                tokenizer,
                max_pending=max_pending,
                request_timeout=request_timeout,
            )
            yield llm
        finally:
            mux.shutdown_engine("API process leaving")
            tg.cancel_scope.cancel()


def _load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
