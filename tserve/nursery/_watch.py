"""Process watchers: an engine process's exit becomes engine death in its mux.

:func:`watch_engine` runs beside the mux for as long as an engine session
lasts (``_session.py``). A child's exit is an event, never a poll: for an
engine this process started, by waiting on the child (a pidfd or a waiting
thread, as the event loop does it); for one another API process owns, by a
pidfd (polling the pid only where the kernel has none). A kill by a signal
is declared at once: its exit status says all there is. An engine that
exits with an error sends EngineDead (with the reason) just before, so
that exit, and the exit of an engine not our child (no status to read),
give the message ``_DEATH_MESSAGE_GRACE`` s to arrive first: the reason is
not lost in a race, and every live request still ends within a fraction
of a second.

:func:`dying_with` makes one engine's death another's: an LLM's generation
engine and its embedding engine die together, either way round (each is
declared dead, and asked to shut down, when the other dies), so that every
live call of the LLM ends at once with the same error whichever engine died
(a server treats either death as fatal). It is a listener of the dying
mux's death, called in the same tick, not a task woken after that mux
stops: the other engine's requests fail as directly as for its own death,
and its exit is awaited in the background.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import anyio

from tserve._host import pid_alive
from tserve.mux import Mux
from tserve.nursery._engine_process import EngineProcess, EngineRef, exit_reason

__all__ = ["dying_with", "watch_engine"]

log = logging.getLogger("tserve")

# s an exit waits for the engine's EngineDead message; one sent before the
# exit is already in the socket's pipe, so this only covers a thread switch.
_DEATH_MESSAGE_GRACE = 0.1
_EXIT_GRACE = 1.0  # s an engine declared dead while it runs gets to exit before a kill
_POLL_INTERVAL = 0.1  # s between pid probes where there is no pidfd


async def watch_engine(engine: EngineRef, mux: Mux, mux_done: anyio.Event) -> None:
    """Watch ``engine`` until it exits, then declare it dead in ``mux``. Cancellable.

    ``mux_done`` is set when the mux stops. Returns once the death is declared,
    or at once for an engine with no process here (its mux's link watches it).
    """
    if isinstance(engine, EngineProcess):
        await _watch_child(engine, mux, mux_done)
    elif engine.pid is not None:
        await _watch_shared(engine.pid, mux, mux_done)


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
                with anyio.move_on_after(_EXIT_GRACE):
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


async def _watch_shared(pid: int, mux: Mux, mux_done: anyio.Event) -> None:
    """Turn the exit of an engine another process owns (``pid``) into engine death.

    Not our child, so no exit status: a pidfd (exact, no pid reuse) says
    when it is gone, or polling every ``_POLL_INTERVAL`` s where there is none.
    """
    try:
        pidfd: int | None = os.pidfd_open(pid)
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
                gone = not pid_alive(pid)
    finally:
        if pidfd is not None:
            os.close(pidfd)
    await _grace(mux_done)
    mux.engine_died(f"the engine process (pid {pid}) exited")


async def _grace(mux_done: anyio.Event) -> None:
    """Give the engine's EngineDead message up to ``_DEATH_MESSAGE_GRACE`` s to stop the mux."""
    if not mux_done.is_set():
        with anyio.move_on_after(_DEATH_MESSAGE_GRACE):
            await mux_done.wait()


@contextlib.contextmanager
def dying_with(dependency: Mux | None, mux: Mux, what: str) -> Iterator[None]:
    """For the block, the death of ``dependency``'s engine is ``mux``'s engine's death.

    Synchronous, never blocks. When ``dependency``'s engine is declared dead
    (before the block or in it), in the same tick and without a task switch:
    ``mux``'s engine, which still runs, is asked to shut down (the mux
    flushes that as it stops, and the process watcher kills the engine if it
    has not exited ``_EXIT_GRACE`` s later), and every request open in
    ``mux`` fails with EngineDeadError naming ``what`` and the dependency's
    reason. A dependency that stops without dying changes nothing; nor does
    its death after the block. ``dependency`` None: nothing to follow.
    """
    if dependency is None:
        yield
        return

    def died(reason: str) -> None:
        if mux.dead:  # its own death, or the one that caused this
            return
        mux.shutdown_engine(f"{what} died: {reason}")
        mux.engine_died(f"{what}: {reason}")

    dependency.death_listeners.append(died)
    try:
        if dependency.dead_reason is not None:
            died(dependency.dead_reason)
        yield
    finally:
        dependency.death_listeners.remove(died)
