"""open_llm's exception unwrapping (``_session.unwrap``), without processes."""

from __future__ import annotations

from tserve.nursery._session import unwrap


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
