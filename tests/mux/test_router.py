"""The routing table alone: no socket, no engine, no event loop."""

from __future__ import annotations

import pytest

from tserve.mux import EngineDeadError, MuxClosedError, MuxError, RequestState
from tserve.mux._router import Router
from tserve.protocol import AddRequest, FinishReason, RequestOutput, SamplingParams


def _router() -> tuple[Router, list[int]]:
    wakeups: list[int] = []
    return Router(lambda: wakeups.append(1)), wakeups


def _add(request_id: str, max_tokens: int = 4, **params: object) -> AddRequest:
    return AddRequest(request_id, [1], SamplingParams(max_tokens=max_tokens, **params))  # type: ignore[arg-type]


def test_adds_and_aborts_go_out_in_one_input_and_wake_the_sender() -> None:
    router, wakeups = _router()
    router.open("a", 4)
    router.open("b", 4)
    router.submit(_add("a"))
    router.submit(_add("b"))
    router.abort("a")
    assert router.has_inputs and len(wakeups) == 3
    inputs = router.take_inputs()
    assert inputs is not None
    assert [add.request_id for add in inputs.adds] == ["a", "b"]
    assert inputs.aborts == ["a"]
    assert router.take_inputs() is None and not router.has_inputs


def test_outputs_reach_their_mailbox_and_a_final_one_removes_the_id() -> None:
    router, _ = _router()
    mailbox = router.open("a", 4)
    router.submit(_add("a"))
    final = RequestOutput("a", [6], FinishReason.STOP)
    unknown = router.route([RequestOutput("a", [5]), RequestOutput("z", [1]), final])
    assert unknown == 1
    assert "a" not in router and len(router) == 0
    assert mailbox.state is RequestState.FINISHED
    router.take_inputs()
    router.abort("a")  # finished: no abort is ever sent for it
    mailbox.close()
    assert router.take_inputs() is None


def test_aborting_an_unsubmitted_request_ends_it_at_once_and_sends_nothing() -> None:
    router, wakeups = _router()
    mailbox = router.open("a", 4)
    router.abort("a")
    assert "a" not in router and not router.has_inputs and not wakeups
    assert mailbox.state is RequestState.ENDED


def test_abort_is_idempotent_and_close_aborts_only_what_runs() -> None:
    router, _ = _router()
    running = router.open("run", 4)
    router.submit(_add("run"))
    router.take_inputs()
    router.abort("run")
    router.abort("run")
    running.close()
    router.close(running)
    router.abort("unknown")
    router.close(router.open("never", 4))  # not submitted: nothing to abort
    inputs = router.take_inputs()
    assert inputs is not None and inputs.aborts == ["run"]
    assert len(router) == 0


def test_an_abort_that_crosses_the_last_output_is_withdrawn_before_it_is_sent() -> None:
    router, _ = _router()
    mailbox = router.open("a", 4)
    router.open("b", 4)
    for rid in ("a", "b"):
        router.submit(_add(rid))
    router.take_inputs()
    router.abort("a")
    router.abort("b")
    router.route([RequestOutput("a", [5], FinishReason.STOP)])  # a's end, before the abort left
    assert mailbox.state is RequestState.FINISHED
    inputs = router.take_inputs()
    assert inputs is not None and inputs.aborts == ["b"]


def test_submission_only_moves_forward() -> None:
    router, _ = _router()
    router.open("a", 4)
    with pytest.raises(MuxError):
        router.open("a", 4)
    with pytest.raises(MuxError):
        router.submit(_add("a", max_tokens=5))  # more than its mailbox holds
    router.submit(_add("a"))
    with pytest.raises(MuxError):
        router.submit(_add("a"))
    with pytest.raises(MuxError):
        router.submit(_add("nobody"))


def test_a_request_that_cannot_cross_the_wire_ends_alone_with_an_error() -> None:
    router, wakeups = _router()
    mailbox = router.open("big", 4)
    router.submit(_add("big", seed=2**64))
    assert "big" not in router and not router.has_inputs and not wakeups
    assert mailbox.state is RequestState.ENDED


@pytest.mark.anyio
async def test_engine_death_fails_all_and_drops_the_inbox() -> None:
    router, _ = _router()
    mailboxes = [router.open(str(i), 4) for i in range(3)]
    for i in range(2):
        router.submit(_add(str(i)))
    router.fail_all(EngineDeadError("gone"), engine_dead=True)
    assert len(router) == 0 and not router.has_inputs
    for mailbox in mailboxes:
        with pytest.raises(EngineDeadError):
            await mailbox.get()


@pytest.mark.anyio
async def test_a_stopping_mux_fails_all_and_aborts_what_the_engine_runs() -> None:
    router, _ = _router()
    mailboxes = [router.open(str(i), 4) for i in range(3)]
    router.submit(_add("0"))
    router.submit(_add("1"))
    router.take_inputs()
    router.abort("1")  # already aborting: not aborted twice
    router.take_inputs()
    router.fail_all(MuxClosedError("stopped"), engine_dead=False)
    inputs = router.take_inputs()
    assert inputs is not None and inputs.aborts == ["0"] and not inputs.adds
    for mailbox in mailboxes:
        with pytest.raises(MuxClosedError):
            await mailbox.get()
