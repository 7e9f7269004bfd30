"""The mailbox alone: merging, its bound, endings, and cancelled reads."""

from __future__ import annotations

import random

import anyio
import pytest

from tserve.mux import EngineDeadError, Mailbox, MuxError
from tserve.mux._router import Router
from tserve.protocol import AddRequest, FinishReason, RequestOutput, SamplingParams, TokenLogprob

pytestmark = pytest.mark.anyio


def _mailbox(max_tokens: int = 100) -> tuple[Mailbox, list[Mailbox]]:
    closed: list[Mailbox] = []
    return Mailbox("r", max_tokens, closed.append), closed


async def test_a_slow_reader_gets_deltas_merged() -> None:
    mailbox, _ = _mailbox()
    two = [TokenLogprob(1, -0.1), TokenLogprob(2, -0.2)]
    mailbox.put(RequestOutput("r", [1, 2], logprobs=two))
    mailbox.put(RequestOutput("r", [3], logprobs=[TokenLogprob(3, -0.3)]))
    mailbox.put(RequestOutput("r", [], FinishReason.STOP, logprobs=[]))
    output = await mailbox.get()
    assert output.token_ids == [1, 2, 3]
    assert output.logprobs is not None
    assert [lp.token_id for lp in output.logprobs] == [1, 2, 3]
    assert output.finish_reason is FinishReason.STOP
    assert mailbox.finished
    with pytest.raises(anyio.EndOfStream):
        await mailbox.get()


async def test_iteration_ends_after_the_final_output_and_keeps_the_error() -> None:
    mailbox, _ = _mailbox()
    mailbox.put(RequestOutput("r", [7]))
    mailbox.put(RequestOutput("r", [], FinishReason.ERROR, error="boom"))
    outputs = [output async for output in mailbox]
    assert len(outputs) == 1
    assert outputs[0].token_ids == [7]
    assert outputs[0].error == "boom"


async def test_more_tokens_than_max_tokens_fail_instead_of_growing() -> None:
    router = Router(lambda: None)
    mailbox = router.open("r", 3)
    router.submit(AddRequest("r", [0], SamplingParams(max_tokens=3)))
    router.route([RequestOutput("r", [1, 2]), RequestOutput("r", [3, 4])])
    router.route([RequestOutput("r", [5])])
    assert "r" not in router
    assert (await mailbox.get()).token_ids == [1, 2]
    with pytest.raises(MuxError, match="more than 3 tokens"):
        await mailbox.get()


async def test_a_failure_comes_after_what_was_already_received() -> None:
    mailbox, _ = _mailbox()
    mailbox.put(RequestOutput("r", [1]))
    mailbox.fail(EngineDeadError("gone"))
    assert (await mailbox.get()).token_ids == [1]
    with pytest.raises(EngineDeadError, match="gone"):
        await mailbox.get()


async def test_a_waiting_reader_is_woken_by_a_failure() -> None:
    mailbox, _ = _mailbox()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_fail_soon, mailbox)
            with pytest.raises(EngineDeadError):
                await mailbox.get()


async def _fail_soon(mailbox: Mailbox) -> None:
    await anyio.sleep(0.01)
    mailbox.fail(EngineDeadError("gone"))


async def test_close_is_idempotent_and_sync() -> None:
    mailbox, closed = _mailbox()
    with mailbox:
        pass
    mailbox.close()
    assert closed == [mailbox, mailbox]  # the mux's hook tolerates repeats


@pytest.mark.parametrize("seed", range(3))
async def test_reads_cancelled_at_random_points_lose_and_repeat_nothing(seed: int) -> None:
    rng = random.Random(seed)
    total = 20_000
    mailbox, _ = _mailbox(max_tokens=total)
    received: list[int] = []
    cancelled = 0

    async def produce() -> None:
        token = 0
        while token < total:
            count = min(rng.randint(1, 5), total - token)
            finish = FinishReason.LENGTH if token + count == total else None
            mailbox.put(RequestOutput("r", list(range(token, token + count)), finish))
            token += count
            if rng.random() < 0.3:
                await anyio.lowlevel.checkpoint()

    async def consume() -> None:
        nonlocal cancelled
        while not mailbox.finished:
            # cancelled before it starts, or after a random short wait, or not
            with anyio.move_on_after(rng.choice([0.0, rng.random() * 1e-4, 10.0])) as scope:
                received.extend((await mailbox.get()).token_ids)
            cancelled += scope.cancelled_caught

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            tg.start_soon(produce)
    assert received == list(range(total))
    assert cancelled > 0
