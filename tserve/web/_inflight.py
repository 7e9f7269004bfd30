"""The generation and embedding work in flight, which the SIGTERM drain waits for and ends.

Two kinds of live work, one registry (:class:`InFlight`):

* a handler running under :meth:`InFlight.abortable` (a non-streaming
  request, or a streaming one until its body exists): a cancel scope;
* a streaming body (:class:`SSEBody`) from :meth:`InFlight.add_body` until
  quart leaves it.

:meth:`InFlight.abort_all` ends both with one reason, and every later request
too (``aborting`` stays set): a handler answers with the reason's error JSON,
a stream ends with it as its final SSE error event. :meth:`InFlight.wait_idle`
returns once nothing is live. One registry per app; touch it only from the
app's trio thread.
"""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from tserve.nursery import ShuttingDown
from tserve.web._streaming import SSEBody

__all__ = ["InFlight"]

_T = TypeVar("_T")


class InFlight:
    """The live generations and embeddings of one app (see the module docstring)."""

    def __init__(self) -> None:
        # Weak: a body that quart drops without entering it (its client left
        # in between) leaves the set by itself.
        self._bodies: weakref.WeakSet[SSEBody] = weakref.WeakSet()
        self._scopes: set[trio.CancelScope] = set()
        self.aborting: Exception | None = None  # set once by abort_all, never cleared
        self._idle_changed = trio.Event()  # set (and replaced) when a piece of work ends

    @property
    def count(self) -> int:
        """Requests (streaming or not) that have not ended."""
        return len(self._bodies) + len(self._scopes)

    async def wait_idle(self) -> None:
        """Return once nothing is in flight. A checkpoint; a cancel just stops the wait."""
        while self.count:
            self._idle_changed = trio.Event()
            await self._idle_changed.wait()

    def abort_all(self, reason: Exception) -> None:
        """End every live request now with ``reason``, and every later one. Synchronous."""
        self.aborting = reason
        for body in list(self._bodies):
            body.abort(reason)
        for scope in list(self._scopes):
            scope.cancel()

    async def abortable(self, work: Callable[[], Awaitable[_T]]) -> _T:
        """Run ``work`` so that :meth:`abort_all` ends it with its reason (raised).

        A checkpoint; a cancel from outside cancels ``work``. A streaming
        response's body is added before ``work`` returns, so a request is in
        flight without a gap until its body is closed.
        """
        with trio.CancelScope() as scope:
            self._scopes.add(scope)
            try:
                if self.aborting is not None:
                    scope.cancel()
                return await work()
            finally:
                self._scopes.discard(scope)
                self._idle_changed.set()
        raise self.aborting or ShuttingDown("the server is shutting down")

    def add_body(self, body: SSEBody) -> None:
        """Count ``body`` as live until :meth:`body_closed`; abort it at once when
        aborting. Synchronous."""
        self._bodies.add(body)
        if self.aborting is not None:
            body.abort(self.aborting)

    def body_closed(self, body: SSEBody) -> None:
        """``body``'s ``on_close``: it is no longer live. Synchronous."""
        self._bodies.discard(body)
        self._idle_changed.set()
