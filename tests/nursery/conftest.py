"""Fixtures and probes for the lifecycle tests: a real engine process, the tiny model.

An engine takes seconds to start (it imports torch), so each test module
shares one ``open_llm`` per backend (module-scoped ``anyio_backend``), and
tests that end the engine run last in their module or start their own.
"""

from __future__ import annotations

import collections
import os
import resource
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest

import tserve.mux._mux as mux_module
from tests.guards import HANG_GUARD
from tests.mux.conftest import ipc_address as ipc_address  # the fake engine tests' fixture
from tserve import protocol
from tserve.mux import Mux
from tserve.nursery import LLM
from tserve.protocol import EngineInput, FinishReason, Message, StepOutputs

# Engine options for tests: quiet, one thread, and a heartbeat fast enough
# that "the engine reports X" settles quickly when idle.
ENGINE: dict[str, Any] = {"log_level": "WARNING", "threads": 1, "heartbeat_interval": 0.1}


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="session", autouse=True)
def _raise_nofile_limit() -> None:
    """As the API process does at start: soft RLIMIT_NOFILE up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


async def eventually(predicate: Callable[[], bool], what: str) -> None:
    """Poll until ``predicate()``; a hang guard, not a timing assertion."""
    with anyio.move_on_after(HANG_GUARD):
        while not predicate():  # noqa: ASYNC110 (what it waits for has no event)
            await anyio.sleep(0.01)
        return
    raise AssertionError(f"never happened: {what}")


@dataclass
class Wire:
    """What crossed the socket, seen from inside the mux.

    ``aborts``: every id in an EngineInput's aborts, in order. ``finals``: the
    finish reason of every request's final output, and ``late``: the ids
    whose final arrived after the request had been closed on our side.
    """

    adds: int = 0
    aborts: list[str] = field(default_factory=list)
    finals: dict[str, FinishReason] = field(default_factory=dict)
    late: set[str] = field(default_factory=set)

    def abort_counts(self) -> collections.Counter[str]:
        return collections.Counter(self.aborts)


@pytest.fixture
def wire(monkeypatch: pytest.MonkeyPatch) -> Iterator[Wire]:
    """Record the mux's traffic (probes, not fakes: the real frames still go out)."""
    seen = Wire()
    encode = protocol.encode
    route = Mux._route

    def spy_encode(message: Message) -> bytearray:
        if isinstance(message, EngineInput):
            seen.adds += len(message.adds)
            seen.aborts += message.aborts
        return encode(message)

    def spy_route(self: Mux, step: StepOutputs) -> None:
        for output in step.outputs:
            if output.finish_reason is not None:
                assert output.request_id not in seen.finals, "two finals for one request"
                seen.finals[output.request_id] = output.finish_reason
                if output.request_id not in self._router:
                    seen.late.add(output.request_id)
        route(self, step)

    monkeypatch.setattr(mux_module, "encode", spy_encode)
    monkeypatch.setattr(Mux, "_route", spy_route)
    yield seen


async def settled(llm: LLM) -> None:
    """Wait until the engine is idle with its whole KV budget free and has
    reported every abort this process sent, and until the grammar worker
    that opening the LLM started (its pipes are fds of this process) is ready."""
    mux = llm._mux
    prepared = llm.constraints.prepared
    if prepared is not None:
        with anyio.fail_after(HANG_GUARD):
            await anyio.to_thread.run_sync(prepared.result)

    def idle() -> bool:
        engine = mux.engine_stats
        return (
            engine.running == 0
            and engine.waiting == 0
            and engine.kv_tokens_used == 0
            and engine.aborts_received == mux.stats.aborts_sent
            and mux.open_mailboxes == 0
        )

    await eventually(idle, "the engine settles")
    assert llm.stats.live_requests == 0
