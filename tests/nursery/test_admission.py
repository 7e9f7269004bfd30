"""Admission without an engine: slots, the FIFO queue, both overload modes, cancels."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from tests.guards import HANG_GUARD
from tserve.nursery import Overloaded
from tserve.nursery._admission import Admission, Overload

pytestmark = pytest.mark.anyio


async def _settle() -> None:
    for _ in range(10):
        await anyio.lowlevel.checkpoint()


def test_fail_fast_refuses_exactly_the_excess() -> None:
    admission = Admission(3, Overload.RAISE)
    assert [admission.enter() for _ in range(3)] == [True] * 3
    for _ in range(5):
        with pytest.raises(Overloaded, match="3 requests are already in flight"):
            admission.enter()
    assert (admission.running, admission.queued, admission.saturated) == (3, 0, True)
    admission.leave(held=True)
    assert admission.enter() is True


def test_raise_mode_queues_up_to_max_queued() -> None:
    admission = Admission(2, Overload.RAISE, max_queued=3)
    held = [admission.enter() for _ in range(5)]
    assert held == [True, True, False, False, False]
    with pytest.raises(Overloaded, match="2 requests are running and 3 are queued"):
        admission.enter()
    assert admission.saturated and admission.peak_queued == 3
    admission.leave(held=False)
    assert not admission.saturated


def test_wait_mode_never_refuses() -> None:
    admission = Admission(1)
    assert [admission.enter() for _ in range(1000)] == [True] + [False] * 999
    assert admission.live == 1000 and not admission.saturated


async def test_slots_go_to_waiters_in_arrival_order() -> None:
    admission = Admission(1)
    assert admission.enter()
    order: list[int] = []

    async def one(i: int) -> None:
        assert not admission.enter()
        await admission.wait(tokens=10)
        order.append(i)
        admission.leave(held=True)

    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            for i in range(20):
                tg.start_soon(one, i)
                await _settle()  # each waits before the next arrives
            assert admission.queued_tokens == 200
            assert admission.enter() is False  # no barging past the waiters
            admission.leave(held=False)
            admission.leave(held=True)
    assert order == list(range(20))
    assert (admission.running, admission.queued, admission.queued_tokens) == (0, 0, 0)


async def test_cancelling_a_waiter_gives_back_only_its_ticket() -> None:
    admission = Admission(2)
    assert admission.enter() and admission.enter()
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:

            async def waiter() -> None:
                held = admission.enter()
                try:
                    await admission.wait()
                    held = True
                finally:
                    admission.leave(held=held)

            for _ in range(100):
                tg.start_soon(waiter)
            await _settle()
            assert (admission.running, admission.queued) == (2, 100)
            tg.cancel_scope.cancel()
    # The two slots it never took are still held by their owners; nothing else.
    assert (admission.running, admission.queued, admission.queued_tokens) == (2, 0, 0)
    admission.leave(held=True)
    admission.leave(held=True)
    assert admission.enter() is True  # the gone waiters block nobody


async def test_a_waiter_cancelled_after_the_hand_off_passes_its_slot_on() -> None:
    admission = Admission(1)
    assert admission.enter()
    first_done, second_done = anyio.Event(), anyio.Event()

    async def first() -> None:
        assert not admission.enter()
        with anyio.CancelScope() as scope:
            admission.leave(held=True)  # the slot is handed to us, not yet resumed
            scope.cancel()
            await admission.wait()
        admission.leave(held=False)  # still a ticket: the slot went on
        first_done.set()

    async def second() -> None:
        assert not admission.enter()
        await admission.wait()
        admission.leave(held=True)
        second_done.set()

    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            tg.start_soon(second)
            await _settle()
            tg.start_soon(first)
            await first_done.wait()
            await second_done.wait()
    assert (admission.running, admission.queued) == (0, 0)


async def test_raise_mode_bounds_the_queued_prompt_tokens() -> None:
    admission = Admission(1, Overload.RAISE, max_queued=10, max_queued_tokens=100)
    assert admission.enter()
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:

            async def waiter(tokens: int) -> None:
                held = admission.enter()
                try:
                    await admission.wait(tokens=tokens)
                    held = True
                finally:
                    admission.leave(held=held)

            tg.start_soon(waiter, 60)
            await _settle()
            assert not admission.enter()  # 60 tokens queued: room for more
            with pytest.raises(Overloaded):
                await admission.wait(tokens=50)  # but not for 50
            admission.leave(held=False)
            tg.start_soon(waiter, 40)
            await _settle()
            assert admission.queued_tokens == 100 and admission.saturated
            with pytest.raises(Overloaded):
                admission.enter()  # the budget is spent: refused at once
            admission.leave(held=True)
    assert (admission.running, admission.queued, admission.queued_tokens) == (0, 0, 0)
