"""Park a task until another task wakes it: the mailbox's seam to trio and asyncio.

A mailbox's reader sleeps between the engine steps that have something for
it, so this wait is on the path of every streamed token. ``anyio.Event``
would do, but it is one-shot and costs, per wait, an anyio event, the
backend's event, its set of waiters, an abort closure and two more coroutine
frames, all of them tracked by the cyclic garbage collector for as long as
the reader sleeps (with a thousand sleeping readers, full collections walk
them all). A :class:`Waiter` is one small object over the backend's own
primitive:

* trio: the task parks in ``trio.lowlevel.wait_task_rescheduled``, and
  ``wake`` reschedules it;
* asyncio: the task awaits a future of the running loop, and ``wake``
  resolves it.

Rules:

1. ``park()`` makes a waiter for the current task, which must await its
   ``wait()`` at once (no checkpoint in between) and only once.
2. ``wake()`` is synchronous, never blocks, and is idempotent: after the
   first call, or once the wait was cancelled, it does nothing.
3. ``wait()`` is a checkpoint that returns once woken. Cancellation: it
   raises the backend's cancellation exception and the waiter is spent; the
   waker's state (what it wanted to hand over) is untouched, so the caller
   loses nothing as long as it keeps its data outside the waiter.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import trio

__all__ = ["Waiter", "park"]


class Waiter(Protocol):
    async def wait(self) -> None: ...

    def wake(self) -> None: ...


def park() -> Waiter:
    """A waiter for the current task, under trio or asyncio. See the rules above."""
    trio = sys.modules.get("trio")  # not imported: this is no trio task
    if trio is not None and trio.lowlevel.in_trio_task():
        return _TrioWaiter()
    return _AsyncioWaiter(asyncio.get_running_loop())


class _TrioWaiter:
    __slots__ = ("_task",)

    def __init__(self) -> None:
        import trio  # imported already (park checked): these imports are lookups

        # The parked task; None once woken or aborted (rule 2).
        self._task: trio.lowlevel.Task | None = trio.lowlevel.current_task()

    async def wait(self) -> None:
        import trio

        await trio.lowlevel.wait_task_rescheduled(self._abort)

    def _abort(self, _: Callable[[], object]) -> trio.lowlevel.Abort:
        import trio

        self._task = None
        return trio.lowlevel.Abort.SUCCEEDED

    def wake(self) -> None:
        task = self._task
        if task is not None:
            import trio

            self._task = None
            trio.lowlevel.reschedule(task)


class _AsyncioWaiter:
    __slots__ = ("_future",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # Done once woken, or cancelled with the waiting task (rule 2).
        self._future: asyncio.Future[None] = loop.create_future()

    async def wait(self) -> None:
        await self._future

    def wake(self) -> None:
        if not self._future.done():
            self._future.set_result(None)
