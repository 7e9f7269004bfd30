"""The lifecycle of one request in the API process, as a state machine.

States and the only legal transitions::

    ADMITTED --submit--> SUBMITTED --first token--> STREAMING
        |                    |                          |
        |                    +--------------------------+--> FINISHED  (engine said so)
        |                    +--------------------------+--> ABORTED   (we told it to stop)
        +--------------------+--------------------------+--> FAILED    (engine died / error)
        +--> CLOSED (left before submitting: nothing to tell the engine)

FINISHED, ABORTED, FAILED and CLOSED are terminal. The rule that makes
cancellation safe: leaving SUBMITTED or STREAMING for anything but FINISHED
or FAILED sends exactly one Abort, because those are the states in which the
engine may still be working for us. An illegal transition raises.
"""

from __future__ import annotations

import enum

__all__ = ["IllegalTransition", "RequestState", "needs_abort", "transition"]


class IllegalTransition(RuntimeError):
    """A request was asked to move between states the lifecycle forbids."""


class RequestState(enum.Enum):
    ADMITTED = "admitted"
    SUBMITTED = "submitted"
    STREAMING = "streaming"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"
    CLOSED = "closed"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset(
    {RequestState.FINISHED, RequestState.ABORTED, RequestState.FAILED, RequestState.CLOSED}
)
_ENDINGS = frozenset({RequestState.FINISHED, RequestState.ABORTED, RequestState.FAILED})
_ALLOWED: dict[RequestState, frozenset[RequestState]] = {
    RequestState.ADMITTED: frozenset(
        {RequestState.SUBMITTED, RequestState.FAILED, RequestState.CLOSED}
    ),
    RequestState.SUBMITTED: frozenset({RequestState.STREAMING} | _ENDINGS),
    RequestState.STREAMING: _ENDINGS,
    RequestState.FINISHED: frozenset(),
    RequestState.ABORTED: frozenset(),
    RequestState.FAILED: frozenset(),
    RequestState.CLOSED: frozenset(),
}


def transition(state: RequestState, new: RequestState) -> RequestState:
    """Return ``new`` if the move is legal, else raise IllegalTransition."""
    if new not in _ALLOWED[state]:
        raise IllegalTransition(f"{state.value} -> {new.value}")
    return new


def needs_abort(state: RequestState) -> bool:
    """Whether the engine may still be generating for a request in ``state``."""
    return state in (RequestState.SUBMITTED, RequestState.STREAMING)
