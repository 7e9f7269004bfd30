"""Why an engine stops on its own: its parent is gone, or it got a stop signal.

Two kinds of engine process, one rule each:

* Started by an API process (``python -m tserve.gpu ... --parent-pid``,
  :class:`ParentLifeline`): SIGINT is ignored (a Ctrl-C reaches the whole
  process group; the API process decides, and tells the engine with
  Shutdown), and the engine exits 0 once that API process is gone.
* Standalone (``python -m tserve engine``, :class:`SignalLifeline`): no
  parent to watch; SIGTERM or SIGINT stops it. Its peers' liveness comes
  from heartbeats instead (``_bind.py``).

Both are checked on every iteration of the step loop (:meth:`Lifeline.stop_reason`:
within one heartbeat interval or one step). While the model loads (seconds to
minutes), the main thread is busy, so the stop interrupts it instead
(:meth:`Lifeline.load`): the load unwinds (a half-written conversion is
removed on the way) and the engine exits 0.
"""

from __future__ import annotations

import _thread
import abc
import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import ClassVar, TypeVar

from tserve._host import pid_alive

__all__ = ["Lifeline", "ParentLifeline", "SignalLifeline", "Stopped"]

log = logging.getLogger("tserve.engine")

# How long a load whose parent is gone may take to unwind before the process
# just ends (a main thread stuck in a C call never sees the interrupt).
LOAD_EXIT_GRACE = 5.0

_T = TypeVar("_T")


class Stopped(BaseException):
    """Raised in the main thread to unwind a load: the engine is to stop.

    A BaseException so that no ``except Exception`` in loading code stops it.
    """


class Lifeline(abc.ABC):
    """When the engine should stop although nobody asked it over the socket."""

    # True for ``tserve engine``: it tells its peers why it stops, ignores their
    # Shutdown (it is shared; only its own signals stop it), and watches them by
    # heartbeats (no parent tells it that they are gone).
    standalone: ClassVar[bool]

    @abc.abstractmethod
    def stop_reason(self) -> str | None:
        """Why the engine should stop now, or None. Cheap: called every iteration."""

    @abc.abstractmethod
    def load(self, build: Callable[[], _T]) -> _T | None:
        """``build()`` in the main thread, interrupted by a stop; None when stopped.

        A stop that lands just after ``build`` returned raises :class:`Stopped`.
        """


class ParentLifeline(Lifeline):
    """An engine that an API process started: it lives as long as that process.

    When ``parent_pid`` is our parent, its death reparents us, so comparing
    ``os.getppid()`` is exact (no pid-reuse race); otherwise (an intermediate
    launcher) the pid is probed with signal 0. ``interval`` is how often a
    watcher thread checks while the model loads.
    """

    standalone = False

    def __init__(self, parent_pid: int, interval: float) -> None:
        # Ctrl-C in a terminal reaches the whole process group; the API process
        # decides what happens and tells us with Shutdown.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self._interval = interval
        if os.getppid() == parent_pid:
            self._alive: Callable[[], bool] = lambda: os.getppid() == parent_pid
        else:
            log.warning("parent pid %d is not our parent; watching it by pid", parent_pid)
            self._alive = lambda: pid_alive(parent_pid)

    def stop_reason(self) -> str | None:
        return None if self._alive() else "the API process that started the engine is gone"

    def load(self, build: Callable[[], _T]) -> _T | None:
        """A watcher thread checks the parent every interval; when it is gone it
        interrupts the main thread, and ends the process after
        :data:`LOAD_EXIT_GRACE` s should the main thread be stuck in a call
        that cannot be interrupted."""
        loaded = threading.Event()

        def watch() -> None:
            while not loaded.wait(self._interval):
                if (reason := self.stop_reason()) is not None:
                    log.warning("%s; engine exits", reason)
                    _thread.interrupt_main(signal.SIGINT)
                    if not loaded.wait(LOAD_EXIT_GRACE):
                        os._exit(0)
                    return

        def interrupted(signum: int, frame: FrameType | None) -> None:
            if not self._alive():  # the watcher's interrupt, not a stray SIGINT
                raise Stopped

        previous = signal.signal(signal.SIGINT, interrupted)
        threading.Thread(target=watch, name="tserve-parent-watch", daemon=True).start()
        try:
            return build()
        except Stopped:
            return None
        finally:
            loaded.set()
            signal.signal(signal.SIGINT, previous)


class SignalLifeline(Lifeline):
    """``tserve engine``: SIGTERM or SIGINT stops it (see the module docstring).

    While loading, the signal raises :class:`Stopped` in the main thread;
    afterwards it only records itself, for the loop to see at its next
    iteration. A second signal after the first is only logged.
    """

    standalone = True

    def __init__(self) -> None:
        self._signal: signal.Signals | None = None
        self._loading = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._received)

    def _received(self, signum: int, frame: FrameType | None) -> None:
        first = self._signal is None
        if first:
            self._signal = signal.Signals(signum)
        log.info("%s: the engine stops", signal.Signals(signum).name)
        if self._loading and first:
            raise Stopped

    def stop_reason(self) -> str | None:
        if self._signal is None:
            return None
        return f"the engine was stopped ({self._signal.name})"

    def load(self, build: Callable[[], _T]) -> _T | None:
        self._loading = True
        try:
            if self._signal is not None:  # it came before the load began
                return None
            return build()
        except Stopped:
            return None
        finally:
            self._loading = False
