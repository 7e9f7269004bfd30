"""Opening a client: an engine (started, or attached to) and its session, for a block.

Four entries, one path: :func:`open_llm` and :func:`open_embedder` start an
engine process this process owns (``_engine_process.py``); :func:`attach_llm`
and :func:`attach_embedder` reach one another API process owns (and
``attach_llm`` one a ``tserve engine`` serves at a network address). Each then
runs :func:`_connect`: the engine session (``_session.py``), the tokenizer
loaded in a worker thread, and the client (``LLM`` or ``Embedder``) over them.

``open_llm`` runs these for the duration of its block, in one task group:
the engine process and a watcher that turns its exit into engine death, the
mux task that owns the socket to it, and the caller's body. Leaving the block
in any way — normal exit, exception, cancellation, KeyboardInterrupt — sends
Shutdown, gives the engine ``shutdown_grace`` seconds, then terminates it; no
child process outlives the block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, TypeVar

import anyio
import msgspec

from tserve._curve import client_keys, require_keys
from tserve._gc import serving_gc
from tserve.mux import Link
from tserve.nursery._admission import Overload
from tserve.nursery._client import ClientSettings, EngineClient
from tserve.nursery._embedder import Embedder, embedding_config
from tserve.nursery._engine_process import EngineRef, start_engine
from tserve.nursery._llm import LLM
from tserve.nursery._session import EngineSession, engine_session
from tserve.nursery._tokenizer import load_chat_tokenizer, load_encoder_tokenizer
from tserve.nursery._tokenizer_files import load_unpacked
from tserve.nursery._watch import dying_with
from tserve.protocol import EngineConfig

__all__ = ["EngineOwner", "attach_embedder", "attach_llm", "open_embedder", "open_llm"]

_Client = TypeVar("_Client", bound=EngineClient)
_DEFAULTS = ClientSettings()
_Tokens = TypeVar("_Tokens")


@contextlib.asynccontextmanager
async def open_llm(
    model: str | os.PathLike[str] = "default",
    *,
    max_pending: int = 1024,
    overload: str = "wait",
    max_queued: int = 0,
    max_queued_tokens: int | None = None,
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

    Admission: at most ``max_pending`` requests run at once. With
    ``overload="wait"`` (the default) every further call waits for a slot,
    in arrival order, cancellably and within its ``timeout``; a waiting call
    holds only its own task and its prompt. With ``overload="raise"`` a call
    waits only while at most ``max_queued`` others do and their prompts hold
    at most ``max_queued_tokens`` tokens (None: no token bound), and raises
    Overloaded otherwise; ``max_queued=0`` refuses at once exactly the calls
    beyond ``max_pending`` (the HTTP server's 503 + Retry-After). The
    embedding engine's inputs are admitted the same way.

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
    the web stack and the tokenizer make tens of thousands) out of the
    cyclic garbage collector's sight with ``gc.freeze()`` and raises the
    gen-0 threshold while the block runs (see ``_gc.py``), so that
    collections during streaming stay cheap; both are restored on exit.

    ``embedding_model`` (a local encoder directory, or "default" for the
    packaged all-MiniLM-L6-v2; None = no embeddings) starts a second engine
    process for :meth:`LLM.embed` (see ``tserve.nursery._embedder``), with the
    same startup, shutdown and death rules; it shares ``threads``, ``device``
    and ``heartbeat_interval`` with the generation engine. The death of
    either engine turns ``engine_alive`` False.
    """
    owner = EngineOwner.of(
        max_pending=max_pending,
        overload=overload,
        max_queued=max_queued,
        max_queued_tokens=max_queued_tokens,
        request_timeout=request_timeout,
        startup_timeout=startup_timeout,
        heartbeat_timeout=heartbeat_timeout,
        shutdown_grace=shutdown_grace,
        log_level=log_level,
    )
    config = EngineConfig(model=os.fspath(model), **engine_options)  # TypeError: unknown option
    embedding = None if embedding_model is None else os.fspath(embedding_model)
    async with owner.open_llm(config, embedding, freeze_gc=freeze_gc) as llm:
        yield llm


