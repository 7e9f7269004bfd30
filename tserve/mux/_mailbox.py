"""One request's mailbox: the mux puts deltas in, the request task reads them out.

Rules:

* ``_put`` (the mux's side) never blocks, never drops and is O(1): it appends
  the delta and wakes the reader only if the reader is waiting.
* When the reader is slower than the engine, the deltas waiting for it are
  handed out MERGED as one :class:`RequestOutput` (token ids concatenated,
  logprobs concatenated, the last finish reason and error kept), so one slow
  client costs the mux nothing and loses nothing.
* The output with a finish reason is the last one; after it the reader gets
  ``anyio.EndOfStream``.
* A failed mailbox (engine dead, mux closed) first hands out what it already
  holds, then raises the failure on every later read.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

import anyio
from anyio.lowlevel import cancel_shielded_checkpoint, checkpoint_if_cancelled

from tserve.mux._errors import MuxError
from tserve.protocol import RequestOutput, TokenLogprob

__all__ = ["Mailbox"]


class Mailbox:
    """The receiving end of one request's outputs.

    Create it with ``Mux.open_mailbox``; read it with ``async for output in
    mailbox`` or ``await mailbox.get()``; close it (or leave its ``with``
    block) when done, which also aborts the request if the engine has not
    finished it.
    """

    __slots__ = (
        "_abort_queued",
        "_error",
        "_finished",
        "_on_close",
        "_pending",
        "_submitted",
        "_tokens",
        "_waiter",
        "max_tokens",
        "request_id",
    )

    def __init__(
        self, request_id: str, max_tokens: int, on_close: Callable[[Mailbox], None]
    ) -> None:
        self.request_id = request_id
        self.max_tokens = max_tokens
        # Deltas received and not yet read, oldest first.
        # Bound: at most max_tokens token ids in total plus the one final
        # output, because the engine sends each token once and nothing after
        # the finish; a delta past max_tokens fails the mailbox (_put) instead
        # of growing it. At the bound nothing waits: put never blocks.
        self._pending: list[RequestOutput] = []
        self._tokens = 0  # token ids put so far, <= max_tokens
        self._waiter: anyio.Event | None = None  # set iff the reader waits
        self._error: BaseException | None = None
        self._finished = False  # the final output was handed to the reader
        # Owned by the mux: the add / the abort went into its inbox.
        self._submitted = False
        self._abort_queued = False
        self._on_close = on_close

    def __repr__(self) -> str:
        return f"<Mailbox {self.request_id!r} pending={len(self._pending)}>"

    # The mux's side: synchronous, never blocks.

    def _put(self, output: RequestOutput) -> None:
        """Store one delta and wake the reader if it waits. O(1), never blocks."""
        self._tokens = tokens = self._tokens + len(output.token_ids)
        if tokens > self.max_tokens:  # an engine bug: fail, don't grow
            self._fail(MuxError(f"engine sent more than {self.max_tokens} tokens"))
            return
        self._pending.append(output)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            waiter.set()

    def _fail(self, error: BaseException) -> None:
        """End the mailbox with ``error`` (after what it already holds)."""
        if self._error is None:
            self._error = error
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            waiter.set()

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
        if self._pending:
            await cancel_shielded_checkpoint()
        else:
            while not self._pending:
                if self._error is not None:
                    raise self._error
                if self._finished:
                    raise anyio.EndOfStream
                waiter = self._waiter = anyio.Event()
                await waiter.wait()
        return self._take()

    def _take(self) -> RequestOutput:
        pending = self._pending
        output = pending[0] if len(pending) == 1 else _merge(pending)
        pending.clear()
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
        """Stop receiving; abort the request if the engine has not finished it.

        Synchronous and idempotent: safe in a ``finally`` with no await.
        Later deltas for this id are counted by the mux as unknown.
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


def _merge(outputs: list[RequestOutput]) -> RequestOutput:
    """Concatenate consecutive deltas of one request; the last one's ending wins."""
    last = outputs[-1]
    token_ids = [token for output in outputs for token in output.token_ids]
    logprobs: list[TokenLogprob] | None = None
    if any(output.logprobs is not None for output in outputs):
        logprobs = [lp for output in outputs for lp in output.logprobs or ()]
    return RequestOutput(last.request_id, token_ids, last.finish_reason, logprobs, last.error)
