"""The routing table between request tasks and the engine: sans-IO, no socket.

The :class:`Router` holds what the mux knows about each request and what the
next ``EngineInput`` frame will carry. It never blocks, never awaits and
touches no socket; the mux's task feeds it engine outputs and sends what it
hands back. Rules:

* A request id is in the table from ``open`` until its final output is
  routed, its mailbox is closed, or the whole table fails. Outputs for ids
  not in the table are counted as unknown and dropped (a closed request).
* ``submit`` queues one add per mailbox (OPEN -> SUBMITTED). A request that
  cannot cross the wire intact ends at once with one ``FinishReason.ERROR``
  output and is never sent, so one bad add cannot spoil a batched frame.
* ``abort`` is idempotent and never raises. It queues one abort for a
  submitted request (SUBMITTED -> ABORTING); one the engine never heard of
  ends at once with ``FinishReason.ABORT`` and nothing is sent. Requests that
  finished or were closed are no longer in the table, so no abort is ever
  sent for them.
* Closing a mailbox aborts its request if it was submitted and not aborted.
* ``fail_all`` ends every open mailbox with one error (engine death, the mux
  stopping): after a death the queued inputs are dropped (nobody would read
  them); otherwise an abort is queued for each submitted request, for a last
  best-effort flush.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Final

import msgspec

from tserve.mux._errors import MuxError
from tserve.mux._mailbox import Mailbox, Submission, deliver
from tserve.protocol import AddRequest, EngineInput, FinishReason, RequestOutput

__all__ = ["Router"]


class Router:
    """Request id -> mailbox, and the inputs not yet sent. Synchronous throughout.

    ``on_input`` is called (synchronously) whenever an add or an abort joins
    the inbox, so that whoever sends can wake up.
    """

    def __init__(self, on_input: Callable[[], None]) -> None:
        self._on_input = on_input
        # Open mailboxes by request id; see the rules above for when an id
        # leaves. Bound: the live requests, which admission control caps.
        self._mailboxes: dict[str, Mailbox] = {}
        # The inbox: what the next EngineInput frame will carry. Bound: each
        # open mailbox puts at most one add (OPEN -> SUBMITTED) and at most
        # one abort (SUBMITTED -> ABORTING), so together at most 2 x open
        # mailboxes. Never waits, never rejects for lack of room.
        self._adds: list[AddRequest] = []
        self._aborts: list[str] = []

    def __len__(self) -> int:
        """The number of open mailboxes."""
        return len(self._mailboxes)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._mailboxes

    @property
    def has_inputs(self) -> bool:
        """True when an add or an abort waits to be sent."""
        return bool(self._adds or self._aborts)

    # -- the request side -------------------------------------------------------

    def open(self, request_id: str, max_tokens: int) -> Mailbox:
        """Register a mailbox for ``request_id``. Raises MuxError when it is already open."""
        if request_id in self._mailboxes:
            raise MuxError(f"request id {request_id!r} is already open")
        mailbox = Mailbox(request_id, max_tokens, self.close)
        self._mailboxes[request_id] = mailbox
        return mailbox

    def submit(self, request: AddRequest) -> None:
        """Queue ``request``'s add. Raises MuxError without an open, unsubmitted mailbox."""
        mailbox = self._mailboxes.get(request.request_id)
        if mailbox is None:
            raise MuxError(f"no open mailbox for request id {request.request_id!r}")
        if mailbox.submission is Submission.OPEN and request.params.max_tokens > mailbox.max_tokens:
            raise MuxError("the request's max_tokens exceeds its mailbox's")
        mailbox.mark_submitted()  # raises if already submitted or aborted
        problem = wire_problem(request)
        if problem is not None:  # never sent: it ends here, alone
            del self._mailboxes[request.request_id]
            mailbox.put(RequestOutput(request.request_id, [], FinishReason.ERROR, error=problem))
            return
        self._adds.append(request)
        self._on_input()

    def abort(self, request_id: str) -> None:
        """Stop ``request_id`` (see the rules above). Never raises."""
        mailbox = self._mailboxes.get(request_id)
        if mailbox is None or mailbox.submission is Submission.ABORTING:
            return
        if mailbox.submission is Submission.OPEN:  # the engine never heard of it
            del self._mailboxes[request_id]
            mailbox.put(RequestOutput(request_id, [], FinishReason.ABORT))
            return
        mailbox.mark_aborting()
        self._aborts.append(request_id)
        self._on_input()

    def close(self, mailbox: Mailbox) -> None:
        """Forget ``mailbox``, aborting its request if the engine may still run it."""
        if self._mailboxes.get(mailbox.request_id) is not mailbox:
            return  # finished, failed or closed already
        if mailbox.submission is Submission.SUBMITTED:
            self.abort(mailbox.request_id)
        del self._mailboxes[mailbox.request_id]

    # -- the engine side ----------------------------------------------------------

    def route(self, outputs: Iterable[RequestOutput]) -> int:
        """Deliver one step's outputs; return how many had no open mailbox."""
        return deliver(self._mailboxes, outputs)

    def take_inputs(self) -> EngineInput | None:
        """Empty the inbox into one EngineInput (adds apply before aborts), or None."""
        if not self._adds and not self._aborts:
            return None
        adds, self._adds = self._adds, []
        aborts, self._aborts = self._aborts, []
        return EngineInput(adds, aborts)

    def fail_all(self, error: BaseException, *, engine_dead: bool) -> None:
        """End every open mailbox with ``error`` and empty the table (see the rules)."""
        mailboxes, self._mailboxes = self._mailboxes, {}
        for mailbox in mailboxes.values():
            mailbox.fail(error)
            if not engine_dead and mailbox.submission is Submission.SUBMITTED:
                self._aborts.append(mailbox.request_id)
        if engine_dead:
            self._adds.clear()
            self._aborts.clear()


_ADD_ENCODER: Final = msgspec.msgpack.Encoder()
_ADD_DECODER: Final = msgspec.msgpack.Decoder(AddRequest)


def wire_problem(request: AddRequest) -> str | None:
    """Why ``request`` would not reach the engine intact, or None. About 2 us.

    Adds travel batched, so one bad add must not spoil its frame: an int
    outside msgpack's range (a seed of 2**64 from an embedding caller) makes
    encoding the whole EngineInput raise, which would stop the mux, and a
    value of the wrong type (a float top_k) makes the engine drop the whole
    frame, losing every other add and abort in it. A round trip through the
    engine's own decoding finds both.
    """
    try:
        _ADD_DECODER.decode(_ADD_ENCODER.encode(request))
    except (OverflowError, TypeError, ValueError, msgspec.MsgspecError) as exc:
        return f"the request cannot be sent to the engine: {exc}"
    return None
