"""One request's mailbox: the mux puts deltas in, the request task reads them out.

Rules:

* ``put`` (the router's side) never blocks, never drops and is O(1) per token:
  it keeps the delta and wakes the reader only if the reader is waiting.
* When the reader is slower than the engine, deltas are MERGED as they
  arrive (:class:`~tserve.protocol.OutputMerge`, the one merge rule) and
  handed out as one :class:`RequestOutput`, so one slow client costs the mux
  nothing and loses nothing. Merging on arrival (not on read) also keeps the
  number of live objects, and so the garbage collector's work, independent
  of how far readers lag.
* The output with a finish reason is the last one; after it the reader gets
  ``anyio.EndOfStream``.
* A failed mailbox (engine dead, mux closed) first hands out what it already
  holds, then raises the failure on every later read.
* What reaches the mailbox, and when it fails, is decided by its request's
  :class:`~tserve.mux._lifecycle.Lifecycle` (``lifecycle``), which the
  router feeds; the mailbox itself only stores and wakes.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

import anyio
from anyio.lowlevel import cancel_shielded_checkpoint, checkpoint_if_cancelled

from tserve.mux._lifecycle import Lifecycle, RequestState
from tserve.mux._parking import Waiter, park
from tserve.protocol import OutputMerge, RequestOutput

__all__ = ["Mailbox"]


class Mailbox(OutputMerge):
    """The receiving end of one request's outputs: what waits for the reader
    (an :class:`OutputMerge`), and the reader's side.

    Create it with ``Mux.open_mailbox``; read it with ``async for output in
    mailbox`` or ``await mailbox.get()``; close it (or leave its ``with``
    block) when done, which also aborts the request if the engine may still
    run it.
    """

    __slots__ = (
        "_error",
        "_finished",
        "_on_close",
        "_waiter",
        "lifecycle",
        "request_id",
    )

    def __init__(
        self,
        request_id: str,
        lifecycle: Lifecycle | int,
        on_close: Callable[[Mailbox], None],
    ) -> None:
        """``lifecycle``: the request's, or its ``max_tokens`` for a new one."""
        self.request_id = request_id
        if isinstance(lifecycle, int):
            lifecycle = Lifecycle(lifecycle)
        self.lifecycle = lifecycle
        # What arrived and was not read yet, merged (the OutputMerge this is).
        # Bound: at most max_tokens token ids (and their logprobs): the
        # lifecycle delivers no more (its rule 2). At the bound nothing
        # waits: put never blocks.
        super().__init__()
        # Set iff the reader waits, and then nothing is merged: so while
        # deltas merge, nobody needs waking.
        self._waiter: Waiter | None = None
        self._error: BaseException | None = None
        self._finished = False  # the final output was handed to the reader
        self._on_close = on_close

    def __repr__(self) -> str:
        return f"<Mailbox {self.request_id!r} {self.lifecycle.state.value}>"

    @property
    def max_tokens(self) -> int:
        return self.lifecycle.max_tokens

    @property
    def state(self) -> RequestState:
        return self.lifecycle.state

    # The router's side: synchronous, never blocks.

    def put(self, output: RequestOutput) -> None:
        """Store or merge one delta; wake the reader if it waits. Never blocks."""
        self.add(output)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            waiter.wake()

    def fail(self, error: BaseException) -> None:
        """End the mailbox with ``error`` (after what it already holds)."""
        if self._error is None:
            self._error = error
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            waiter.wake()

    # The reader's side.

    async def get(self) -> RequestOutput:
        """Return every delta received since the last call, merged into one.

        Waits until at least one has arrived. Always a checkpoint.
        Cancellation: if cancelled, nothing was taken; the next call returns
        it. Raises ``anyio.EndOfStream`` after the final output was returned,
        ``EngineDeadError``/``MuxClosedError``/``MuxError`` if the mailbox
        failed (once what it held was returned).
        """
        await checkpoint_if_cancelled()
        if self._first is not None:  # something waits
            await cancel_shielded_checkpoint()
        else:
            while self._first is None:
                if self._error is not None:
                    raise self._error
                if self._finished:
                    raise anyio.EndOfStream
                waiter = self._waiter = park()
                await waiter.wait()
        return self._take()

    def _take(self) -> RequestOutput:
        output = self.take()
        assert output is not None
        if output.finish_reason is not None:
            self._finished = True
        return output

    def __aiter__(self) -> Mailbox:
        return self

    async def __anext__(self) -> RequestOutput:
        """Like :meth:`get`; the iteration ends after the final output."""
        try:
            return await self.get()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    @property
    def finished(self) -> bool:
        """True once the output with a finish reason has been read."""
        return self._finished

    def close(self) -> None:
        """Stop receiving; abort the request if the engine may still run it.

        Synchronous and idempotent: safe in a ``finally`` with no await.
        Later deltas for this id are counted by the router as unknown.
        """
        self._on_close(self)

    def __enter__(self) -> Mailbox:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
