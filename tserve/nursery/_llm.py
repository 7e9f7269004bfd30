"""The embeddable LLM: an engine process, one mux, and admission control.

``open_llm`` runs these for the duration of its block, in one task group:
the engine process and a watcher that turns its exit into engine death, the
mux task that owns the socket to it, and the caller's body. Leaving the block
in any way — normal exit, exception, cancellation, KeyboardInterrupt — sends
Shutdown, gives the engine ``shutdown_grace`` seconds, then terminates it; no
child process outlives the block.

The engine is not restarted when it dies (see :func:`open_llm` for why):
every live request fails with EngineDeadError, new requests are refused with
it, and the caller decides (the HTTP server exits non-zero so that its
supervisor restarts it whole).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from tserve._host import pid_alive
from tserve.mux import EngineDeadError, Mux
from tserve.nursery._engine_process import EngineProcess, EngineRef, exit_reason, start_engine
from tserve.nursery._errors import InvalidRequest, Overloaded, ShuttingDown
from tserve.nursery._gc import serving_gc
from tserve.nursery._request import Prompt, RequestStream
from tserve.nursery._results import Completion
from tserve.protocol import EngineConfig, EngineReady, EngineStats, SamplingParams, TokenLogprob
from tserve.validity import generation_problem

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tserve.nursery._embed import Embedder, EmbeddingInput, EmbeddingResult

__all__ = ["LLM", "EngineClient", "LLMStats", "attach_llm", "engine_session", "open_llm"]

log = logging.getLogger("tserve")

Message = dict[str, Any]

# Prompts (or chats, counting their messages' contents) shorter than this many
# characters are tokenized on the event loop; longer ones in a worker thread.
# Why: handing work to a thread costs the loop 40-50 us of its own CPU plus two
# wakeups (measured here, and a load test found 22% of the API process's
# samples in that hand-off), while tokenizing costs about 20 us + 0.2 us per
# character. Below ~512 characters the tokenizer is the cheaper of the two, and
# at most ~0.15 ms of loop time per request. Above it, the thread wins and
# the loop stays free: the Rust tokenizer releases the GIL, so a long prompt
# tokenizes in parallel with the loop.
INLINE_TOKENIZE_CHARS = 512


@dataclasses.dataclass(frozen=True, slots=True)
class LLMStats:
    """Live numbers for /metrics. ``engine`` is the engine's latest report."""

    live_requests: int
    aborts_sent: int
    engine: EngineStats
    engine_alive: bool


class EngineClient:
    """What :class:`LLM` and :class:`~tserve.nursery.Embedder` share: one engine
    behind one mux (see :func:`engine_session`).

    Its identity (model, pid, socket address), whether it is alive, request
    ids, and the refusal of new work once the engine is dead or the client
    closed. Each subclass does its own admission on top of
    :meth:`_check_running` and names itself in ``_dead`` and ``_closed``.
    """

    _dead = "the engine is dead"  # EngineDeadError's message when the mux has none
    _closed = "the engine client is closed"  # ShuttingDown's message once the mux stopped

    def __init__(
        self,
        mux: Mux,
        engine: EngineRef,
        ready: EngineReady,
        *,
        max_pending: int,
        request_timeout: float | None,
        mux_done: anyio.Event,
        id_prefix: str,
    ) -> None:
        self._mux = mux
        self._engine = engine
        self._mux_done = mux_done  # set when the mux stopped (engine dead or closed)
        self.ready = ready
        self.max_pending = max_pending
        self.request_timeout = request_timeout
        self._ids = itertools.count()
        self._id_prefix = id_prefix

    @property
    def model(self) -> str:
        return self.ready.model

    @property
    def engine_alive(self) -> bool:
        """False once the engine is known to be dead, or the client closed; never True again."""
        return not (self._mux.dead or self._mux_done.is_set())

    @property
    def engine_dead_reason(self) -> str | None:
        return self._mux.dead_reason

    @property
    def engine_pid(self) -> int:
        return self._engine.pid

    @property
    def engine_address(self) -> str:
        """The engine's socket address: what :func:`attach_llm` (or ``attach_embedder``) takes."""
        return self._engine.address

    def kill_engine(self) -> None:
        """SIGKILL the engine process: for fault-injection tests and drills."""
        self._engine.kill()

    def _check_running(self) -> None:
        """Raise EngineDeadError if the engine is dead, ShuttingDown if the client is closed."""
        if self._mux.dead:
            raise EngineDeadError(self._mux.dead_reason or self._dead)
        if self._mux_done.is_set():
            raise ShuttingDown(self._closed)

    def _next_request_id(self) -> str:
        return f"{self._id_prefix}-{next(self._ids)}"


