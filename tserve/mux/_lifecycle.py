"""The life of one request in the API process, as a state machine. Sans-IO.

Every request has one :class:`Lifecycle`. Its mailbox holds it; the router
(``_router.py``) feeds it what the engine and the mux do, the request task
what its caller does (through ``Mux.submit``, ``Mux.abort`` and
``Mailbox.close``), and each event returns the :class:`Actions` that the IO
around it carries out. Nothing else decides whether a request is sent,
routed, aborted or failed.

States and the only legal moves (event: from -> to)::

    submit        ADMITTED -> SUBMITTED
    output        SUBMITTED -> STREAMING (its first token ids)
    final output  SUBMITTED, STREAMING, ABORTING -> FINISHED (FAILED for FinishReason.ERROR)
    abort         SUBMITTED, STREAMING -> ABORTING;  ADMITTED -> ENDED
    reject        ADMITTED -> ENDED
    close         SUBMITTED, STREAMING, ABORTING -> ABORTED;  ADMITTED -> CLOSED
    fail          every state that is not terminal -> FAILED

Rules, for every request:

1. **Abort exactly once, and only while the engine may run the request.**
   The Abort goes out on the move out of SUBMITTED or STREAMING into
   ABORTING or ABORTED (``abort``, ``close``, or ``fail`` of a mux that
   stops while the engine lives), and on no other move. ABORTING and the
   terminal states have no such move, so a second Abort is never sent; a
   request whose final output has arrived is FINISHED (or FAILED) and is
   never aborted, whether or not its reader has read that output yet.
2. **Every output of a running request is delivered, in order.** The
   outputs of a SUBMITTED, STREAMING or ABORTING request reach its mailbox;
   the final one (a finish reason: nothing for the id follows it) moves it to
   FINISHED, or to FAILED for ``FinishReason.ERROR``, and the router forgets
   its id. An output in any other state is not ours (the engine was never
   told, or we forgot the id): it is dropped and counted as unknown. At most
   ``max_tokens`` token ids are delivered: an engine that sends more fails the
   request (an engine bug; the mailbox never grows past its bound).
3. **Close is every way out** of the caller: done reading, ``break``, a
   cancel, an exception, our own deadline passing, a stop string found in
   the text. After it nothing is delivered and the id is forgotten; whether
   an Abort goes with it is rule 1.
4. **A failure ends every live request at once** (engine death, the mux
   stopping, an engine bug): FAILED; the reader gets the error after what its
   mailbox holds. The engine's death never takes back a request that had
   finished: a FINISHED request keeps its final output, and its reader gets it
   as if nothing had happened. That is the only one that escapes the error.
5. **A request the engine never heard of ends here:** ``abort`` before
   ``submit``, and ``reject`` (a request that cannot cross the wire intact),
   end it with one made-up final output (ENDED) and send nothing.
6. The terminal states (FINISHED, ABORTED, ENDED, FAILED, CLOSED) have no way
   out: ``close``, ``abort`` and ``fail`` change nothing there (each is
   idempotent for the caller), and ``submit`` or ``reject`` raises
   :class:`IllegalTransition`, as it does anywhere but ADMITTED.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Final

from tserve.mux._errors import MuxError
from tserve.protocol import FinishReason, RequestOutput

__all__ = ["DELIVER", "NOTHING", "Actions", "IllegalTransition", "Lifecycle", "RequestState"]


class IllegalTransition(MuxError):
    """A request was asked to move between states its lifecycle forbids."""


class RequestState(enum.Enum):
    ADMITTED = "admitted"  # not sent: tokenizing, waiting for a slot, or about to be sent
    SUBMITTED = "submitted"  # the add is queued or sent; no token yet
    STREAMING = "streaming"  # tokens arrived; the engine is still running it
    ABORTING = "aborting"  # its Abort is queued or sent; the reader still reads
    FINISHED = "finished"  # the engine sent its final output
    ABORTED = "aborted"  # we stopped it (the Abort was sent) and stopped reading
    ENDED = "ended"  # ended before it reached the engine (rule 5)
    FAILED = "failed"  # the engine died, the mux stopped, or the engine failed it
    CLOSED = "closed"  # the caller left before it was sent

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL

    @property
    def engine_may_run(self) -> bool:
        """Whether the engine may be working on the request now (an Abort is due on leaving)."""
        return self is RequestState.SUBMITTED or self is RequestState.STREAMING


_ADMITTED: Final = RequestState.ADMITTED
_SUBMITTED: Final = RequestState.SUBMITTED
_STREAMING: Final = RequestState.STREAMING
_ABORTING: Final = RequestState.ABORTING
_TERMINAL: Final = frozenset(
    {
        RequestState.FINISHED,
        RequestState.ABORTED,
        RequestState.ENDED,
        RequestState.FAILED,
        RequestState.CLOSED,
    }
)


@dataclasses.dataclass(frozen=True, slots=True)
class Actions:
    """What the IO around a :class:`Lifecycle` does after one event, in this order."""

    send: bool = False  # queue the request's add
    abort: bool = False  # queue the request's one Abort
    deliver: bool = False  # put the event's engine output into the mailbox
    end: bool = False  # put a made-up final output into the mailbox (rule 5)
    fail: bool = False  # fail the mailbox with the event's error, after what it holds
    forget: bool = False  # drop the id from the routing table: nothing more is routed


NOTHING: Final = Actions()
_SEND: Final = Actions(send=True)
DELIVER: Final = Actions(deliver=True)
_DELIVER_LAST: Final = Actions(deliver=True, forget=True)
_END: Final = Actions(end=True, forget=True)
_ABORT: Final = Actions(abort=True)
_ABORT_FORGET: Final = Actions(abort=True, forget=True)
_FORGET: Final = Actions(forget=True)
_FAIL: Final = Actions(fail=True, forget=True)
_FAIL_ABORT: Final = Actions(abort=True, fail=True, forget=True)


class Lifecycle:
    """The state of one request and its rules (see the module docstring).

    Synchronous; never blocks, never does IO. ``max_tokens`` bounds the
    token ids the request may receive (rule 2).
    """

    __slots__ = ("_room", "max_tokens", "state")

    def __init__(self, max_tokens: int) -> None:
        self.state = _ADMITTED
        self.max_tokens = max_tokens
        # max_tokens - the token ids delivered so far; < 0 never (rule 2).
        self._room = max_tokens

    def __repr__(self) -> str:
        return f"<Lifecycle {self.state.value}>"

    def submit(self) -> Actions:
        """The request goes to the engine: ADMITTED -> SUBMITTED, send its add."""
        self._move(_SUBMITTED)
        return _SEND

    def reject(self) -> Actions:
        """The request cannot go to the engine (rule 5): ADMITTED -> ENDED."""
        self._move(RequestState.ENDED)
        return _END

    def output(self, output: RequestOutput) -> Actions:
        """One engine output for the request (rule 2). The mux's hot path: O(1)."""
        state = self.state
        if state is not _STREAMING and state is not _ABORTING:
            if state is not _SUBMITTED:
                return NOTHING  # not ours: dropped
            if output.token_ids:
                self.state = _STREAMING
        room = self._room - len(output.token_ids)
        if room < 0:  # the engine broke its word: fail, don't grow (rule 4)
            return self.fail(engine_alive=True)
        self._room = room
        if output.finish_reason is None:
            return DELIVER
        failed = output.finish_reason is FinishReason.ERROR
        self.state = RequestState.FAILED if failed else RequestState.FINISHED
        return _DELIVER_LAST

    def abort(self) -> Actions:
        """Stop the request but keep reading it until its final output (rules 1, 5)."""
        state = self.state
        if state.engine_may_run:
            self.state = _ABORTING
            return _ABORT
        if state is _ADMITTED:
            self.state = RequestState.ENDED
            return _END
        return NOTHING

    def close(self) -> Actions:
        """The caller is done with the request, any way out (rules 1, 3)."""
        state = self.state
        if state.engine_may_run:
            self.state = RequestState.ABORTED
            return _ABORT_FORGET
        if state is _ABORTING:
            self.state = RequestState.ABORTED
            return _FORGET
        if state is _ADMITTED:
            self.state = RequestState.CLOSED
            return _FORGET
        return NOTHING

    def fail(self, *, engine_alive: bool) -> Actions:
        """The request cannot go on (rule 4); ``engine_alive``: the engine may
        still run it (the mux stops, or the engine broke its word), so abort it."""
        state = self.state
        if state.terminal:
            return NOTHING
        self.state = RequestState.FAILED
        return _FAIL_ABORT if engine_alive and state.engine_may_run else _FAIL

    def _move(self, new: RequestState) -> None:
        if self.state is not _ADMITTED:
            raise IllegalTransition(f"{self.state.value} -> {new.value}")
        self.state = new
