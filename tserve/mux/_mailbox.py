"""One request's mailbox: the mux puts deltas in, the request task reads them out.

Rules:

* ``put`` (the router's side) never blocks, never drops and is O(1) per token:
  it keeps the delta and wakes the reader only if the reader is waiting.
* When the reader is slower than the engine, deltas are MERGED as they
  arrive (token ids concatenated, logprobs concatenated, the last finish
  reason and error kept) and handed out as one :class:`RequestOutput`, so one
  slow client costs the mux nothing and loses nothing. Merging on arrival
  (not on read) also keeps the number of live objects, and so the garbage
  collector's work, independent of how far readers lag.
* The output with a finish reason is the last one; after it the reader gets
  ``anyio.EndOfStream``.
* A failed mailbox (engine dead, mux closed) first hands out what it already
  holds, then raises the failure on every later read.
* Its request's way to the engine (owned by the router, see ``_router.py``)
  only moves forward: OPEN -> SUBMITTED (the add is queued) -> ABORTING (the
  abort is queued). ``mark_submitted`` and ``mark_aborting`` raise MuxError
  for any other move.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from types import TracebackType

import anyio
from anyio.lowlevel import cancel_shielded_checkpoint, checkpoint_if_cancelled

from tserve.mux._errors import MuxError
from tserve.mux._parking import Waiter, park
from tserve.protocol import RequestOutput, TokenLogprob

__all__ = ["Mailbox", "Submission", "deliver"]


class Submission(enum.Enum):
    """How far a mailbox's request got towards the engine; see the rules above."""

    OPEN = "open"  # registered; the engine has not heard of it
    SUBMITTED = "submitted"  # its AddRequest is queued or sent
    ABORTING = "aborting"  # its abort is queued or sent (after SUBMITTED)


class Mailbox:
    """The receiving end of one request's outputs.

    Create it with ``Mux.open_mailbox``; read it with ``async for output in
    mailbox`` or ``await mailbox.get()``; close it (or leave its ``with``
    block) when done, which also aborts the request if the engine has not
    finished it.
    """

    __slots__ = (
        "_error",
        "_finished",
        "_last",
        "_logprobs",
        "_on_close",
        "_pending",
        "_room",
        "_submission",
        "_token_ids",
        "_waiter",
        "max_tokens",
        "request_id",
    )

    def __init__(
        self, request_id: str, max_tokens: int, on_close: Callable[[Mailbox], None]
    ) -> None:
        self.request_id = request_id
        self.max_tokens = max_tokens
        # What arrived and was not read yet: the first delta as it came, and
        # once a second one arrives, the merge of all of them in _token_ids /
        # _logprobs, with the latest delta (for its finish reason and error)
        # in _last (deliver() skips that for deltas of token ids only, which
        # carry neither). Bound: at most max_tokens token ids (and their
        # logprobs), because the engine sends each token once and nothing
        # after the finish; a delta past max_tokens fails the mailbox (put)
        # instead of growing it. At the bound nothing waits: put never blocks.
        self._pending: RequestOutput | None = None
        self._token_ids: list[int] | None = None  # not None iff merging
        self._logprobs: list[TokenLogprob] | None = None
        self._last: RequestOutput | None = None
        self._room = max_tokens  # max_tokens - token ids put so far; < 0: failed
        # Set iff the reader waits, and then _pending is None: so while
        # deltas merge, nobody needs waking.
        self._waiter: Waiter | None = None
        self._error: BaseException | None = None
        self._finished = False  # the final output was handed to the reader
        # Owned by the router; moves only forward (see Submission).
        self._submission = Submission.OPEN
        self._on_close = on_close

    def __repr__(self) -> str:
        return f"<Mailbox {self.request_id!r} pending={self._pending is not None}>"

    # The router's side: synchronous, never blocks.

    @property
    def submission(self) -> Submission:
        """How far the request got towards the engine (see :class:`Submission`)."""
        return self._submission

    def mark_submitted(self) -> None:
        """OPEN -> SUBMITTED: the request's add is queued. Raises MuxError otherwise."""
        if self._submission is not Submission.OPEN:
            raise MuxError(f"request id {self.request_id!r} was already submitted or aborted")
        self._submission = Submission.SUBMITTED

    def mark_aborting(self) -> None:
        """SUBMITTED -> ABORTING: the request's abort is queued. Raises MuxError otherwise."""
        if self._submission is not Submission.SUBMITTED:
            raise MuxError(f"request id {self.request_id!r} is not submitted, or already aborted")
        self._submission = Submission.ABORTING

    def put(self, output: RequestOutput) -> None:
        """Store or merge one delta; wake the reader if it waits. Never blocks.

        :func:`deliver` does the common case (one more plain delta onto a
        merge in progress) itself, with the same effect.
        """
        self._room = room = self._room - len(output.token_ids)
        if room < 0:  # an engine bug: fail, don't grow
            self.fail(MuxError(f"engine sent more than {self.max_tokens} tokens"))
            return
        pending = self._pending
        if pending is None:
            self._pending = output
        elif self._token_ids is None:  # a second delta before a read: merge
            self._token_ids = pending.token_ids + output.token_ids
            if pending.logprobs is not None or output.logprobs is not None:
                self._logprobs = (pending.logprobs or []) + (output.logprobs or [])
            self._last = output
        else:
            self._token_ids += output.token_ids
            if output.logprobs is not None:
                if self._logprobs is None:
                    self._logprobs = []
                self._logprobs += output.logprobs
            self._last = output
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
        if self._pending is not None:
            await cancel_shielded_checkpoint()
        else:
            while self._pending is None:
                if self._error is not None:
                    raise self._error
                if self._finished:
                    raise anyio.EndOfStream
                waiter = self._waiter = park()
                await waiter.wait()
        return self._take()

    def _take(self) -> RequestOutput:
        output = self._pending
        assert output is not None
        if self._token_ids is not None:
            last = self._last
            assert last is not None
            output = RequestOutput(
                self.request_id,
                self._token_ids,
                last.finish_reason,
                self._logprobs,
                last.error,
                last.embedding,
            )
            self._token_ids = self._logprobs = self._last = None
        self._pending = None
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


def deliver(mailboxes: dict[str, Mailbox], outputs: Iterable[RequestOutput]) -> int:
    """Put each output into the mailbox of its request id; return how many had none.

    The mux's hot path: one engine step's outputs, a dict lookup and a list
    extend per delta while readers lag (the usual case in a busy step), and
    :meth:`Mailbox.put` for everything else. A mailbox that receives its
    final output is removed from ``mailboxes``. Synchronous, never blocks.
    """
    get = mailboxes.get
    unknown = 0
    for output in outputs:
        mailbox = get(output.request_id)
        if mailbox is None:
            unknown += 1
            continue
        merged = mailbox._token_ids
        if merged is not None and output.finish_reason is None and output.logprobs is None:
            # Inlined put, merge branch: the reader is not waiting (it
            # would have taken _pending) and the delta carries only tokens.
            token_ids = output.token_ids
            room = mailbox._room - len(token_ids)
            if room >= 0:
                mailbox._room = room
                merged += token_ids
                continue
        mailbox.put(output)
        if output.finish_reason is not None:
            del mailboxes[output.request_id]
    return unknown
