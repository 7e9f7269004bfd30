"""The multiplexer against a real fake-engine process over ipc://."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import zmq

from tests.guards import HANG_GUARD
from tests.mux.fake_engine import run_fake_engine
from tserve.mux import EngineDeadError, Mailbox, Mux, MuxClosedError, MuxError, open_mux
from tserve.protocol import AddRequest, FinishReason, SamplingParams

pytestmark = pytest.mark.anyio


def _add(request_id: str, first_token: int, max_tokens: int) -> AddRequest:
    return AddRequest(request_id, [first_token], SamplingParams(max_tokens=max_tokens))


def _open(mux: Mux, request_id: str, first_token: int, max_tokens: int) -> Mailbox:
    mailbox = mux.open_mailbox(request_id, max_tokens)
    mux.submit(_add(request_id, first_token, max_tokens))
    return mailbox


async def _read_all(mailbox: Mailbox) -> list[int]:
    tokens: list[int] = []
    async for output in mailbox:
        tokens += output.token_ids
    return tokens


async def _eventually(predicate: Callable[[], bool]) -> None:
    for _ in range(HANG_GUARD * 100):
        if predicate():
            return
        await anyio.sleep(0.01)
    raise AssertionError("condition never became true")


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


@asynccontextmanager
async def _engine_and_mux(
    address: str,
    *,
    heartbeat_timeout: float = 10.0,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
    **engine_options: float | int | bool,
) -> AsyncIterator[Mux]:
    with (
        run_fake_engine(address, **engine_options),  # type: ignore[arg-type]
        anyio.fail_after(HANG_GUARD),
    ):
        async with open_mux(
            address, heartbeat_timeout=heartbeat_timeout, ready_timeout=30, context=context
        ) as mux:
            yield mux


@pytest.mark.usefixtures("no_gc")
async def test_ten_thousand_requests_share_one_socket_and_constant_fds(
    ipc_address: str,
) -> None:
    """The seed failure: one socket per request ran out of sockets and fds at
    ~1,000 requests. Here 10,000 go through one DEALER in a context that
    allows only ONE zmq socket, and the fd count does not move."""
    requests, tokens = 10_000, 12
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    context.set(zmq.MAX_SOCKETS, 1)
    try:
        async with _engine_and_mux(ipc_address, context=context, tokens_per_step=3) as mux:
            one = _open(mux, "one", 0, tokens)
            first = await one.get()
            fds_with_one = _fd_count()
            assert first.token_ids + await _read_all(one) == list(range(tokens))

            results: dict[int, list[int]] = {}
            fds_in_flight: list[int] = []
            started = anyio.Event()

            async def request(i: int, mailbox: Mailbox) -> None:
                await started.wait()
                results[i] = await _read_all(mailbox)

            async with anyio.create_task_group() as tg:
                for i in range(requests):
                    tg.start_soon(request, i, _open(mux, f"r{i}", i * 100, tokens))
                assert mux.open_mailboxes == requests
                fds_in_flight.append(_fd_count())
                await _eventually(lambda: mux.stats.deltas_routed > tokens)  # mid-stream
                fds_in_flight.append(_fd_count())
                started.set()
    finally:
        context.term()
    assert all(results[i] == list(range(i * 100, i * 100 + tokens)) for i in range(requests))
    assert fds_in_flight == [fds_with_one, fds_with_one]
    assert mux.stats.unknown_deltas == 0
    assert mux.stats.adds_sent == requests + 1


async def test_a_slow_reader_stalls_no_one_and_gets_every_token_merged(
    ipc_address: str,
) -> None:
    others, tokens = 1000, 20
    async with _engine_and_mux(ipc_address, tokens_per_step=1) as mux:
        slow = _open(mux, "slow", 5000, tokens)
        results: dict[int, list[int]] = {}

        async def fast(i: int, mailbox: Mailbox) -> None:
            results[i] = await _read_all(mailbox)

        async with anyio.create_task_group() as tg:
            for i in range(others):
                tg.start_soon(fast, i, _open(mux, f"fast{i}", i * 100, tokens))
        # All others finished while "slow" was never read: had the mux waited
        # for its reader, this would hang.
        outputs = [output async for output in slow]
    assert all(results[i] == list(range(i * 100, i * 100 + tokens)) for i in range(others))
    assert len(outputs) == 1  # everything arrived merged into one output
    assert outputs[0].token_ids == list(range(5000, 5000 + tokens))
    assert outputs[0].finish_reason is FinishReason.LENGTH


async def _expect_death(mailboxes: list[Mailbox]) -> list[str]:
    reasons: list[str] = []

    async def read(mailbox: Mailbox) -> None:
        with pytest.raises(EngineDeadError) as info:
            await _read_all(mailbox)
        reasons.append(info.value.reason)

    async with anyio.create_task_group() as tg:
        for mailbox in mailboxes:
            tg.start_soon(read, mailbox)
    return reasons


async def test_engine_dead_message_fails_every_open_request(ipc_address: str) -> None:
    async with _engine_and_mux(ipc_address, die_after_steps=3, send_dead=True) as mux:
        mailboxes = [_open(mux, f"r{i}", 0, 10_000) for i in range(100)]
        reasons = await _expect_death(mailboxes)
        assert reasons == ["fake engine died on purpose"] * 100
        assert mux.dead
        assert mux.dead_reason == "fake engine died on purpose"
        with pytest.raises(EngineDeadError):
            mux.open_mailbox("late", 1)
        with pytest.raises(EngineDeadError):
            mux.submit(_add("late", 0, 1))
        mux.abort("r1")  # harmless on a dead engine


@pytest.mark.parametrize("fault", ["hang_after_steps", "die_after_steps"])
async def test_silence_past_the_heartbeat_timeout_fails_every_open_request(
    ipc_address: str, fault: str
) -> None:
    """A hung engine and one that exits without a word both fall silent."""
    options: dict[str, Any] = {fault: 3}
    async with _engine_and_mux(
        ipc_address, heartbeat_timeout=0.5, heartbeat_interval=0.05, **options
    ) as mux:
        mailboxes = [_open(mux, f"r{i}", 0, 10_000) for i in range(100)]
        reasons = await _expect_death(mailboxes)
        assert reasons == ["no message from the engine for 0.5 s"] * 100
        assert mux.dead


async def test_heartbeats_keep_an_idle_engine_alive(ipc_address: str) -> None:
    async with _engine_and_mux(ipc_address, heartbeat_timeout=1.0, heartbeat_interval=0.02) as mux:
        await anyio.sleep(2.0)
        assert not mux.dead
        assert mux.stats.frames_received > 2  # EngineReady and heartbeats


async def test_engine_died_from_the_process_watcher_fails_every_open_request(
    ipc_address: str,
) -> None:
    async with _engine_and_mux(ipc_address) as mux:
        mailboxes = [_open(mux, f"r{i}", 0, 10**9) for i in range(10)]
        await mailboxes[0].get()
        mux.engine_died("engine process exited with code -9")
        mux.engine_died("a second reason is ignored")
        reasons = await _expect_death(mailboxes)
        assert reasons == ["engine process exited with code -9"] * 10


async def test_deltas_for_unknown_ids_are_counted_not_errors(ipc_address: str) -> None:
    async with _engine_and_mux(ipc_address, ghost_deltas=True, tokens_per_step=1) as mux:
        results = [await _read_all(_open(mux, f"r{i}", i, 5)) for i in range(3)]
        assert results == [list(range(i, i + 5)) for i in range(3)]
        assert mux.stats.unknown_deltas >= 5
        assert not mux.dead


async def test_abort_ends_a_running_request_once(ipc_address: str) -> None:
    async with _engine_and_mux(ipc_address, tokens_per_step=1) as mux:
        mux.abort("never-opened")  # unknown id: harmless, nothing sent
        mailbox = _open(mux, "long", 0, 10**9)
        first = await mailbox.get()
        mux.abort("long")
        mux.abort("long")
        rest = [output async for output in mailbox]
        assert rest[-1].finish_reason is FinishReason.ABORT
        tokens = first.token_ids + [t for output in rest for t in output.token_ids]
        assert tokens == list(range(len(tokens)))
        mux.abort("long")  # finished: harmless
        assert mux.stats.aborts_sent == 1


async def test_closing_an_unfinished_mailbox_aborts_its_request(ipc_address: str) -> None:
    async with _engine_and_mux(ipc_address, tokens_per_step=1) as mux:
        with _open(mux, "dropped", 0, 10**9) as mailbox:
            await mailbox.get()
        await _eventually(lambda: mux.engine_stats.aborts_received == 1)
        await _eventually(lambda: mux.engine_stats.running == 0)
        assert mux.stats.aborts_sent == 1
        with _open(mux, "done", 0, 3) as mailbox:
            assert await _read_all(mailbox) == [0, 1, 2]
        assert mux.stats.aborts_sent == 1  # a finished request is not aborted


async def test_abort_before_submit_ends_the_request_locally(ipc_address: str) -> None:
    async with _engine_and_mux(ipc_address) as mux:
        mailbox = mux.open_mailbox("early", 10)
        mux.abort("early")
        outputs = [output async for output in mailbox]
        assert [output.finish_reason for output in outputs] == [FinishReason.ABORT]
        with pytest.raises(MuxError):
            mux.submit(_add("early", 0, 10))
        assert mux.stats.aborts_sent == 0


async def test_misuse_raises_mux_error(ipc_address: str) -> None:
    async with _engine_and_mux(ipc_address) as mux:
        with pytest.raises(MuxError, match="no open mailbox"):
            mux.submit(_add("unopened", 0, 1))
        mux.open_mailbox("dup", 1)
        with pytest.raises(MuxError, match="already open"):
            mux.open_mailbox("dup", 1)
        with pytest.raises(MuxError, match="max_tokens"):
            mux.submit(_add("dup", 0, 2))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=3, seed=2**64),  # msgpack cannot encode it
        SamplingParams(max_tokens=3, top_k=1.5),  # type: ignore[arg-type]  # engine cannot decode it
    ],
    ids=["int-out-of-msgpack-range", "wrong-type"],
)
async def test_an_add_that_cannot_cross_the_wire_fails_alone(
    ipc_address: str, params: SamplingParams
) -> None:
    """Adds share a frame: one that cannot be encoded (or decoded by the
    engine) must end alone, not stop the mux or lose its neighbours."""
    async with _engine_and_mux(ipc_address, tokens_per_step=1) as mux:
        before = mux.open_mailbox("before", 3)
        mux.submit(_add("before", 10, 3))
        bad = mux.open_mailbox("bad", 3)
        mux.submit(AddRequest("bad", [0], params))
        after = _open(mux, "after", 20, 3)
        outputs = [output async for output in bad]
        assert [output.finish_reason for output in outputs] == [FinishReason.ERROR]
        assert "cannot be sent to the engine" in (outputs[0].error or "")
        assert await _read_all(before) == [10, 11, 12]
        assert await _read_all(after) == [20, 21, 22]
        assert not mux.dead
        assert mux.stats.adds_sent == 2


async def test_no_engine_answer_is_a_clear_error(ipc_address: str) -> None:
    with anyio.fail_after(HANG_GUARD), pytest.raises(EngineDeadError, match="no EngineReady"):
        async with open_mux(ipc_address, ready_timeout=0.2):
            pass


async def test_engine_died_during_the_handshake_ends_start(ipc_address: str) -> None:
    mux = Mux()
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:

            async def watcher() -> None:
                await anyio.sleep(0.05)
                mux.engine_died("engine process exited with code 1")

            tg.start_soon(watcher)
            with pytest.raises(EngineDeadError, match="exited with code 1"):
                await tg.start(mux.run, ipc_address)
            with pytest.raises(EngineDeadError):
                await mux.wait_ready()


async def test_a_cancelled_mux_closes_mailboxes_and_asks_nothing_more(ipc_address: str) -> None:
    with run_fake_engine(ipc_address, tokens_per_step=1), anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            mux = Mux()
            await tg.start(mux.run, ipc_address)
            assert (await mux.wait_ready()).model == "fake"
            mailbox = _open(mux, "r", 0, 10**9)
            await mailbox.get()
            tg.cancel_scope.cancel()
        with pytest.raises(MuxClosedError):
            await _read_all(mailbox)
        with pytest.raises(MuxClosedError):
            mux.open_mailbox("late", 1)


async def test_shutdown_engine_stops_the_engine(ipc_address: str) -> None:
    with run_fake_engine(ipc_address) as engine, anyio.fail_after(HANG_GUARD):
        async with open_mux(ipc_address, ready_timeout=30) as mux:
            mux.shutdown_engine("test over")
            await _eventually(lambda: engine.poll() is not None)
        assert engine.returncode == 0


def test_mux_imports_only_the_protocol() -> None:
    code = (
        "import sys, tserve.mux; "
        "bad = [m for m in sys.modules if m.startswith(('torch', 'tserve.gpu', "
        "'tserve.nursery', 'tserve.web', 'quart', 'transformers'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
