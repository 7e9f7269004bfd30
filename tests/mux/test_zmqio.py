"""The zmq adapter: a 1,000,000-delta each-way stress test between two
processes, and cancellation at random points on both receive and send."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import anyio
import pytest
import zmq

from tests.mux.stress_peer import exchange, open_socket
from tserve.mux._zmqio import ZmqChannel

REPO_ROOT = Path(__file__).resolve().parents[2]
STRESS_DELTAS = 1_000_000


@pytest.mark.anyio
@pytest.mark.parametrize(("round_", "hwm"), [(0, 4), (1, 64), (2, 1000)])
async def test_a_million_deltas_each_way_arrive_in_order(
    ipc_address: str, round_: int, hwm: int
) -> None:
    """Concurrent send and receive on one socket, both sides; repeated per round
    and backend to catch the edge-trigger race. A small HWM makes senders wait."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socket = open_socket(context, hwm)
    socket.bind(ipc_address)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    argv = [sys.executable, "-m", "tests.mux.stress_peer", ipc_address]
    argv += [str(STRESS_DELTAS), str(round_ + 100), str(hwm)]
    try:
        async with await anyio.open_process(argv, cwd=REPO_ROOT, env=env, stdout=None) as peer:
            try:
                await exchange(socket, STRESS_DELTAS, seed=round_, closes_first=False)
                with anyio.fail_after(60):
                    code = await peer.wait()
            finally:
                if peer.returncode is None:
                    peer.kill()
        assert code == 0, "the peer saw a lost, repeated or reordered delta"
    finally:
        socket.close(linger=0)
        context.term()


def _pair(
    context: zmq.Context[zmq.Socket[bytes]], address: str, hwm: int
) -> tuple[ZmqChannel, ZmqChannel, list[zmq.Socket[bytes]]]:
    a, b = open_socket(context, hwm), open_socket(context, hwm)
    a.bind(address)
    b.connect(address)
    return ZmqChannel(a, max_buffered=3), ZmqChannel(b, max_buffered=3), [a, b]


@pytest.mark.anyio
@pytest.mark.parametrize("seed", range(3))
async def test_cancelled_receive_and_send_lose_and_repeat_nothing(
    ipc_address: str, seed: int
) -> None:
    """Receives and sends cancelled at random points: every frame arrives once,
    in order. A cancelled send is retried, so if one had gone out anyway the
    receiver would see it twice."""
    frames = 3000
    rng = random.Random(seed)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sender, receiver, sockets = _pair(context, ipc_address, hwm=1)
    received: list[int] = []
    cancels = {"send": 0, "receive": 0}

    def cancel_point() -> float:
        return rng.choice([0.0, 0.0, 1e-6, 1e-5, 1e-4, rng.random() * 1e-3])

    async def send_all() -> None:
        number = 0
        while number < frames:
            with anyio.move_on_after(cancel_point()) as scope:
                await sender.send(number.to_bytes(4, "big"))
                number += 1
            cancels["send"] += scope.cancelled_caught

    async def receive_all() -> None:
        while len(received) < frames:
            with anyio.move_on_after(cancel_point()) as scope:
                if rng.random() < 0.5:
                    received.append(int.from_bytes(await receiver.receive(), "big"))
                else:
                    batch = await receiver.receive_batch()
                    received.extend(int.from_bytes(frame, "big") for frame in batch)
            cancels["receive"] += scope.cancelled_caught

    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender.watch)
                tg.start_soon(receiver.watch)
                async with anyio.create_task_group() as work:
                    work.start_soon(send_all)
                    work.start_soon(receive_all)
                tg.cancel_scope.cancel()
    finally:
        for socket in sockets:
            socket.close(linger=0)
        context.term()
    assert received == list(range(frames))
    assert cancels["send"] > 0 and cancels["receive"] > 0  # the test cancelled something
