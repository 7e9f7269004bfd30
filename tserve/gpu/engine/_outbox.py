"""The engine's side of the socket: per-peer output that never blocks a step.

The engine binds one ROUTER with ``ROUTER_MANDATORY``: a send to a peer that
is gone raises instead of vanishing, and a send to a peer at its high-water
mark raises ``zmq.Again`` (we always send with NOBLOCK). The step loop must
never wait on a slow API process, so a frame that cannot be sent is kept and
later step outputs for the same request are *merged* into it
(:class:`tserve.protocol.OutputMerge`).

Bound: the backlog of one peer holds at most one ``RequestOutput`` per live
request of that peer (plus the final output of requests that ended since its
last frame), and each of those at most ``max_tokens`` tokens, so it is bounded
by the scheduler's own bounds. Nothing in it is ever dropped while the peer
exists; a peer that is gone (EHOSTUNREACH) is reported to the caller so that
its requests can be aborted.

Liveness: every peer hears from the engine at least once per heartbeat
interval -- a StepOutputs frame when it has news, else a Heartbeat -- even
while the engine is busy with other peers' requests.
"""

from __future__ import annotations

import time

import zmq

from tserve.protocol import (
    EngineStats,
    Heartbeat,
    Message,
    OutputMerge,
    RequestOutput,
    StepOutputs,
    encode,
)

__all__ = ["Outbox"]


class Outbox:
    """Coalescing, non-blocking sender of engine frames to every API peer."""

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self._sock = sock
        # peer -> request id -> the merged output it has not yet received.
        # Invariant: the keys are exactly the known peers (those that spoke to
        # us and were not found gone since).
        # Invariant: no merge in a backlog is empty.
        self._backlog: dict[bytes, dict[str, OutputMerge]] = {}
        # peer -> time.monotonic() of the last frame it accepted; same keys.
        self._last_sent: dict[bytes, float] = {}

    @property
    def peers(self) -> list[bytes]:
        return list(self._backlog)

    @property
    def pending(self) -> bool:
        """Whether some peer has outputs it has not received yet."""
        return any(self._backlog.values())

    def add_peer(self, peer: bytes) -> None:
        """Know ``peer`` (idempotent); outputs for unknown peers are dropped."""
        if peer not in self._backlog:
            self._backlog[peer] = {}
            self._last_sent[peer] = time.monotonic()

    def queue(self, peer: bytes, output: RequestOutput) -> None:
        """Hold ``output`` for ``peer``, merged with what it has not received."""
        backlog = self._backlog.get(peer)
        if backlog is None:
            return  # the peer is gone; its requests were aborted
        held = backlog.get(output.request_id)
        if held is None:
            held = backlog[output.request_id] = OutputMerge()
        held.add(output)

    def flush(self, stats: EngineStats) -> list[bytes]:
        """Send each peer with a backlog ONE StepOutputs frame holding all of it.

        Never blocks. A peer at its high-water mark keeps its backlog for the
        next flush. Returns the peers found gone, already forgotten.
        """
        gone: list[bytes] = []
        for peer, backlog in self._backlog.items():
            if not backlog:
                continue
            outputs = [output for merge in backlog.values() if (output := merge.take())]
            sent = self.send(peer, StepOutputs(outputs, stats))
            if sent is None:
                gone.append(peer)
            elif sent:
                backlog.clear()
            else:  # at the HWM: keep it all for the next flush
                for merge, output in zip(backlog.values(), outputs, strict=True):
                    merge.add(output)
        for peer in gone:
            self.forget(peer)
        return gone

    def heartbeat(self, stats: EngineStats, interval: float) -> list[bytes]:
        """Send a Heartbeat to every peer that got no frame for ``interval`` seconds.

        A peer at its HWM is skipped: its queue already holds frames, which
        prove liveness as well. Returns the peers found gone, already forgotten.
        """
        stale = time.monotonic() - interval
        due = [peer for peer, last in self._last_sent.items() if last <= stale]
        gone = [peer for peer in due if self.send(peer, Heartbeat(stats)) is None]
        for peer in gone:
            self.forget(peer)
        return gone

    def send(self, peer: bytes, message: Message) -> bool | None:
        """True if sent, False at the HWM (try later), None if the peer is gone."""
        try:
            self._sock.send_multipart((peer, encode(message)), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return None
            raise
        if peer in self._last_sent:
            self._last_sent[peer] = time.monotonic()
        return True

    def forget(self, peer: bytes) -> None:
        self._backlog.pop(peer, None)
        self._last_sent.pop(peer, None)
