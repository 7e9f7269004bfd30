"""An engine session: a mux to an engine, and a watcher of its process.

:func:`engine_session` is what every client (``LLM``, ``Embedder``) runs
under: it starts the mux task (logging every ``_PROGRESS_INTERVAL`` s while
the engine loads), the process watcher (``_watch.py``), enters once the
engine is ready, and on the way out sends Shutdown to an engine it owns.
An exception from the block propagates unchanged: :func:`unwrap` strips
the groups the session's own task groups add.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator

import anyio
import anyio.abc

from tserve.mux import Mux
from tserve.nursery._engine_process import EngineRef
from tserve.nursery._watch import dying_with, watch_engine
from tserve.protocol import EngineReady

__all__ = ["EngineSession", "engine_session", "unwrap"]

log = logging.getLogger("tserve")

_PROGRESS_INTERVAL = 10.0  # s between "waiting for the engine" log lines


@dataclasses.dataclass(frozen=True, slots=True)
class EngineSession:
    """A ready engine behind a running mux, as :func:`engine_session` yields it."""

    engine: EngineRef
    mux: Mux
    done: anyio.Event  # set when the mux stopped (engine dead or the session left)


@contextlib.asynccontextmanager
async def engine_session(
    engine: EngineRef,
    *,
    owned: bool,
    what: str,
    startup_timeout: float,
    heartbeat_timeout: float,
    depends_on: EngineSession | None = None,
    grammars: bool = False,
) -> AsyncIterator[EngineSession]:
    """Run a mux to ``engine`` and a watcher of its process for the block.

    Enters once the engine is ready (EngineDeadError if it died, failed to
    start or was not ready within ``startup_timeout`` s; meanwhile the log
    says every 10 s that we wait for ``what``). Leaving the block sends
    Shutdown first when ``owned`` (the owner stops the process itself; see
    :func:`~tserve.nursery._engine_process.start_engine`), never otherwise,
    and cancels the mux and the watcher. An exception from the block
    propagates unchanged. ``depends_on`` (the embedding engine's session,
    for a generation engine that serves with one) is watched too: its
    engine's death is this engine's death, in the same tick (``dying_with``).
    ``grammars``: the engine prepares structured outputs before it answers
    ready (:class:`~tserve.protocol.Hello`).
    """
    body_error: BaseException | None = None
    try:
        async with anyio.create_task_group() as tg:
            mux = Mux(
                heartbeat_timeout=heartbeat_timeout,
                ready_timeout=startup_timeout,
                link=engine.link,
                grammars=grammars,
            )
            session = EngineSession(engine, mux, anyio.Event())
            dependency = None if depends_on is None else depends_on.mux
            try:
                tg.start_soon(watch_engine, engine, mux, session.done)
                with dying_with(dependency, mux, "embedding engine"):
                    await _start_mux(tg, session, model=what)
                    try:
                        yield session
                    except BaseException as exc:
                        body_error = exc
                        raise
            finally:
                if owned:
                    mux.shutdown_engine("API process leaving")
                tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        error = unwrap(group, body_error)
        if error is group:
            raise
    else:
        return
    raise error


def unwrap(
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


async def _start_mux(tg: anyio.abc.TaskGroup, session: EngineSession, *, model: str) -> EngineReady:
    """Run the mux in ``tg``; return once the engine is ready, with progress in the log.

    Raises EngineDeadError if the engine died, failed to start or did not
    become ready within the mux's ``ready_timeout``.
    """
    mux, engine = session.mux, session.engine
    async with anyio.create_task_group() as progress:
        where = engine.address if engine.pid is None else f"pid {engine.pid}"
        progress.start_soon(_log_waiting, where, model)
        try:
            await tg.start(_run_mux, mux, engine.address, session.done)
        finally:
            progress.cancel_scope.cancel()
    ready = mux.ready
    log.info("engine ready: %s (%s, %s)", ready.model, where, ready.device)
    if ready.task == "generate":
        log.info("%s", ready.sampling_defaults.describe())
    return ready


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


async def _log_waiting(where: str, model: str) -> None:
    started = anyio.current_time()
    while True:
        await anyio.sleep(_PROGRESS_INTERVAL)
        waited = anyio.current_time() - started
        log.info("waiting for the engine (%s) to load %s: %.0f s", where, model, waited)
