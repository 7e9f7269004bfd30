"""Both ends of the adapter stress test: send and check sequence-numbered deltas.

Each side sends ``deltas`` token deltas in ``StepOutputs`` frames of random
size (delta k carries token id k) while, concurrently on the same socket, it
receives the other side's frames and checks that the token ids arrive as
0, 1, 2, ... with nothing lost, repeated or reordered.

The test process runs one side; ``python -m tests.mux.stress_peer ADDRESS
DELTAS SEED HWM`` runs the other (connecting a DEALER, under trio) and exits 0
only if everything arrived in order.

The ending: the test side, once it has all the peer's deltas, says so
(:data:`ALL_ARRIVED`), and the peer closes its socket only once it has heard
that (the test side closes only after the peer has exited). A peer that closed
right after its last send could take frames with it that were still in flight
or queued on the test side, and the test would wait for deltas that can no
longer come (seen under load: the peer had exited 0).
"""

from __future__ import annotations

import random
import sys
from functools import partial

import anyio
import zmq

from tserve.mux._zmqio import ZmqChannel
from tserve.protocol import EngineStats, RequestOutput, StepOutputs, decode, encode

MAX_FRAME = 200  # deltas per frame: 1..MAX_FRAME, about 100 on average
ALL_ARRIVED = b"all arrived"  # the test side's last frame: every delta arrived


class SequenceError(AssertionError):
    """A delta arrived out of order, twice, or never."""


async def send_deltas(channel: ZmqChannel, deltas: int, seed: int) -> None:
    """Send token ids 0..deltas-1, one per RequestOutput, in random-sized frames."""
    rng = random.Random(seed)
    stats = EngineStats()
    sent = 0
    while sent < deltas:
        count = min(rng.randint(1, MAX_FRAME), deltas - sent)
        outputs = [RequestOutput("s", [token]) for token in range(sent, sent + count)]
        await channel.send(encode(StepOutputs(outputs, stats)))
        sent += count


async def receive_deltas(channel: ZmqChannel, deltas: int, *, ending: bool) -> None:
    """Receive until ``deltas`` arrived, and then, if ``ending``, :data:`ALL_ARRIVED`;
    raise SequenceError on any gap or repeat (ProtocolError on any other frame)."""
    expected = 0
    ended = not ending
    while expected < deltas or not ended:
        for frame in await channel.receive_batch():
            if expected == deltas and not ended and frame == ALL_ARRIVED:
                ended = True
                continue
            step = decode(frame)
            assert isinstance(step, StepOutputs)
            tokens = [output.token_ids[0] for output in step.outputs]
            if tokens != list(range(expected, expected + len(tokens))):
                raise SequenceError(f"expected {expected}.. got {tokens[:5]}..")
            expected += len(tokens)
    if expected != deltas:
        raise SequenceError(f"received {expected} deltas, sent {deltas}")


async def exchange(
    socket: zmq.Socket[bytes], deltas: int, seed: int, *, closes_first: bool
) -> None:
    """Send and receive ``deltas`` each way at once over one socket; the side that
    ``closes_first`` also waits for :data:`ALL_ARRIVED`, which the other sends
    once it has everything (hang guard: 120 s)."""
    channel = ZmqChannel(socket)
    with anyio.fail_after(120):
        await _exchange(channel, deltas, seed, closes_first)


async def _exchange(channel: ZmqChannel, deltas: int, seed: int, closes_first: bool) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(channel.watch)
        async with anyio.create_task_group() as work:
            work.start_soon(send_deltas, channel, deltas, seed)
            work.start_soon(partial(receive_deltas, channel, deltas, ending=closes_first))
        if not closes_first:
            await channel.send(ALL_ARRIVED)
        tg.cancel_scope.cancel()


def open_socket(context: zmq.Context[zmq.Socket[bytes]], hwm: int) -> zmq.Socket[bytes]:
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.SNDHWM, hwm)
    socket.setsockopt(zmq.RCVHWM, hwm)
    socket.setsockopt(zmq.LINGER, 5000)
    return socket


def main() -> int:
    address, deltas, seed, hwm = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socket = open_socket(context, hwm)
    socket.connect(address)
    try:
        anyio.run(partial(exchange, closes_first=True), socket, deltas, seed, backend="trio")
    finally:
        socket.close()
        context.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
