"""The bytes a streaming response has ready that its client has not taken yet.

A streaming body's pumps read the engine's deltas as fast as they come and
put their encoded events here; the response task takes them out, all at
once, and writes them to the client. So a request's admission slot is free
as soon as the engine has finished it, even when its client reads slowly or
not at all: what it still costs is these bytes, and they are bounded twice.

* **Per response** (:data:`RESPONSE_BYTES`): a put that finds the buffer at
  or over the bound waits until the writer takes the bytes out. The waiting
  pump stops reading its stream, whose mailbox merges the engine's deltas
  meanwhile (the engine never waits), and the request stays live (and
  counted by admission) until its client reads or the stall timeout closes
  the connection. A buffer holds at most the bound plus one event per pump.
* **Per app** (:class:`BufferBudget`, :data:`APP_BYTES`): the sum over every
  live buffer. At that bound new generation requests are refused with 503
  (Overloaded) at once, as when ``--max-pending`` requests are live.

Touch a buffer only from the app's trio thread.
"""

from __future__ import annotations

from typing import Final

import trio

from tserve.nursery import Overloaded

__all__ = ["APP_BYTES", "RESPONSE_BYTES", "BufferBudget", "SendBuffer"]

# n=128 chats of 64 tokens, about 2 MB of events, fit in one buffer.
RESPONSE_BYTES: Final = 4 * 1024 * 1024
APP_BYTES: Final = 256 * 1024 * 1024


class BufferBudget:
    """The bytes held by every :class:`SendBuffer` of one app, and their bound."""

    def __init__(self, limit: int = APP_BYTES) -> None:
        self.limit = limit
        self.held = 0  # invariant: the sum of ``len`` over the live buffers

    def check(self) -> None:
        """Raise :class:`Overloaded` while the buffers hold ``limit`` bytes or more."""
        if self.held >= self.limit:
            raise Overloaded(f"{self.held} response bytes wait for their clients", retry_after=1)


class SendBuffer:
    """A byte buffer between one response's pumps (``put``) and its writer (iteration).

    Iterating yields everything buffered at once, until :meth:`close` and
    the buffer is empty.
    """

    def __init__(self, budget: BufferBudget, limit: int = RESPONSE_BYTES) -> None:
        self._budget = budget
        self._limit = limit
        self._parts: list[bytes] = []
        self._size = 0  # invariant: sum(map(len, _parts)); counted in the budget too
        self._closed = False
        self._changed = trio.Event()  # set (and replaced) on every put, take and close

    def __len__(self) -> int:
        return self._size

    async def put(self, data: bytes) -> None:
        """Append ``data``, after waiting while the buffer is at its bound.

        A checkpoint. A cancel while waiting appends nothing.
        """
        while self._size >= self._limit and not self._closed:
            await self._wait()
        await trio.lowlevel.checkpoint()
        self.put_nowait(data)

    def put_nowait(self, data: bytes) -> None:
        """Append ``data`` now, whatever the bound (for the few closing events).
        Synchronous; a closed buffer drops it."""
        if self._closed:
            return
        self._parts.append(data)
        self._size += len(data)
        self._budget.held += len(data)
        self._wake()

    def close(self) -> None:
        """No more puts: iteration ends once the buffered bytes are taken. Synchronous."""
        self._closed = True
        self._wake()

    def discard(self) -> None:
        """Close and drop whatever is buffered (the response is over). Synchronous."""
        self.close()
        self._take()

    def __aiter__(self) -> SendBuffer:
        return self

    async def __anext__(self) -> bytes:
        """Everything buffered, joined; waits while the buffer is empty and open.

        A checkpoint; a cancel while waiting takes nothing.
        """
        while not self._size:
            if self._closed:
                raise StopAsyncIteration
            await self._wait()
        return self._take()

    def _take(self) -> bytes:
        data = b"".join(self._parts)
        self._parts.clear()
        self._budget.held -= self._size
        self._size = 0
        self._wake()
        return data

    async def _wait(self) -> None:
        await self._changed.wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
