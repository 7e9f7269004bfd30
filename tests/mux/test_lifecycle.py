"""The request lifecycle alone, and driven through the real router: no socket, no engine.

The hypothesis test plays random events on a few requests (the caller's
submit, abort and close; the engine's outputs, which follow its rules: only
for requests it was sent, nothing after a final one; the mux's failure) and
checks the lifecycle's rules after every event.
"""

from __future__ import annotations

import dataclasses

import anyio
import pytest
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from tserve.mux import (
    EngineDeadError,
    IllegalTransition,
    Lifecycle,
    Mailbox,
    MuxClosedError,
    RequestState,
)
from tserve.mux._router import Router
from tserve.protocol import AddRequest, FinishReason, RequestOutput, SamplingParams

S = RequestState


def _out(tokens: int = 1, finish: FinishReason | None = None) -> RequestOutput:
    return RequestOutput("r", list(range(tokens)), finish)


def _state(life: Lifecycle | Mailbox) -> RequestState:
    """The state now (a call, so that the type checker does not narrow it across moves)."""
    return life.state


def _submitted(max_tokens: int = 10) -> Lifecycle:
    life = Lifecycle(max_tokens)
    assert life.submit().send
    assert _state(life) is S.SUBMITTED
    return life


def test_the_happy_path_delivers_everything_and_aborts_nothing() -> None:
    life = _submitted()
    assert life.output(_out(0)).deliver and _state(life) is S.SUBMITTED
    first = life.output(_out(2))
    assert first.deliver and not first.forget and _state(life) is S.STREAMING
    last = life.output(_out(1, FinishReason.LENGTH))
    assert last.deliver and last.forget and _state(life) is S.FINISHED
    assert life.close() == life.abort() == life.fail(engine_alive=True)
    assert not life.close().abort, "a finished request is never aborted, read or not"
    assert _state(life) is S.FINISHED


@pytest.mark.parametrize("streaming", [False, True])
def test_close_while_the_engine_runs_aborts_once(streaming: bool) -> None:
    life = _submitted()
    if streaming:
        life.output(_out())
    actions = life.close()
    assert actions.abort and actions.forget and _state(life) is S.ABORTED
    assert not life.close().abort and not life.abort().abort


def test_abort_keeps_reading_until_the_last_output_and_close_adds_no_abort() -> None:
    life = _submitted()
    assert life.abort().abort and _state(life) is S.ABORTING
    assert not life.abort().abort
    assert life.output(_out(1)).deliver, "outputs that crossed the abort still arrive"
    last = life.output(_out(0, FinishReason.ABORT))
    assert last.deliver and last.forget and _state(life) is S.FINISHED
    again = _submitted()
    again.abort()
    closed = again.close()
    assert closed.forget and not closed.abort and _state(again) is S.ABORTED


def test_a_request_never_sent_ends_here_and_is_never_aborted() -> None:
    closed = Lifecycle(4)
    actions = closed.close()
    assert actions.forget and not actions.abort and _state(closed) is S.CLOSED
    aborted = Lifecycle(4)
    actions = aborted.abort()
    assert actions.end and actions.forget and not actions.abort and _state(aborted) is S.ENDED
    rejected = Lifecycle(4)
    assert rejected.reject().end and _state(rejected) is S.ENDED
    for life in (closed, aborted, rejected):
        with pytest.raises(IllegalTransition):
            life.submit()


def test_an_engine_error_fails_the_request_alone_without_an_abort() -> None:
    life = _submitted()
    actions = life.output(_out(0, FinishReason.ERROR))
    assert actions.deliver and actions.forget and _state(life) is S.FAILED
    assert not life.close().abort


@pytest.mark.parametrize("alive", [False, True])
def test_failure_ends_a_live_request_and_aborts_it_only_if_the_engine_lives(alive: bool) -> None:
    for life in (Lifecycle(4), _submitted()):
        may_run = _state(life) is S.SUBMITTED
        actions = life.fail(engine_alive=alive)
        assert actions.fail and actions.forget and actions.abort == (alive and may_run)
        assert _state(life) is S.FAILED
        assert life.close() == life.fail(engine_alive=alive) == life.abort()
        assert not life.close().fail


def test_more_tokens_than_max_tokens_fail_the_request_and_are_not_delivered() -> None:
    life = _submitted(max_tokens=3)
    assert life.output(_out(2)).deliver
    actions = life.output(_out(2))
    assert not actions.deliver and actions.fail and actions.abort and actions.forget
    assert _state(life) is S.FAILED


