"""One engine's death is another's, in the same tick (``tserve/nursery/_watch.py``: ``dying_with``).

Two fake engine processes (tests/mux/fake_engine.py) stand for an embedding
engine and the generation engine that serves with it, each behind a real
mux in a real engine session. No model and no torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from tests.guards import HANG_GUARD
from tests.mux.fake_engine import run_fake_engine
from tserve.mux import EngineDeadError, Mailbox
from tserve.nursery._engine_process import EngineRef
from tserve.nursery._session import EngineSession, engine_session
from tserve.protocol import AddRequest, SamplingParams

pytestmark = pytest.mark.anyio

STREAMS = 10


def _session(
    address: str, pid: int, depends_on: EngineSession | None = None
) -> contextlib.AbstractAsyncContextManager[EngineSession]:
    return engine_session(
        EngineRef(address, pid),
        owned=False,
        what=address,
        startup_timeout=30.0,
        heartbeat_timeout=30.0,
        depends_on=depends_on,
    )


@contextlib.contextmanager
def _engines(
    ipc_address: str, **gen_options: Any
) -> Iterator[tuple[str, subprocess.Popen[bytes], subprocess.Popen[bytes]]]:
    """Two fake engines for the block, within the hang guard: the "embedding" one
    (its address and process) and the generation one at ``ipc_address`` (its
    process; ``gen_options`` are :func:`run_fake_engine`'s)."""
    embed_address = ipc_address.replace("engine.sock", "embed.sock")
    with (
        run_fake_engine(embed_address) as embed_process,
        run_fake_engine(ipc_address, **gen_options) as gen_process,
        anyio.fail_after(HANG_GUARD),
    ):
        yield embed_address, embed_process, gen_process


def _stream(session: EngineSession, request_id: str) -> Mailbox:
    mailbox = session.mux.open_mailbox(request_id, 10**9)
    session.mux.submit(AddRequest(request_id, [0], SamplingParams(max_tokens=10**9)))
    return mailbox


async def test_a_killed_dependency_fails_every_live_stream_in_the_same_tick(
    ipc_address: str,
) -> None:
    """kill -9 of the "embedding" engine: when its mux declares it dead, the
    generation mux is already dead too (its listener ran first, in the same
    call), every live generation stream fails with EngineDeadError naming the
    embedding engine, and the generation engine, asked to shut down, exits 0."""
    with _engines(ipc_address, tokens_per_step=1, step_delay=0.01) as (
        embed_address,
        embed_process,
        gen_process,
    ):
        async with (
            _session(embed_address, embed_process.pid) as embed,
            _session(ipc_address, gen_process.pid, depends_on=embed) as gen,
        ):
            mailboxes = [_stream(gen, f"r{i}") for i in range(STREAMS)]
            for mailbox in mailboxes:
                await mailbox.get()  # every stream is live
            seen_at_death: list[tuple[str, bool]] = []
            embed.mux.death_listeners.append(
                lambda reason: seen_at_death.append((reason, gen.mux.dead))
            )
            os.kill(embed_process.pid, signal.SIGKILL)
            errors: list[str] = []
            for mailbox in mailboxes:
                with pytest.raises(EngineDeadError) as caught:
                    while True:
                        await mailbox.get()
                errors.append(str(caught.value))
        [(reason, generation_dead)] = seen_at_death
        assert generation_dead
        assert errors == [f"embedding engine: {reason}"] * STREAMS
        assert gen.mux.dead_reason == f"embedding engine: {reason}"
        assert await anyio.to_thread.run_sync(gen_process.wait) == 0  # it got Shutdown


async def test_a_dependency_dead_before_the_start_fails_the_start(ipc_address: str) -> None:
    """An embedding engine already dead when the generation session starts:
    the start fails with EngineDeadError naming it, and nothing is left
    listening to the dead mux."""
    with _engines(ipc_address) as (embed_address, embed_process, gen_process):
        async with _session(embed_address, embed_process.pid) as embed:
            embed.mux.engine_died("it broke")
            with pytest.raises(EngineDeadError, match=r"^embedding engine: it broke$"):
                async with _session(ipc_address, gen_process.pid, depends_on=embed):
                    pytest.fail("the session started over a dead dependency")
            assert embed.mux.death_listeners == []


async def test_a_dependency_that_dies_after_the_session_changes_nothing(
    ipc_address: str,
) -> None:
    """The generation session ended first (normally): the embedding engine's
    later death does not touch its mux, and no listener is left behind."""
    with _engines(ipc_address) as (embed_address, embed_process, gen_process):
        async with _session(embed_address, embed_process.pid) as embed:
            async with _session(ipc_address, gen_process.pid, depends_on=embed) as gen:
                assert len(embed.mux.death_listeners) == 1
            assert embed.mux.death_listeners == []
            embed.mux.engine_died("it broke later")
            assert gen.mux.dead_reason is None
