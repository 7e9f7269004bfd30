"""The output mapping, without an engine (sans-IO); state moves: tests/mux/test_lifecycle.py.

Token id ``i`` decodes to ``chr(i)``, so tests read as text.
"""

from __future__ import annotations

import msgspec
import pytest

from tserve.mux import EngineDeadError, MuxClosedError
from tserve.nursery import InvalidRequest, RequestFailed, RequestTimeout, ShuttingDown
from tserve.nursery._output import Decision, OutputMapper, finish_error, mux_error
from tserve.nursery._results import Usage
from tserve.protocol import FinishReason, RequestOutput


def _decode(token_ids: list[int]) -> str:
    return "".join(map(chr, token_ids))


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def _out(text: str, finish: FinishReason | None = None, error: str | None = None) -> RequestOutput:
    return RequestOutput("r", _ids(text), finish, None, error)


def _mapper(*stop: str, deadline: bool = False, prompt_tokens: int = 3) -> OutputMapper:
    mapper = OutputMapper(_decode, stop, has_deadline=deadline, request_id="r")
    mapper.submitted(prompt_tokens)
    return mapper


def test_tokens_stream_then_length_finishes_with_usage() -> None:
    mapper = _mapper()
    outcome = mapper.push(_out("hi"))
    assert outcome.decision is Decision.DELTA and not outcome.over
    assert outcome.delta is not None and outcome.delta.text == "hi"
    assert outcome.delta.finish_reason is None and outcome.delta.usage is None
    final = mapper.push(_out("!", FinishReason.LENGTH))
    assert final.decision is Decision.FINISHED and final.over
    assert final.delta is not None and final.delta.text == "!"
    assert final.delta.finish_reason == "length"
    assert final.delta.usage == Usage(3, 3)


@pytest.mark.parametrize(
    ("finish", "reason"), [(FinishReason.STOP, "stop"), (FinishReason.ABORT, "abort")]
)
def test_the_engines_own_endings_without_a_deadline(finish: FinishReason, reason: str) -> None:
    mapper = _mapper()
    outcome = mapper.push(_out("ok", finish))
    assert outcome.decision is Decision.FINISHED
    assert outcome.delta is not None and outcome.delta.finish_reason == reason
    assert outcome.delta.text == "ok"


def test_an_engine_error_fails_the_request_alone() -> None:
    mapper = _mapper()
    mapper.push(_out("a"))
    outcome = mapper.push(_out("", FinishReason.ERROR, "sampler broke"))
    assert outcome.decision is Decision.FAILED and outcome.over
    assert isinstance(outcome.error, RequestFailed) and str(outcome.error) == "sampler broke"
    assert outcome.delta is None
    unnamed = _mapper().push(_out("", FinishReason.ERROR))
    assert str(unnamed.error) == "the engine failed this request"


def test_a_grammar_error_names_the_constraint() -> None:
    """Before any token: the request is at fault (InvalidRequest, a 400); after
    tokens (earlier, or merged into the error's output): RequestFailed; both
    with the engine's param."""
    failed = RequestOutput(
        "r", [], FinishReason.ERROR, None, "accepts no string", None, "constraint"
    )
    early = _mapper().push(failed)
    assert early.decision is Decision.FAILED
    assert isinstance(early.error, InvalidRequest) and early.error.param == "constraint"
    mapper = _mapper()
    mapper.push(_out("{"))
    late = mapper.push(failed)
    assert isinstance(late.error, RequestFailed) and late.error.param == "constraint"
    merged = msgspec.structs.replace(failed, token_ids=_ids("{"))
    late = _mapper().push(merged)
    assert isinstance(late.error, RequestFailed) and late.error.param == "constraint"
    assert str(late.error) == "accepts no string"


def test_a_stop_string_while_the_engine_runs_ends_the_request() -> None:
    mapper = _mapper("lo")
    held = mapper.push(_out("hel"))  # "l" may start "lo": held back
    assert held.delta is not None and held.delta.text == "he"
    outcome = mapper.push(_out("lo w"))
    assert outcome.decision is Decision.STOPPED and outcome.over
    assert outcome.delta is not None and outcome.delta.text == "l"
    assert outcome.delta.finish_reason == "stop"
    assert outcome.delta.usage == Usage(3, 7)


def test_a_stop_string_in_the_final_output_is_a_plain_finish() -> None:
    mapper = _mapper("lo")
    outcome = mapper.push(_out("hello", FinishReason.LENGTH))
    assert outcome.decision is Decision.FINISHED
    assert outcome.delta is not None and outcome.delta.text == "hel"
    assert outcome.delta.finish_reason == "stop"


def test_held_text_is_flushed_at_the_finish() -> None:
    mapper = _mapper("lo")
    assert mapper.push(_out("al")).delta is not None  # "a", "l" held
    final = mapper.push(_out("", FinishReason.LENGTH))
    assert final.delta is not None and final.delta.text == "l"


def test_an_output_with_nothing_new_is_waited_past() -> None:
    mapper = _mapper()
    outcome = mapper.push(_out(""))
    assert outcome.decision is Decision.WAIT and not outcome.over and outcome.delta is None


def test_the_engines_deadline_first_is_a_timeout() -> None:
    """The engine's copy of the deadline expired before ours: its ABORT ending
    means a timeout, and the engine is done with the request."""
    mapper = _mapper(deadline=True)
    mapper.push(_out("a"))
    outcome = mapper.push(_out("", FinishReason.ABORT))
    assert outcome.decision is Decision.TIMED_OUT and outcome.over
    assert isinstance(outcome.error, RequestTimeout)
    assert str(outcome.error) == "request r passed its deadline"


def test_our_deadline_is_a_timeout_naming_the_request() -> None:
    error = _mapper(deadline=True).timed_out()
    assert isinstance(error, RequestTimeout) and str(error) == "request r passed its deadline"


def test_finish_error_and_mux_error_serve_the_embeddings_too() -> None:
    def error(finish: FinishReason, *, deadline: bool, text: str | None = None) -> object:
        output = RequestOutput("e", [], finish, None, text)
        return finish_error(output, has_deadline=deadline, failed="failed", timed_out="late")

    assert error(FinishReason.STOP, deadline=True) is None
    assert error(FinishReason.ABORT, deadline=False) is None
    late = error(FinishReason.ABORT, deadline=True)
    assert isinstance(late, RequestTimeout) and str(late) == "late"
    failed = error(FinishReason.ERROR, deadline=False)
    assert isinstance(failed, RequestFailed) and str(failed) == "failed"
    named = error(FinishReason.ERROR, deadline=True, text="oom")
    assert isinstance(named, RequestFailed) and str(named) == "oom"
    dead = EngineDeadError("gone")
    assert mux_error(dead, "closed") is dead
    closed = mux_error(MuxClosedError(), "closed")
    assert isinstance(closed, ShuttingDown) and str(closed) == "closed"