def test_outputs_for_a_request_the_engine_was_not_sent_are_dropped() -> None:
    for life in (Lifecycle(4), _submitted()):
        life.close()
        assert not life.output(_out(1)).deliver


def test_only_admitted_requests_are_submitted() -> None:
    life = _submitted()
    with pytest.raises(IllegalTransition):
        life.submit()
    with pytest.raises(IllegalTransition):
        life.reject()


# -- the rules, under random events through the real router ----------------------------

IDS = ("a", "b", "c")
MAX_TOKENS = 6


@dataclasses.dataclass
class Model:
    """What the test knows happened to one request, to check the router against."""

    opened: bool = False
    added: bool = False  # its add was queued
    sent: bool = False  # its add was taken: the engine may answer
    final_routed: bool = False  # the engine's final output was routed while it was open
    aborts: int = 0
    abort_after_final: bool = False
    sent_tokens: int = 0  # by the engine
    routed: list[int] = dataclasses.field(default_factory=list)  # token ids that were delivered


EVENTS = st.lists(
    st.tuples(
        st.sampled_from(
            ["open", "submit", "token", "final", "abort", "close", "dead", "stopped", "take"]
        ),
        st.sampled_from(IDS),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(EVENTS)
def test_random_events_keep_every_rule(events: list[tuple[str, str]]) -> None:
    router = Router(lambda: None)
    models = {rid: Model() for rid in IDS}
    mailboxes: dict[str, Mailbox] = {}
    failed = False

    def take() -> None:
        inputs = router.take_inputs()
        if inputs is None:
            return
        for add in inputs.adds:
            assert models[add.request_id].added
            models[add.request_id].sent = True
        for rid in inputs.aborts:
            model = models[rid]
            assert model.added, "an abort only for a request the engine was sent"
            model.aborts += 1
            model.abort_after_final |= model.final_routed

    for event, rid in events:
        model = models[rid]
        if failed:
            break
        if event == "open" and not model.opened:
            mailboxes[rid] = router.open(rid, MAX_TOKENS)
            model.opened = True
        elif event == "submit" and model.opened and mailboxes[rid].state is S.ADMITTED:
            router.submit(AddRequest(rid, [1], SamplingParams(max_tokens=MAX_TOKENS)))
            model.added = True
        elif event in ("token", "final") and model.sent and not model.final_routed:
            # The engine's rules: outputs only for what it was sent, at most
            # max_tokens of them, nothing after the final one.
            final = event == "final" or model.sent_tokens == MAX_TOKENS
            tokens = [] if final else [model.sent_tokens]
            model.sent_tokens += len(tokens)
            in_table = rid in router
            router.route([RequestOutput(rid, tokens, FinishReason.LENGTH if final else None)])
            if in_table:
                model.routed += tokens
                model.final_routed = final
        elif event == "abort":
            router.abort(rid)
        elif event == "close" and model.opened:
            mailboxes[rid].close()
        elif event in ("dead", "stopped"):
            dead = event == "dead"
            error = EngineDeadError("gone") if dead else MuxClosedError("stopped")
            router.fail_all(error, engine_dead=dead)
            failed = True
        elif event == "take":
            take()
        for other, mailbox in mailboxes.items():
            state = mailbox.state
            assert (other in router) == (not state.terminal), (other, state)
    take()

    for rid, model in models.items():
        assert model.aborts <= 1, "abort exactly once"
        assert not model.abort_after_final, "a finished request is never aborted"
        if rid in mailboxes:
            _check_mailbox(mailboxes[rid], model)


def _check_mailbox(mailbox: Mailbox, model: Model) -> None:
    """What the reader gets: every token routed while it was open, in order, then
    its ending: the final output, or the failure, or nothing more after a close."""
    received: list[int] = []

    async def read() -> None:
        with anyio.move_on_after(1):  # a mailbox with nothing to hand out parks
            while not mailbox.finished:
                received.extend((await mailbox.get()).token_ids)

    clock = trio.testing.MockClock(autojump_threshold=0)  # the 1 s passes at once
    try:
        anyio.run(read, backend="trio", backend_options={"clock": clock})
    except (EngineDeadError, MuxClosedError):
        assert mailbox.state is S.FAILED
    assert received == model.routed[: len(received)]
    if mailbox.state is S.FINISHED:
        assert mailbox.finished and received == model.routed
