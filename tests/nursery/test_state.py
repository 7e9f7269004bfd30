"""The request state machine and open_llm's exception unwrapping, without processes."""

from __future__ import annotations

import pytest

from tserve.nursery._session import unwrap
from tserve.nursery._state import IllegalTransition, RequestState, needs_abort, transition

S = RequestState


def test_the_happy_path() -> None:
    state = transition(S.ADMITTED, S.SUBMITTED)
    state = transition(state, S.STREAMING)
    assert transition(state, S.FINISHED) is S.FINISHED


@pytest.mark.parametrize("state", [S.SUBMITTED, S.STREAMING])
def test_abort_only_while_the_engine_may_run_it(state: RequestState) -> None:
    assert needs_abort(state)
    assert transition(state, S.ABORTED) is S.ABORTED


@pytest.mark.parametrize("state", list(RequestState))
def test_terminal_states_have_no_way_out_so_abort_happens_once(state: RequestState) -> None:
    if not state.terminal:
        return
    assert not needs_abort(state)
    for new in RequestState:
        with pytest.raises(IllegalTransition):
            transition(state, new)


def test_a_request_never_submitted_is_never_aborted() -> None:
    assert not needs_abort(S.ADMITTED)
    with pytest.raises(IllegalTransition):
        transition(S.ADMITTED, S.ABORTED)
    assert transition(S.ADMITTED, S.CLOSED) is S.CLOSED


class Boom(Exception):
    pass


def test_unwrap_returns_the_body_exception_through_our_groups() -> None:
    boom = Boom()
    assert unwrap(ExceptionGroup("tg", [ExceptionGroup("tg", [boom])]), boom) is boom


def test_unwrap_keeps_the_body_group_even_when_copied() -> None:
    body = ExceptionGroup("mine", [Boom(), Boom()])
    copied = body.derive(body.exceptions)  # as a cancel scope's split() does
    assert unwrap(ExceptionGroup("tg", [copied]), body) is body
    single = ExceptionGroup("mine", [Boom()])
    assert unwrap(ExceptionGroup("tg", [single.derive(single.exceptions)]), single) is single


def test_unwrap_a_lone_startup_failure_and_keep_real_groups() -> None:
    failure = RuntimeError("engine died")
    assert unwrap(ExceptionGroup("a", [ExceptionGroup("b", [failure])]), None) is failure
    both = ExceptionGroup("tg", [Boom(), RuntimeError()])
    assert unwrap(both, None) is both
    assert unwrap(both, both.exceptions[0]) is both