@dataclasses.dataclass(frozen=True, slots=True)
class EngineOwner:
    """How this process starts and stops the engines it owns: the client
    settings of each, the engine's log level, and ``shutdown_grace``."""

    settings: ClientSettings
    shutdown_grace: float = 5.0
    log_level: str = "INFO"

    @classmethod
    def of(
        cls,
        *,
        max_pending: int,
        overload: str,
        max_queued: int,
        max_queued_tokens: int | None,
        request_timeout: float | None,
        startup_timeout: float,
        heartbeat_timeout: float,
        shutdown_grace: float,
        log_level: str,
    ) -> EngineOwner:
        """The owner that :func:`open_llm` and :func:`tserve.nursery.open_models` build
        from their keyword options (``overload`` by its name; ValueError for another)."""
        settings = ClientSettings(
            max_pending=max_pending,
            request_timeout=request_timeout,
            startup_timeout=startup_timeout,
            heartbeat_timeout=heartbeat_timeout,
            overload=Overload(overload),
            max_queued=max_queued,
            max_queued_tokens=max_queued_tokens,
        )
        return cls(settings, shutdown_grace=shutdown_grace, log_level=log_level)

    @contextlib.asynccontextmanager
    async def open_llm(
        self,
        config: EngineConfig,
        embedding_model: str | None = None,
        *,
        freeze_gc: bool = False,
        prepare_grammars: bool = True,
    ) -> AsyncIterator[LLM]:
        """:func:`open_llm` for ``config`` (its rules), with these settings; ``freeze_gc``
        is the serving GC settings of ``_gc.py``, for a process that serves one model.
        ``prepare_grammars`` builds llguidance's tokenizer as the LLM opens, in
        this process's grammar worker (:meth:`ConstraintCheck.prepare`) and in
        the engine before it answers ready (``Hello(grammars=True)``); a model
        loaded on demand beside others leaves both to its first constrained
        request, since the engine's build holds its GIL, and so its streams,
        for a third of a second or more, and the worker is a process more."""
        settings, grace, level = self.settings, self.shutdown_grace, self.log_level
        options = msgspec.structs.asdict(config)
        async with (
            start_engine(config, log_level=level, stop_grace=grace) as engine,
            _embedder_for(embedding_model, options, settings, grace, level) as emb,
            _connect_llm(
                engine,
                config.model,
                settings,
                emb,
                owned=True,
                freeze_gc=freeze_gc,
                prepare_grammars=prepare_grammars,
            ) as llm,
        ):
            yield llm


@contextlib.asynccontextmanager
async def attach_llm(
    address: str,
    engine_pid: int | None = None,
    *,
    keys: str | os.PathLike[str] | None = None,
    insecure: bool = False,
    heartbeat_interval: float = 0.5,
    settings: ClientSettings = _DEFAULTS,
    freeze_gc: bool = True,
    embedder: Embedder | None = None,
) -> AsyncIterator[LLM]:
    """Yield an :class:`LLM` over a running engine that another process owns.

    Two kinds of engine. With ``engine_pid``: one that an API process on
    this host started, for the extra API processes of ``--api-processes N``
    (each runs its own mux to the one engine at ``address``), watched by
    pid, its tokenizer read from the model directory. Without: a ``tserve
    engine`` at ``address`` on any host, reached by address alone (a
    :class:`~tserve.mux.Link`): ZMQ CURVE with the key directory ``keys``
    (``tserve._curve``; a ``tcp://`` address without keys raises
    ``KeyFileError`` unless ``insecure``), ZMTP heartbeats every half
    ``heartbeat_interval``, and the tokenizer's files sent by the engine.

    Enters once the engine answered Hello with EngineReady (it is normally
    ready already) and the tokenizer is loaded; EngineDeadError if it is
    gone, or (at once) if it refused this process's key. ``embedder`` (see
    ``attach_embedder``) serves :meth:`LLM.embed`.

    Unlike :func:`open_llm`, leaving the block never sends Shutdown and never
    stops the engine: only its owner does. Engine death is seen from here
    through the engine's exit (watched by pid) or, for an engine reached by
    address, the loss of its connection (its exit or kill at once; a host or
    network gone within 1.5 ``heartbeat_interval``); also through its
    EngineDead message, or silence past ``heartbeat_timeout``. Then every
    live request fails with EngineDeadError, as with :func:`open_llm`.
    ``settings``: its bounds, as :func:`open_llm` takes them one by one.
    """
    link = None
    if engine_pid is None:
        require_keys(address, keys, insecure=insecure)
        curve = None if keys is None else await anyio.to_thread.run_sync(client_keys, keys)
        link = Link(curve, heartbeat_interval)
    engine = EngineRef(address, engine_pid, link)
    what = f"the engine at {address}"
    async with _connect_llm(
        engine, what, settings, embedder, owned=False, freeze_gc=freeze_gc, prepare_grammars=True
    ) as llm:
        yield llm


@contextlib.asynccontextmanager
async def open_embedder(
    config: EngineConfig,
    *,
    settings: ClientSettings = _DEFAULTS,
    shutdown_grace: float = 5.0,
    log_level: str = "INFO",
) -> AsyncIterator[Embedder]:
    """Start an embedding engine process for ``config`` and yield an :class:`Embedder`.

    ``config.task`` must be "embed" (see ``embedding_config``). Startup,
    shutdown and engine death behave as in :func:`tserve.open_llm`: enters
    once the engine is ready (EngineDeadError naming the reason if it cannot
    start, e.g. a missing directory); leaving the block in any way sends
    Shutdown and stops the process (at most ``shutdown_grace`` s + the
    SIGTERM/SIGKILL fallbacks; shielded); an exception from the block
    propagates unchanged. ``settings``: its bounds (see :func:`tserve.open_llm`).
    """
    async with _start_embedder(config, settings, shutdown_grace, log_level) as embedder:
        yield embedder


