"""Process watchers: an engine process's exit becomes engine death in its mux.

:func:`watch_engine` runs beside the mux for as long as an engine session
lasts (``_session.py``): for an engine this process started, by waiting on
the child; for one another API process owns, by a pidfd (or by polling the
pid where there is none). An engine that exits with an error sends
EngineDead (with the reason) first, so each watcher gives that message
``_DEATH_MESSAGE_GRACE`` s to arrive before it declares the death itself:
the reason is not lost in a race.
"""

from __future__ import annotations

import logging
import os

import anyio

from tserve._host import pid_alive
from tserve.mux import Mux
from tserve.nursery._engine_process import EngineProcess, EngineRef, exit_reason

__all__ = ["watch_engine"]

log = logging.getLogger("tserve")

_DEATH_MESSAGE_GRACE = 1.0  # s an exit waits for the engine's EngineDead message
_POLL_INTERVAL = 0.1  # s between pid probes where there is no pidfd


async def watch_engine(engine: EngineRef, mux: Mux, mux_done: anyio.Event) -> None:
    """Watch ``engine`` until it exits, then declare it dead in ``mux``. Cancellable.

    ``mux_done`` is set when the mux stops. Returns once the death is declared.
    """
    if isinstance(engine, EngineProcess):
        await _watch_child(engine, mux, mux_done)
    else:
        await _watch_shared(engine, mux, mux_done)


async def _watch_child(engine: EngineProcess, mux: Mux, mux_done: anyio.Event) -> None:
    """Turn the engine process's exit into engine death, and a dead engine into an exit.

    A signal (kill -9) is reported at once. An engine declared dead while
    its process still runs (silent past the heartbeat timeout) is killed, so
    that it cannot hold the device.
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
        if code > 0:
            await _grace(mux_done)
        mux.engine_died(exit_reason(code))
        tg.cancel_scope.cancel()


async def _watch_shared(engine: EngineRef, mux: Mux, mux_done: anyio.Event) -> None:
    """Turn the exit of an engine another process owns into engine death.

    Not our child, so no exit status: a pidfd (exact, no pid reuse) says
    when it is gone, or polling every ``_POLL_INTERVAL`` s where there is none.
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
                await anyio.sleep(_POLL_INTERVAL)
                gone = not pid_alive(engine.pid)
    finally:
        if pidfd is not None:
            os.close(pidfd)
    await _grace(mux_done)
    mux.engine_died(f"the engine process (pid {engine.pid}) exited")


async def _grace(mux_done: anyio.Event) -> None:
    """Give the engine's EngineDead message up to ``_DEATH_MESSAGE_GRACE`` s to stop the mux."""
    if not mux_done.is_set():
        with anyio.move_on_after(_DEATH_MESSAGE_GRACE):
            await mux_done.wait()
