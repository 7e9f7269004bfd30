"""The in-flight registry the shutdown drain uses: count, wait_idle, abort_all. No HTTP."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from tserve.nursery import ShuttingDown
from tserve.web._inflight import InFlight


def test_abortable_work_counts_while_it_runs_and_returns_its_value() -> None:
    async def main() -> None:
        live = InFlight()
        release = trio.Event()
        seen: list[int] = []

        async def work() -> str:
            seen.append(live.count)
            await release.wait()
            return "done"

        async with trio.open_nursery() as nursery:
            results: list[str] = []

            async def run() -> None:
                results.append(await live.abortable(work))

            nursery.start_soon(run)
            await trio.testing.wait_all_tasks_blocked()
            assert live.count == 1
            release.set()
        assert (seen, results, live.count) == ([1], ["done"], 0)

    trio.run(main)


def test_wait_idle_returns_once_the_last_work_ends() -> None:
    async def main() -> None:
        live = InFlight()
        release = trio.Event()
        idle: list[bool] = []

        async def wait() -> None:
            await live.wait_idle()
            idle.append(True)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(live.abortable, release.wait)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            assert idle == []
            release.set()
        assert idle == [True]
        await live.wait_idle()  # nothing in flight: returns at once

    trio.run(main)


def test_abort_all_ends_live_work_with_its_reason_and_refuses_later_work() -> None:
    async def main() -> None:
        live = InFlight()
        reason = ShuttingDown("the server shut down before this request finished")
        errors: list[BaseException] = []

        async def run() -> None:
            with pytest.raises(ShuttingDown) as caught:
                await live.abortable(trio.sleep_forever)
            errors.append(caught.value)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            nursery.start_soon(run)
            await trio.testing.wait_all_tasks_blocked()
            assert live.count == 2
            live.abort_all(reason)
        assert errors == [reason, reason] and live.count == 0
        assert live.aborting is reason
        await run()  # later work ends at its first checkpoint, with the same reason
        assert errors[-1] is reason

    trio.run(main)