class LLM(EngineClient):
    """Generate text with the engine behind one mux. Create with :func:`open_llm`.

    Admission: at most ``max_pending`` requests are live (admitted and not
    yet closed); one more raises :class:`Overloaded` at once. Nothing waits
    without bound. Every method is meant to be called from the event loop
    thread that entered ``open_llm``, except the blocking tokenizer helpers
    (:meth:`encode`, :meth:`decode`, :meth:`apply_chat_template`), which
    are for worker threads.
    """

    _dead = "the engine is dead"
    _closed = "the LLM is closed"

    def __init__(
        self,
        mux: Mux,
        engine: EngineRef,
        ready: EngineReady,
        tokenizer: PreTrainedTokenizerBase,
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
            id_prefix=uuid.uuid4().hex[:8],
        )
        self.tokenizer = tokenizer
        self._decode_ids = _fast_decoder(tokenizer)
        self.draining = False
        # Invariant: 0 <= _live <= max_pending; a stream counts from admission
        # until its close() (which runs once).
        self._live = 0
        # Tokenizer calls in worker threads. Bound: this many at once; more
        # wait for a thread (they are admitted requests, so at most
        # max_pending of them wait).
        self._tokenizer_limiter = anyio.CapacityLimiter(4)
        self._call_soon = _loop_caller()
        # The embedding model's engine, when open_llm was given one.
        self.embedder: Embedder | None = None

    # -- state -------------------------------------------------------------------

    @property
    def engine_alive(self) -> bool:
        """False once an engine (generation, or embedding if loaded) is known to be
        dead, or the LLM closed; never True again."""
        alive = super().engine_alive
        return alive and (self.embedder is None or self.embedder.engine_alive)

    @property
    def engine_dead_reason(self) -> str | None:
        if self._mux.dead_reason is None and self.embedder is not None:
            reason = self.embedder.engine_dead_reason
            return None if reason is None else f"embedding engine: {reason}"
        return self._mux.dead_reason

    async def wait_engine_dead(self) -> str:
        """Wait until the engine is dead (or the LLM closed); return the reason.

        A checkpoint; cancellable.
        """
        await self._mux_done.wait()
        return self._mux.dead_reason or "the LLM was closed"

    @property
    def stats(self) -> LLMStats:
        return LLMStats(
            live_requests=self._live,
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
        EngineDeadError before anything is queued. ``prompt`` is text
        (tokenized on the first ``__anext__``, see :meth:`tokenize`) or
        token ids. ``timeout`` (seconds, default ``request_timeout``) ends the
        request with RequestTimeout and aborts it in the engine. Close the
        stream (``async with``, ``aclose``, or reading it to the end) to free
        its admission slot; a stream dropped unfinished is closed soon after.
        """
        if isinstance(prompt, str):
            text = prompt
            return self._admit(lambda: self.tokenize(text), params, request_id, timeout)
        return self._admit(list(prompt), params, request_id, timeout)

    def chat(
        self,
        messages: Sequence[Message],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> RequestStream:
        """Like :meth:`generate` with the model's chat template applied to ``messages``.

        Raises InvalidRequest at once when ``messages`` is not a list of
        mappings; the template runs as :meth:`tokenize_chat` says.
        """
        if isinstance(messages, str | bytes) or not all(isinstance(m, Mapping) for m in messages):
            raise InvalidRequest("messages must be a list of objects", param="messages")
        chat = [dict(m) for m in messages]
        return self._admit(lambda: self.tokenize_chat(chat), params, request_id, timeout)

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

    async def embed(self, inputs: EmbeddingInput) -> EmbeddingResult:
        """Embed ``inputs`` with the embedding model (see :meth:`Embedder.embed`).

        Raises InvalidRequest (``param`` "model") when ``open_llm`` was not
        given an ``embedding_model``, ShuttingDown while draining.
        """
        if self.embedder is None:
            raise InvalidRequest(
                "no embedding model is loaded (open_llm(embedding_model=...))", param="model"
            )
        if self.draining:
            raise ShuttingDown("the server is shutting down")
        return await self.embedder.embed(inputs)

    async def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text``: on the event loop below ``INLINE_TOKENIZE_CHARS``,
        else in a worker thread (at most 4 at once; the rest wait for one).

        Not a checkpoint when short. In a thread it is not cancellable: a
        cancel takes effect once the thread returns (a few ms at most).
        """
        if len(text) < INLINE_TOKENIZE_CHARS:
            return self.encode(text)
        return await anyio.to_thread.run_sync(self.encode, text, limiter=self._tokenizer_limiter)

    async def tokenize_chat(self, messages: list[Message]) -> list[int]:
        """Prompt ids for a chat (:meth:`apply_chat_template`), inline or in a
        thread by its messages' length, like :meth:`tokenize`."""
        if _chat_chars(messages) < INLINE_TOKENIZE_CHARS:
            return self.apply_chat_template(messages)
        return await anyio.to_thread.run_sync(
            self.apply_chat_template, messages, limiter=self._tokenizer_limiter
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``. Blocking (tokenizer work): :meth:`tokenize` decides where."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids``, special tokens skipped. Fast (microseconds) for a few ids."""
        return self._decode_ids(token_ids)

    def apply_chat_template(self, messages: list[Message]) -> list[int]:
        """Prompt ids for a chat. Blocking; raises InvalidRequest for bad messages."""
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:
            raise InvalidRequest(f"messages: {exc}", param="messages") from None
        return self.encode(str(text))

    def check_admission(self, count: int) -> None:
        """Raise what admitting ``count`` more requests now would raise. Not a checkpoint.

        EngineDeadError, ShuttingDown (closed or draining), InvalidRequest
        (``param`` "n") when ``count`` exceeds ``max_pending`` itself,
        Overloaded when fewer than ``count`` slots are free.
        """
        self._check_running()
        if self.draining:
            raise ShuttingDown("the server is shutting down")
        if count > self.max_pending:
            raise InvalidRequest(
                f"this request needs {count} generations; at most {self.max_pending} "
                "are admitted at once",
                param="n",
            )
        if self._live + count > self.max_pending:
            raise Overloaded(f"{self.max_pending} requests are already in flight")

    # -- internals -----------------------------------------------------------------

    def _admit(
        self,
        prompt: Callable[[], Awaitable[list[int]]] | list[int],
        params: SamplingParams | None,
        request_id: str | None,
        timeout: float | None,
    ) -> RequestStream:
        self.check_admission(1)
        timeout = self.request_timeout if timeout is None else timeout
        rid = request_id or self._next_request_id()
        stream = RequestStream(self, rid, prompt, params or SamplingParams(), timeout)
        self._live += 1
        return stream

    def _release(self, stream: RequestStream) -> None:
        """Called once per admitted stream, by its close()."""
        self._live -= 1

    def _check_prompt(self, prompt: list[int], params: SamplingParams) -> None:
        """Reject what the engine would reject, with the field it concerns."""
        problem = generation_problem(
            prompt,
            params,
            vocab_size=self.ready.vocab_size,
            max_model_len=self.ready.max_model_len,
        )
        if problem is not None:
            raise InvalidRequest(problem.message, param=problem.param)


def _chat_chars(messages: list[Message]) -> int:
    """The length of a chat's contents (a content that is not text counts as its repr)."""
    total = 0
    for message in messages:
        content = message.get("content")
        total += len(content) if isinstance(content, str) else len(str(content))
    return total


def _fast_decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=True)``, minus Python overhead.

    A fast tokenizer's Rust backend decodes a few ids in about a microsecond;
    the Python wrapper around it costs four times that, twice per
    streamed token. Same text unless the tokenizer cleans up spaces.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        decode = backend.decode

        def fast(token_ids: list[int]) -> str:
            return str(decode(token_ids, skip_special_tokens=True))

        return fast

    def slow(token_ids: list[int]) -> str:
        return str(tokenizer.decode(token_ids, skip_special_tokens=True))

    return slow


def _loop_caller() -> Callable[[Callable[[], object]], None]:
    """A thread-safe, non-blocking "run this soon on the current event loop".

    For finalizers, which may run in any thread and at any point of the loop
    thread's own code. Once the loop has finished, the call is dropped: what
    it would have cleaned up is gone with the loop.
    """
    try:
        soon: Callable[[Callable[[], object]], object] = (
            asyncio.get_running_loop().call_soon_threadsafe
        )
    except RuntimeError:  # not asyncio: trio
        import trio

        soon = trio.lowlevel.current_trio_token().run_sync_soon

    def call_soon(callback: Callable[[], object]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has finished or is closed
            soon(callback)

    return call_soon


async def _collect(stream: RequestStream) -> Completion:
    text: list[str] = []
    ids: list[int] = []
    logprobs: list[TokenLogprob] = []
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
    freeze_gc: bool = True,
    embedding_model: str | os.PathLike[str] | None = None,
    **engine_options: Any,
) -> AsyncIterator[LLM]:
    """Start an engine process for ``model`` and yield an :class:`LLM` over it.

    ``engine_options`` are fields of :class:`tserve.protocol.EngineConfig`
    (max_num_seqs, kv_cache_tokens, threads, device, dtype, ...).

    Startup: waits for the engine's ready message, at most
    ``startup_timeout`` s; meanwhile the engine logs its loading progress to
    stderr and this process logs how long it has waited every 10 s. An
    engine that cannot start (a bad model path, a bad option) reports why
    and exits, and ``open_llm`` raises EngineDeadError naming the reason as
    soon as it does (seconds, not the timeout).

    Shutdown: leaving the block in any way (normal exit, exception,
    cancellation, KeyboardInterrupt) sends Shutdown (the engine aborts what
    is live and exits), waits up to ``shutdown_grace`` s, then terminates
    and finally kills the process; this wait is shielded from cancellation.
    No child process outlives the block; if this process is killed outright,
    the engine notices its parent is gone and exits within about a second.
    An exception from the block propagates unchanged (not in an
    ExceptionGroup).

    Engine death: when the engine process exits, is killed, reports a fatal
    error, or is silent for ``heartbeat_timeout`` s, every live request
    fails at once with EngineDeadError, new requests are refused with it,
    ``engine_alive`` turns False and :meth:`LLM.wait_engine_dead` returns
    (a silent engine is also killed). ``open_llm`` does NOT restart the
    engine: a restart would have to reload the model (seconds to minutes,
    during which every request would wait or fail anyway), could only retry
    requests that had not streamed a token (the others' text is already
    with the client), and would hide a crash loop from whoever supervises
    the process. The caller decides: the HTTP server exits non-zero so that
    its supervisor restarts it whole.

    ``freeze_gc`` moves every object alive after startup (torch-free, but
    transformers and the tokenizer make hundreds of thousands) out of the
    cyclic garbage collector's sight with ``gc.freeze()`` and raises the
    gen-0 threshold while the block runs (see ``_gc.py``), so that
    collections during streaming stay cheap; both are restored on exit.

    ``embedding_model`` (a local encoder directory, or "default" for the
    packaged all-MiniLM-L6-v2; None = no embeddings) starts a second engine
    process for :meth:`LLM.embed` (see ``tserve.nursery._embed``), with the
    same startup, shutdown and death rules; it shares ``threads``, ``device``
    and ``heartbeat_interval`` with the generation engine. The death of
    either engine turns ``engine_alive`` False.
    """
    if max_pending < 1:
        raise ValueError("max_pending must be at least 1")
    config = EngineConfig(model=os.fspath(model), **engine_options)  # TypeError: unknown option
    async with (
        start_engine(config, log_level=log_level, stop_grace=shutdown_grace) as engine,
        _open_embedder(
            embedding_model,
            max_pending,
            request_timeout,
            startup_timeout,
            heartbeat_timeout,
            shutdown_grace,
            log_level,
            engine_options,
        ) as embedder,
        _connect_llm(
            engine,
            owned=True,
            what=config.model,
            max_pending=max_pending,
            request_timeout=request_timeout,
            startup_timeout=startup_timeout,
            heartbeat_timeout=heartbeat_timeout,
            freeze_gc=freeze_gc,
            embedder=embedder,
        ) as llm,
    ):
        yield llm


@contextlib.asynccontextmanager
async def attach_llm(
    address: str,
    engine_pid: int,
    *,
    max_pending: int = 1024,
    request_timeout: float | None = None,
    startup_timeout: float = 600.0,
    heartbeat_timeout: float = 30.0,
    freeze_gc: bool = True,
    embedder: Embedder | None = None,
) -> AsyncIterator[LLM]:
    """Yield an :class:`LLM` over a running engine that another process owns.

    For the extra API processes of ``--api-processes N``: each runs its own
    mux to the one engine at ``address`` (process ``engine_pid`` on this
    host). Enters once the engine answered Hello with EngineReady (it is
    normally ready already) and the tokenizer is loaded; EngineDeadError if
    it is gone. ``embedder`` (see ``attach_embedder``) serves :meth:`LLM.embed`.

    Unlike :func:`open_llm`, leaving the block never sends Shutdown and never
    stops the engine: only its owner does. Engine death is seen from here
    through the engine's exit (watched by pid), its EngineDead message, or
    silence past ``heartbeat_timeout``; then every live request fails with
    EngineDeadError, as with :func:`open_llm`.
    """
    if max_pending < 1:
        raise ValueError("max_pending must be at least 1")
    async with _connect_llm(
        EngineRef(address, engine_pid),
        owned=False,
        what=f"the engine at {address}",
        max_pending=max_pending,
        request_timeout=request_timeout,
        startup_timeout=startup_timeout,
        heartbeat_timeout=heartbeat_timeout,
        freeze_gc=freeze_gc,
        embedder=embedder,
    ) as llm:
        yield llm


@contextlib.asynccontextmanager
async def _connect_llm(
    engine: EngineRef,
    *,
    owned: bool,
    what: str,
    max_pending: int,
    request_timeout: float | None,
    startup_timeout: float,
    heartbeat_timeout: float,
    freeze_gc: bool,
    embedder: Embedder | None,
) -> AsyncIterator[LLM]:
    """The LLM over ``engine``'s session (see :func:`engine_session`), tokenizer loaded."""
    async with engine_session(
        engine,
        owned=owned,
        what=what,
        startup_timeout=startup_timeout,
        heartbeat_timeout=heartbeat_timeout,
    ) as (mux, mux_done):
        tokenizer = await anyio.to_thread.run_sync(_load_tokenizer, mux.ready.model_path)
        llm = LLM(
            mux,
            engine,
            mux.ready,
            tokenizer,
            max_pending=max_pending,
            request_timeout=request_timeout,
            mux_done=mux_done,
        )
        llm.embedder = embedder
        with serving_gc() if freeze_gc else contextlib.nullcontext():
            yield llm


@contextlib.asynccontextmanager
async def engine_session(
    engine: EngineRef,
    *,
    owned: bool,
    what: str,
    startup_timeout: float,
    heartbeat_timeout: float,
) -> AsyncIterator[tuple[Mux, anyio.Event]]:
    """Run a mux to ``engine`` and a watcher of its process; yield ``(mux, mux_done)``.

    Enters once the engine is ready (EngineDeadError if it died, failed to
    start or was not ready within ``startup_timeout`` s; meanwhile the log
    says every 10 s that we wait for ``what``). ``mux_done`` is set when the
    mux stops. Leaving the block sends Shutdown first when ``owned`` (the
    owner stops the process itself; see :func:`start_engine`), never
    otherwise. An exception from the block propagates unchanged.
    """
    body_error: BaseException | None = None
    try:
        async with anyio.create_task_group() as tg:
            mux = Mux(heartbeat_timeout=heartbeat_timeout, ready_timeout=startup_timeout)
            mux_done = anyio.Event()
            try:
                if isinstance(engine, EngineProcess):
                    tg.start_soon(_watch_engine, engine, mux, mux_done)
                else:
                    tg.start_soon(_watch_shared_engine, engine, mux, mux_done)
                await _start_mux(tg, mux, engine, mux_done, model=what)
                try:
                    yield mux, mux_done
                except BaseException as exc:
                    body_error = exc
                    raise
            finally:
                if owned:
                    mux.shutdown_engine("API process leaving")
                tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        error = _unwrap(group, body_error)
        if error is group:
            raise
    else:
        return
    raise error


def _open_embedder(
    model: str | os.PathLike[str] | None,
    max_pending: int,
    request_timeout: float | None,
    startup_timeout: float,
    heartbeat_timeout: float,
    shutdown_grace: float,
    log_level: str,
    engine_options: Mapping[str, Any],
) -> contextlib.AbstractAsyncContextManager[Embedder | None]:
    """The embedding engine for ``model``, or nothing for None. Entered before the
    generation engine's mux, so both engines load at the same time."""
    if model is None:
        return contextlib.nullcontext()
    # Imported here: _embed builds on this module's helpers.
    from tserve.nursery._embed import embedding_config, open_embedder

    return open_embedder(
        embedding_config(os.fspath(model), engine_options),
        max_pending=max_pending,
        request_timeout=request_timeout,
        startup_timeout=startup_timeout,
        heartbeat_timeout=heartbeat_timeout,
        shutdown_grace=shutdown_grace,
        log_level=log_level,
    )


def _unwrap(
    group: BaseExceptionGroup[BaseException], body_error: BaseException | None
) -> BaseException:
    """What to raise instead of ``group``, the group our own task groups raised.

    The body's own exception, as the body raised it (even if it is a group
    itself, which the task groups may have copied), when that is all the
    group holds; else a lone exception wrapped in single-member groups (a
    startup failure such as EngineDeadError); else ``group`` itself.
    """
    if body_error is not None and _leaves(group) == _leaves(body_error):
        return body_error
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return group if isinstance(error, BaseExceptionGroup) else error


def _leaves(error: BaseException) -> set[int]:
    """The identities of the plain exceptions inside ``error``."""
    if isinstance(error, BaseExceptionGroup):
        return set().union(*(_leaves(e) for e in error.exceptions))
    return {id(error)}


async def _start_mux(
    tg: anyio.abc.TaskGroup, mux: Mux, engine: EngineRef, mux_done: anyio.Event, *, model: str
) -> EngineReady:
    """Run the mux in ``tg``; return once the engine is ready, with progress in the log.

    Raises EngineDeadError if the engine died, failed to start or did not
    become ready within the mux's ``ready_timeout``.
    """
    async with anyio.create_task_group() as progress:
        progress.start_soon(_log_waiting, engine.pid, model)
        try:
            await tg.start(_run_mux, mux, engine.address, mux_done)
        finally:
            progress.cancel_scope.cancel()
    log.info("engine ready: %s (pid %d, %s)", mux.ready.model, engine.pid, mux.ready.device)
    return mux.ready


async def _run_mux(
    mux: Mux,
    address: str,
    done: anyio.Event,
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    try:
        await mux.run(address, task_status=task_status)
    finally:
        done.set()


async def _log_waiting(pid: int, model: str) -> None:
    started = anyio.current_time()
    while True:
        await anyio.sleep(_PROGRESS_INTERVAL)
        waited = anyio.current_time() - started
        log.info("waiting for the engine (pid %d) to load %s: %.0f s", pid, model, waited)


async def _watch_engine(engine: EngineProcess, mux: Mux, mux_done: anyio.Event) -> None:
    """Turn the engine process's exit into engine death, and a dead engine into an exit.

    An engine that exits with an error sends EngineDead (with the reason)
    first; its exit waits up to ``_DEATH_MESSAGE_GRACE`` s for that message
    so the reason is not lost in a race. A signal (kill -9) is reported at
    once. An engine declared dead while its process still runs (silent past
    the heartbeat timeout) is killed, so that it cannot hold the device.
    """
    async with anyio.create_task_group() as tg:

        async def reap_when_dead() -> None:
            await mux_done.wait()
            if mux.dead and engine.returncode is None:
                with anyio.move_on_after(_DEATH_MESSAGE_GRACE):
                    await engine.wait()
                if engine.returncode is None:
                    log.error("killing the engine (pid %d): %s", engine.pid, mux.dead_reason)
                    engine.kill()

        tg.start_soon(reap_when_dead)
        code = await engine.wait()
        if code > 0 and not mux_done.is_set():
            with anyio.move_on_after(_DEATH_MESSAGE_GRACE):
                await mux_done.wait()
        mux.engine_died(exit_reason(code))
        tg.cancel_scope.cancel()


async def _watch_shared_engine(engine: EngineRef, mux: Mux, mux_done: anyio.Event) -> None:
    """Turn the exit of an engine another process owns into engine death.

    Not our child, so no exit status: a pidfd (exact, no pid reuse) says
    when it is gone, or polling every 0.1 s where there is none. As in
    :func:`_watch_engine`, the EngineDead message gets
    ``_DEATH_MESSAGE_GRACE`` s to arrive first, so its reason is kept.
    """
    try:
        pidfd: int | None = os.pidfd_open(engine.pid)
    except ProcessLookupError:
        pidfd = None
        gone = True
    except (AttributeError, OSError):  # no pidfd on this platform or kernel
        pidfd, gone = None, False
    else:
        gone = False
    try:
        if pidfd is not None:
            await anyio.wait_readable(pidfd)
        else:
            while not gone:
                await anyio.sleep(0.1)
                gone = not pid_alive(engine.pid)
    finally:
        if pidfd is not None:
            os.close(pidfd)
    if not mux_done.is_set():
        with anyio.move_on_after(_DEATH_MESSAGE_GRACE):
            await mux_done.wait()
    mux.engine_died(f"the engine process (pid {engine.pid}) exited")


_PROGRESS_INTERVAL = 10.0  # s between "waiting for the engine" log lines
_DEATH_MESSAGE_GRACE = 1.0  # s; see _watch_engine


def _load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Blocking (a worker thread). transformers is imported here, not at module
    import, so that importing tserve (the web layer) does not import torch."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
