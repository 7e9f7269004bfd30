"""Every way out of ``open_llm`` leaves no engine behind; a failed start is quick and clear."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.abc
import pytest

from tests.guards import HANG_GUARD
from tests.nursery.conftest import ENGINE, eventually
from tests.processes import process_gone
from tserve import LLM, EngineDeadError, SamplingParams, ShuttingDown, open_llm

pytestmark = pytest.mark.anyio

LONG = SamplingParams(max_tokens=480, ignore_eos=True)


class Boom(Exception):
    pass


def _streaming(llm: LLM, tg: anyio.abc.TaskGroup, count: int) -> Callable[[], bool]:
    """Start ``count`` long streams in ``tg``; return "have they all streamed?"."""
    streamed: set[int] = set()

    async def one(i: int) -> None:
        async for _ in llm.generate([3, 4, 5], LONG):
            streamed.add(i)

    for i in range(count):
        tg.start_soon(one, i)
    return lambda: len(streamed) == count


async def test_leaving_open_llm_in_any_way_stops_the_engine(tiny_model_dir: Path) -> None:
    """Two blocks, left concurrently while requests stream: by an exception
    from the body, and by cancellation from outside while a request that
    belongs to an outer task group still runs (it gets ShuttingDown). Each
    engine is gone by the time its ``async with`` has exited. Meanwhile a
    third fails to start, quickly and naming the reason."""
    pids: dict[str, int] = {}
    outcomes: dict[str, str] = {}

    async def by_exception() -> None:
        with pytest.raises(ExceptionGroup) as info:
            async with open_llm(tiny_model_dir, **ENGINE) as llm:
                pids["exception"] = llm.engine_pid
                async with anyio.create_task_group() as tg:
                    ready = _streaming(llm, tg, 10)
                    await eventually(ready, "streams start")
                    raise Boom
        # The body's own group, as it raised it: open_llm adds no wrapping.
        assert [type(e) for e in info.value.exceptions] == [Boom]
        assert process_gone(pids["exception"])
        outcomes["exception"] = "ok"

    async def by_cancellation() -> None:
        # A request that belongs to a task group outside the block outlives
        # it: it gets ShuttingDown when the block has been left.
        errors: list[BaseException] = []
        first = anyio.Event()

        async def outlives_the_block(llm: LLM) -> None:
            try:
                async for _ in llm.generate([6, 7], LONG):
                    first.set()
            except ShuttingDown as exc:
                errors.append(exc)

        async with anyio.create_task_group() as outside:
            with anyio.CancelScope() as scope:
                # The echo engine at 10 steps a second: the outer request needs
                # 48 s, so it still runs when the block is left.
                paced = open_llm(tiny_model_dir, engine_kind="echo", echo_step_time=0.1, **ENGINE)
                async with paced as llm:
                    pids["cancel"] = llm.engine_pid
                    outside.start_soon(outlives_the_block, llm)
                    async with anyio.create_task_group() as tg:
                        ready = _streaming(llm, tg, 10)
                        await eventually(ready, "streams start")
                        await first.wait()
                        scope.cancel()
                        await anyio.sleep_forever()
            assert scope.cancelled_caught
            assert process_gone(pids["cancel"])
        assert [type(e) for e in errors] == [ShuttingDown]
        with pytest.raises(ShuttingDown):
            llm.generate("after the block")
        assert not llm.engine_alive
        outcomes["cancel"] = "ok"

    async def with_a_bad_model_path() -> None:
        # The engine reports why it cannot start; open_llm raises that at
        # once, long before its startup_timeout (the hang guard is shorter).
        with pytest.raises(EngineDeadError) as info:
            async with open_llm(
                "/nonexistent/model",
                startup_timeout=10 * HANG_GUARD,
                **ENGINE,
            ):
                pass
        assert "failed to start" in str(info.value)
        assert "/nonexistent/model" in str(info.value)
        outcomes["bad path"] = "ok"

    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            tg.start_soon(by_exception)
            tg.start_soon(by_cancellation)
            tg.start_soon(with_a_bad_model_path)
    assert outcomes == dict.fromkeys(["exception", "cancel", "bad path"], "ok")


_CHILD = textwrap.dedent(
    """
    import os, signal, sys, anyio, tserve

    model, backend, how = sys.argv[1:]
    # As a terminal's Ctrl-C finds it, even when the suite runs as a background
    # job (whose children inherit SIGINT ignored, and Python then leaves it so).
    signal.signal(signal.SIGINT, signal.default_int_handler)

    async def main():
        async with tserve.open_llm(model, log_level="WARNING", threads=1) as llm:
            params = tserve.SamplingParams(max_tokens=480, ignore_eos=True)
            async with llm.generate([3, 4, 5], params) as stream:
                await stream.__anext__()
                print(llm.engine_pid, flush=True)
                if how == "raise":
                    raise KeyboardInterrupt
                await anyio.sleep_forever()  # the test sends SIGINT

    anyio.run(main, backend=backend)
    """
)


def test_keyboard_interrupt_leaves_no_engine(tiny_model_dir: Path) -> None:
    """In child processes, on both backends: KeyboardInterrupt raised inside
    the block, and a real SIGINT (Ctrl-C), with a request streaming. Each
    child exits by KeyboardInterrupt and its engine is gone when it has
    exited (not later, by noticing its parent is gone). All four at once,
    to save time."""
    ways = [(backend, how) for backend in ("asyncio", "trio") for how in ("raise", "sigint")]
    children = {
        way: subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(tiny_model_dir), *way],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
        for way in ways
    }
    pids = {}
    for way, child in children.items():
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.strip().isdigit(), child.communicate(timeout=HANG_GUARD)[1].decode()[-2000:]
        pids[way] = int(line)
    for way, child in children.items():
        if way[1] == "sigint":
            child.send_signal(signal.SIGINT)
    for way, child in children.items():
        _, err = child.communicate(timeout=HANG_GUARD)
        assert child.returncode != 0, way
        assert b"KeyboardInterrupt" in err, err.decode()[-2000:]
        assert process_gone(pids[way]), f"{way}: engine {pids[way]} outlived its API process"
