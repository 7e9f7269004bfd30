"""Admission: which units (requests, or embedding inputs) run at once, and which wait.

A client runs at most ``max_pending`` units at once: each running unit holds
a *slot*. A unit that finds no free slot either waits for one or is refused,
by the client's :class:`Overload` mode:

* ``WAIT`` (``open_llm``'s default): it waits, in arrival order, for as long
  as it takes (a cancel, or the request's ``timeout``, ends the wait).
  Nothing is refused for load.
* ``RAISE`` (the HTTP server's): it waits only while the queue has room,
  ``max_queued`` units and ``max_queued_tokens`` prompt tokens; past either
  bound it raises :class:`Overloaded` at once. ``max_queued=0`` is fail-fast:
  exactly the units beyond ``max_pending`` are refused.

A waiting unit holds no engine or mux resource: only its own task, its
prompt and one small record here.

Admission is two steps, so that a synchronous call (``LLM.generate``) can
admit and an asynchronous one (its stream's first ``__anext__``) can wait:
:meth:`Admission.enter` takes free slots at once or a *ticket* (a place in
the queue's count), and :meth:`Admission.wait` turns a ticket into slots.
:meth:`Admission.leave` gives back whichever of the two the unit holds.

Rules (the invariants of the fields below):

* ``0 <= running <= max_pending``; ``0 <= queued``; in RAISE mode
  ``queued <= max_queued`` and ``queued_tokens <= max_queued_tokens``
  except that one unit always may wait when the queue is empty.
* No barging: while anyone waits, :meth:`enter` takes no slot; a released
  slot goes straight to the oldest waiter (first in, first out).
* A waiter cancelled before it was handed slots holds nothing and gives
  back nothing but its ticket; one cancelled after the hand-off passes the
  slots on before the cancel propagates.
"""

from __future__ import annotations

import collections
import enum

import anyio

from tserve.nursery._errors import Overloaded

__all__ = [
    "DEFAULT_MAX_QUEUED_TOKENS",
    "WAITING_REQUEST_BYTES",
    "Admission",
    "Overload",
    "queue_bound_from_memory",
]

# What one streamed HTTP request waiting for a slot holds in the API process
# (its connection, parsed body, task, stream, prompt ids of a short prompt),
# measured as resident-memory growth per waiting request (docs/configuration.md, "Admission").
WAITING_REQUEST_BYTES = 64 * 1024
# The HTTP server's bound on the prompt tokens of waiting requests: at about
# 40 bytes a token as Python ints in a list, some 80 MB.
DEFAULT_MAX_QUEUED_TOKENS = 2_000_000
_QUEUE_MEMORY_SHARE = 8  # the queue may take 1/8 of the memory available at start
_QUEUE_MEMORY_CAP = 2 << 30  # and never more than 2 GiB
_QUEUE_MIN = 1024  # nor fewer than this many requests


