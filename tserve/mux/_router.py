"""The routing table between request tasks and the engine: sans-IO, no socket.

The :class:`Router` holds each open request's mailbox by id and what the
next ``EngineInput`` frame will carry. It never blocks, never awaits and
touches no socket; the mux's task feeds it engine outputs and sends what it
hands back. Every decision about one request (is it sent, routed, aborted,
failed, forgotten) is its :class:`~tserve.mux._lifecycle.Lifecycle`'s: the
router turns each event into a call of it and carries out the
:class:`~tserve.mux._lifecycle.Actions` it returns (:meth:`Router._apply`).
Rules of the table itself:

* A request id is in the table from ``open`` until its lifecycle says to
  forget it (its final output was routed, it was closed, it failed). Outputs
  for ids not in the table, and those its lifecycle drops, are counted as
  unknown.
* A request that cannot cross the wire intact (``wire_problem``) is never
  sent (the lifecycle's ``reject``): it ends at once with one
  ``FinishReason.ERROR`` output, so one bad add cannot spoil a batched frame.
  One aborted before it was sent ends with one ``FinishReason.ABORT`` output.
* An abort still waiting to be sent when its request's last output is routed
  is withdrawn (the two crossed): a finished request is never aborted.
* ``fail_all`` fails every open request at once (engine death, the mux
  stopping): after a death the queued inputs are dropped (nobody would read
  them); otherwise the aborts the lifecycles ask for are queued, for a last
  best-effort flush.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Final

import msgspec

from tserve.mux._errors import MuxError
from tserve.mux._lifecycle import DELIVER, Actions, Lifecycle, RequestState
from tserve.mux._mailbox import Mailbox
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
        # The inbox: what the next EngineInput frame will carry. Bound: a
        # lifecycle sends at most one add and one abort, so together at most
        # 2 x open mailboxes. Never waits, never rejects for lack of room.
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

    def open(self, request_id: str, max_tokens: int, lifecycle: Lifecycle | None = None) -> Mailbox:
        """Register a mailbox for ``request_id`` (with ``lifecycle``, the request's
        own, else a new one). Raises MuxError when the id is already open, or
        ``lifecycle`` is not new or bounds another ``max_tokens``."""
        if request_id in self._mailboxes:
            raise MuxError(f"request id {request_id!r} is already open")
        if lifecycle is None:
            lifecycle = Lifecycle(max_tokens)
        elif lifecycle.max_tokens != max_tokens or lifecycle.state is not RequestState.ADMITTED:
            raise MuxError(f"request id {request_id!r}: its lifecycle is not a new one")
        mailbox = Mailbox(request_id, lifecycle, self.close)
        self._mailboxes[request_id] = mailbox
        return mailbox

    def submit(self, request: AddRequest) -> None:
        """Queue ``request``'s add. Raises MuxError without an open, unsubmitted mailbox."""
        mailbox = self._mailboxes.get(request.request_id)
        if mailbox is None:
            raise MuxError(f"no open mailbox for request id {request.request_id!r}")
        if request.params.max_tokens > mailbox.max_tokens:
            raise MuxError("the request's max_tokens exceeds its mailbox's")
        problem = wire_problem(request)
        if problem is None:
            self._apply(mailbox, mailbox.lifecycle.submit(), request=request)
        else:  # never sent: it ends here, alone
            ending = RequestOutput(request.request_id, [], FinishReason.ERROR, error=problem)
            self._apply(mailbox, mailbox.lifecycle.reject(), ending=ending)

    def abort(self, request_id: str) -> None:
        """Stop ``request_id``; its mailbox still gets its last output. Never raises."""
        mailbox = self._mailboxes.get(request_id)
        if mailbox is not None:
            ending = RequestOutput(request_id, [], FinishReason.ABORT)
            self._apply(mailbox, mailbox.lifecycle.abort(), ending=ending)

    def close(self, mailbox: Mailbox) -> None:
        """Forget ``mailbox``, aborting its request if the engine may still run it."""
        if self._mailboxes.get(mailbox.request_id) is mailbox:  # else terminal: nothing to do
            self._apply(mailbox, mailbox.lifecycle.close())

    # -- the engine side ----------------------------------------------------------

    def route(self, outputs: Iterable[RequestOutput]) -> int:
        """Deliver one step's outputs; return how many had no open mailbox.

        The mux's hot path: a dict lookup, the lifecycle's verdict and a
        merge per delta. Synchronous, never blocks.
        """
        get = self._mailboxes.get
        deliver = DELIVER
        unknown = 0
        for output in outputs:
            mailbox = get(output.request_id)
            if mailbox is None:
                unknown += 1
                continue
            actions = mailbox.lifecycle.output(output)
            if actions is deliver:  # the usual case
                mailbox.put(output)
                continue
            if actions.fail:
                error = MuxError(f"engine sent more than {mailbox.max_tokens} tokens")
                self._apply(mailbox, actions, error=error)
            elif actions.deliver:
                self._apply(mailbox, actions, output=output)
            else:  # not ours (the lifecycle's rule 2)
                unknown += 1
        return unknown

    def take_inputs(self) -> EngineInput | None:
        """Empty the inbox into one EngineInput (adds apply before aborts), or None."""
        if not self._adds and not self._aborts:
            return None
        adds, self._adds = self._adds, []
        aborts, self._aborts = self._aborts, []
        return EngineInput(adds, aborts)

    def fail_all(self, error: BaseException, *, engine_dead: bool) -> None:
        """Fail every open request with ``error`` and empty the table (see the rules)."""
        for mailbox in list(self._mailboxes.values()):
            actions = mailbox.lifecycle.fail(engine_alive=not engine_dead)
            self._apply(mailbox, actions, error=error)
        if engine_dead:
            self._adds.clear()
            self._aborts.clear()

    def _apply(
        self,
        mailbox: Mailbox,
        actions: Actions,
        *,
        request: AddRequest | None = None,
        output: RequestOutput | None = None,
        ending: RequestOutput | None = None,
        error: BaseException | None = None,
    ) -> None:
        """Carry out ``actions`` for ``mailbox``: the event's ``request`` (to send),
        engine ``output``, made-up ``ending`` or ``error``, in the order of Actions."""
        if actions.send and request is not None:
            self._adds.append(request)
        if actions.abort:
            self._aborts.append(mailbox.request_id)
        if actions.send or actions.abort:
            self._on_input()
        if actions.deliver and output is not None:
            mailbox.put(output)
        if actions.end and ending is not None:
            mailbox.put(ending)
        if actions.fail and error is not None:
            mailbox.fail(error)
        if actions.forget:
            del self._mailboxes[mailbox.request_id]
            if output is not None and self._aborts:  # its last output: see the rules
                self._withdraw_abort(mailbox.request_id)

    def _withdraw_abort(self, request_id: str) -> None:
        """Drop ``request_id``'s queued abort, if any (the queue is short: it
        empties at every ``take_inputs``)."""
        if request_id in self._aborts:
            self._aborts.remove(request_id)


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