@contextlib.asynccontextmanager
async def attach_embedder(
    address: str,
    engine_pid: int,
    *,
    settings: ClientSettings = _DEFAULTS,
) -> AsyncIterator[Embedder]:
    """Yield an :class:`Embedder` over a running embedding engine that another
    process owns (see :func:`tserve.nursery.attach_llm`: the same rules; leaving
    the block never stops the engine)."""
    engine = EngineRef(address, engine_pid)
    what = f"the embedding engine at {address}"
    async with _connect(engine, what, settings, load_encoder_tokenizer, Embedder) as embedder:
        yield embedder


@contextlib.asynccontextmanager
async def _connect(
    engine: EngineRef,
    what: str,
    settings: ClientSettings,
    load: Callable[[str], _Tokens],
    make: Callable[[EngineSession, ClientSettings, _Tokens], _Client],
    *,
    owned: bool = False,
    embedder: Embedder | None = None,
    grammars: bool = False,
) -> AsyncIterator[_Client]:
    """The client ``make`` builds over ``engine``'s session (see
    :func:`~tserve.nursery._session.engine_session`), its tokenizer loaded
    by ``load`` in a worker thread (from the model directory, or from the
    files the engine sent). Leaving the block sends Shutdown iff ``owned``.
    The death of ``embedder``'s engine is this engine's death. ``grammars``:
    the engine prepares structured outputs before it is ready."""
    async with engine_session(
        engine,
        owned=owned,
        what=what,
        startup_timeout=settings.startup_timeout,
        heartbeat_timeout=settings.heartbeat_timeout,
        depends_on=None if embedder is None else embedder.session,
        grammars=grammars,
    ) as session:
        bundle, session.mux.tokenizer_bundle = session.mux.tokenizer_bundle, None  # MBs
        if bundle is None:
            tokens = await anyio.to_thread.run_sync(load, session.mux.ready.model_path)
        else:
            tokens = await anyio.to_thread.run_sync(load_unpacked, bundle.files, load)
        yield make(session, settings, tokens)


@contextlib.asynccontextmanager
async def _connect_llm(
    engine: EngineRef,
    what: str,
    settings: ClientSettings,
    embedder: Embedder | None,
    *,
    owned: bool,
    freeze_gc: bool,
    prepare_grammars: bool,
) -> AsyncIterator[LLM]:
    """:func:`_connect` for an LLM that serves embeddings with ``embedder``,
    with the serving GC settings (``_gc.py``) when ``freeze_gc``; with
    ``prepare_grammars`` the engine builds its grammar tokenizer before it
    is ready, and this process starts building its own at once. The two
    engines are one LLM: either's death is the other's (``dying_with``, both
    ways), so every call of the LLM, generation or embedding, fails with it."""
    connect = _connect(
        engine,
        what,
        settings,
        load_chat_tokenizer,
        LLM,
        owned=owned,
        embedder=embedder,
        grammars=prepare_grammars,
    )
    async with connect as llm:
        llm.embedder = embedder
        if prepare_grammars:
            llm.constraints.prepare()
        try:
            with (
                contextlib.nullcontext()
                if embedder is None
                else dying_with(llm.session.mux, embedder.session.mux, "generation engine"),
                serving_gc() if freeze_gc else contextlib.nullcontext(),
            ):
                yield llm
        finally:
            llm.constraints.close()  # its grammar worker process


@contextlib.asynccontextmanager
async def _start_embedder(
    config: EngineConfig, settings: ClientSettings, shutdown_grace: float, log_level: str
) -> AsyncIterator[Embedder]:
    if config.task != "embed":
        raise ValueError(f"an embedding engine needs task='embed', not {config.task!r}")
    what = f"the embedding model {config.model}"
    async with (
        start_engine(config, log_level=log_level, stop_grace=shutdown_grace) as engine,
        _connect(engine, what, settings, load_encoder_tokenizer, Embedder, owned=True) as embedder,
    ):
        yield embedder


def _embedder_for(
    model: str | os.PathLike[str] | None,
    engine_options: Mapping[str, Any],
    settings: ClientSettings,
    shutdown_grace: float,
    log_level: str,
) -> contextlib.AbstractAsyncContextManager[Embedder | None]:
    """The embedding engine for ``model``, or nothing for None. Entered before the
    generation engine's mux, so both engines load at the same time."""
    if model is None:
        return contextlib.nullcontext()
    config = embedding_config(os.fspath(model), engine_options)
    return _start_embedder(config, settings, shutdown_grace, log_level)