def queue_bound_from_memory(bytes_each: int = WAITING_REQUEST_BYTES) -> int:
    """How many requests of ``bytes_each`` may wait: 1/8 of MemAvailable, at most
    2 GiB, at least 1,024 requests. Reads /proc/meminfo (Linux; elsewhere 1 GiB
    is assumed available). Blocking (fast)."""
    available = 1 << 30
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    budget = min(available // _QUEUE_MEMORY_SHARE, _QUEUE_MEMORY_CAP)
    return max(_QUEUE_MIN, budget // bytes_each)


class Overload(enum.Enum):
    """What a unit that finds every slot taken does."""

    WAIT = "wait"  # wait for a slot, without bound
    RAISE = "raise"  # wait while the queue has room, else Overloaded


class _Waiter:
    """One unit waiting in :meth:`Admission.wait`."""

    __slots__ = ("count", "event", "gone", "granted")

    def __init__(self, count: int) -> None:
        self.count = count
        self.event = anyio.Event()
        self.granted = False  # slots were handed to it (set before event)
        self.gone = False  # it stopped waiting (cancelled) before the hand-off


class Admission:
    """The slots and the queue of one client. Every method runs on its event loop."""

    def __init__(
        self,
        max_pending: int,
        overload: Overload = Overload.WAIT,
        *,
        max_queued: int = 0,
        max_queued_tokens: int | None = None,
        noun: str = "requests",
    ) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be at least 1")
        if max_queued < 0:
            raise ValueError("max_queued must not be negative")
        self.max_pending = max_pending
        self.overload = overload
        self.max_queued = max_queued  # RAISE mode only: units without a slot
        self.max_queued_tokens = max_queued_tokens  # RAISE mode only; None: no bound
        self._noun = noun  # names the unit in Overloaded's message
        self.running = 0  # units holding slots
        self.queued = 0  # units holding tickets (waiting, or about to)
        self.queued_tokens = 0  # prompt tokens of the units inside wait()
        self.peak_queued = 0  # the most tickets held at once, for reports
        # Bound: one entry per unit inside wait(), plus entries of units gone
        # since (dropped at the next hand-off, or compacted at twice the live).
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._waiting = 0  # entries of _waiters that are not gone

    @property
    def live(self) -> int:
        """Units admitted and not yet left: running or queued."""
        return self.running + self.queued

    @property
    def saturated(self) -> bool:
        """True when a RAISE-mode client would refuse one more unit now."""
        if self.overload is Overload.WAIT or self.running < self.max_pending:
            return False
        return self.queued >= self.max_queued or self._tokens_full(1)

    def check(self, count: int) -> None:
        """Raise Overloaded if :meth:`enter` of ``count`` units would. Not a checkpoint."""
        if self._free(count) or self.overload is Overload.WAIT:
            return
        if self.queued + count > self.max_queued or self._tokens_full(1):
            raise Overloaded(self._busy())

    def enter(self, count: int = 1) -> bool:
        """Admit ``count`` units: True if they took slots, False if they hold tickets.

        Synchronous; raises Overloaded (RAISE mode, the queue full). A unit
        with a ticket calls :meth:`wait` before it runs; every unit calls
        :meth:`leave` once, with what it holds.
        """
        if self._free(count):
            self.running += count
            return True
        self.check(count)
        self.queued += count
        self.peak_queued = max(self.peak_queued, self.queued)
        return False

    async def wait(self, count: int = 1, tokens: int = 0) -> None:
        """Turn the ticket of ``count`` units into slots; ``tokens`` is their prompt's size.

        A checkpoint that blocks until the slots are free and every older
        waiter was served. Raises Overloaded (RAISE mode) when ``tokens``
        does not fit the token budget beside the others waiting. Cancelling
        it leaves the caller holding its ticket, not slots.
        """
        await anyio.lowlevel.checkpoint_if_cancelled()
        if self._free(count):
            self._take(count)
            return
        if self.overload is Overload.RAISE and self._waiting and self._tokens_full(tokens):
            raise Overloaded(self._busy())
        waiter = _Waiter(count)
        self._waiters.append(waiter)
        self._waiting += 1
        self.queued_tokens += tokens
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:  # handed slots in the meantime: pass them on
                self.queued += count
                self.leave(count, held=True)
            else:
                waiter.gone = True
                self._waiting -= 1
                self._compact()
            raise
        finally:
            self.queued_tokens -= tokens

    def leave(self, count: int = 1, *, held: bool) -> None:
        """Give back ``count`` slots (``held``) or tickets. Synchronous; never raises."""
        if not held:
            self.queued -= count
            return
        self.running -= count
        self._hand_off()

    # -- internals -------------------------------------------------------------------

    def _free(self, count: int) -> bool:
        return self._waiting == 0 and self.running + count <= self.max_pending

    def _take(self, count: int) -> None:
        self.queued -= count
        self.running += count

    def _tokens_full(self, tokens: int) -> bool:
        bound = self.max_queued_tokens
        return bound is not None and self.queued_tokens + tokens > bound

    def _hand_off(self) -> None:
        """Hand free slots to the oldest waiters that fit, in order."""
        waiters = self._waiters
        while waiters:
            head = waiters[0]
            if head.gone:
                waiters.popleft()
                continue
            if self.running + head.count > self.max_pending:
                return
            waiters.popleft()
            self._waiting -= 1
            self._take(head.count)
            head.granted = True
            head.event.set()

    def _compact(self) -> None:
        """Drop gone entries once they outnumber the live ones (amortised O(1))."""
        if len(self._waiters) > 2 * self._waiting + 64:
            self._waiters = collections.deque(w for w in self._waiters if not w.gone)
        if self._waiting == 0 or (self._waiters and self._waiters[0].gone):
            self._hand_off()  # a gone head may have held back a fitting successor

    def _busy(self) -> str:
        if self.max_queued == 0:
            return f"{self.max_pending} {self._noun} are already in flight"
        return f"{self.running} {self._noun} are running and {self.queued} are queued"
