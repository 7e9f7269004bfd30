"""Liveness while a step runs: heartbeats from a thread, sent only on progress.

An API process declares the engine dead once it has heard nothing from it for
its heartbeat timeout (30 s by default, ``tserve/mux/_heartbeat.py``). Between
steps the loop speaks at least once per tick (a step's outputs, or a
Heartbeat: ``_outbox.py``). One step can outlast the timeout on a loaded
machine (a long prefill chunk beside other work), so while the main thread is
inside ``core.step()`` the pulse thread speaks for it, by these rules:

1. The socket and the :class:`~tserve.gpu.engine._outbox.Outbox` have one user at a
   time: :attr:`Pulse.lock`. The main thread holds it everywhere except inside
   :meth:`Pulse.stepping`, so the pulse thread only ever sends while a step runs.
2. Twice a tick the pulse thread reads the core's progress counter (steps
   begun, and layers the forward pass has finished: ``Core.progress``). When it
   moved since the last read, every peer that heard nothing for a tick gets a
   Heartbeat with the load snapshot taken when the step began.
3. When it did not move, nothing is sent: a step that makes no progress (a
   kernel that never returns, a deadlock) is silent, and is declared dead one
   heartbeat timeout after its last progress.
4. A peer found gone meanwhile is handed back to the main thread
   (:meth:`Pulse.take_gone`), which aborts its requests after the step.
5. An engine whose API process is gone exits from the pulse thread at once
   (``os._exit(0)``), even in the middle of a step that never ends: no orphan
   engine keeps the device.

The main thread never waits for the pulse thread longer than one heartbeat send.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from types import TracebackType

from tserve.gpu.engine._outbox import Outbox
from tserve.protocol import EngineStats

__all__ = ["Pulse"]

log = logging.getLogger("tserve.engine")


class Pulse:
    """The thread that sends Heartbeats while a step makes progress (rules above).

    ``progress()`` is read from the pulse thread: it must be cheap and safe to
    call while the step runs (an integer counter the step only increases).
    ``orphaned()`` says why the engine should exit at once (its parent is gone),
    or None; None for an engine that runs on its own (``tserve engine``).
    Use as a context manager, entered by the main thread: it then holds
    :attr:`lock`.
    """

    def __init__(
        self,
        outbox: Outbox,
        progress: Callable[[], int],
        tick: float,
        orphaned: Callable[[], str | None] | None = None,
    ) -> None:
        if tick <= 0:
            raise ValueError("tick must be positive")
        self.lock = threading.Lock()
        self._outbox = outbox
        self._progress = progress
        self._tick = tick
        self._orphaned = orphaned
        # Guarded by ``lock``. Set only while a step runs: the snapshot its
        # Heartbeats carry.
        self._stats: EngineStats | None = None
        self._seen = 0  # the progress at the last read
        self._gone: list[bytes] = []  # peers found gone by the pulse, for the main thread
        self.beats = 0  # Heartbeat rounds sent by the pulse thread (tests, logs)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tserve-pulse", daemon=True)

    def __enter__(self) -> Pulse:
        self.lock.acquire()
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the thread; waits at most one send of it."""
        self._stop.set()
        self.lock.release()
        self._thread.join()

    @contextlib.contextmanager
    def stepping(self, stats: EngineStats) -> Iterator[None]:
        """Release the socket to the pulse thread for the body (one step).

        ``stats`` is what its Heartbeats say of the load. On the way out
        (also by an exception) the main thread takes the socket back, waiting
        at most for one send in progress.
        """
        self._stats = stats
        self._seen = self._progress()
        self.lock.release()
        try:
            yield
        finally:
            self.lock.acquire()
            self._stats = None

    def take_gone(self) -> list[bytes]:
        """The peers the pulse found gone (already forgotten by the outbox). Hold :attr:`lock`."""
        gone, self._gone = self._gone, []
        return gone

    def _run(self) -> None:
        while not self._stop.wait(self._tick / 2):
            if not self.lock.acquire(blocking=False):
                continue  # the main thread has the socket: it speaks itself
            try:
                if self._stats is not None:
                    self._beat(self._stats)
            finally:
                self.lock.release()

    def _beat(self, stats: EngineStats) -> None:
        """One look during a step: exit if orphaned, else beat if it progressed."""
        if self._orphaned is not None and (reason := self._orphaned()) is not None:
            log.warning("%s during a step; engine exits", reason)
            logging.shutdown()
            os._exit(0)
        progress = self._progress()
        if progress == self._seen:
            return  # rule 3: no progress, no heartbeat
        self._seen = progress
        self._gone += self._outbox.heartbeat(stats, self._tick)
        self.beats += 1
