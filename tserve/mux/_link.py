"""The mux's socket, and how an engine on the network shows it is gone.

:func:`engine_socket` makes the DEALER the mux owns: finite high-water marks
and a LINGER that lets the last frames out on close. With a :class:`Link`
(an engine reached by address, with no process on this host to watch) it
also gets:

* CURVE client keys, when the link has them (``tserve._curve``);
* ZMTP heartbeats: libzmq's I/O thread pings the engine every half
  heartbeat interval and drops the connection when nothing came back for a
  whole interval. That thread answers the engine's pings too, so neither a
  busy event loop here nor a long engine step looks like a dead peer;
* a socket monitor, whose events :func:`watch_link` turns into engine death.

The rules of the monitor (:meth:`Link.verdict`, sans-IO):

1. A handshake refused by the engine's authenticator (ZAP status 400) is
   death at once, naming the key: the engine does not know this server's
   ``client.key``. No retry; a supervisor's restart will not fix a key.
2. Any other failed handshake (a mechanism mismatch: one side ``--insecure``;
   a wrong ``server.key``) is death at once, saying what to check (the engine
   hangs up without a reason, so a mismatch may show as either).
3. A lost connection (the engine exited, was killed, or answered no
   heartbeat for an interval) is death: in-flight requests cannot survive
   it (the engine forgets a peer whose connection drops, and aborts its
   requests), so they fail now rather than at the silence timeout. A
   vanished engine is thus declared dead within 1.5 heartbeat intervals (at
   once when its host closes the connection, as on ``kill -9``).
4. Every other event (connecting, retrying, a handshake that succeeded) is
   only progress: an engine that is not up yet is waited for, up to the
   mux's ``ready_timeout``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import anyio
import zmq
from zmq.utils.monitor import parse_monitor_message

from tserve._curve import ClientKeys
from tserve.mux._zmqio import ZmqChannel

__all__ = ["Link", "engine_socket", "watch_link"]

_LINGER_MS = 1000  # to flush the last frames on close
_WATCHED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_DISCONNECTED
)


@dataclasses.dataclass(frozen=True, slots=True)
class Link:
    """How the mux reaches an engine by address alone (see the module docstring).

    ``curve`` None: plain ZMTP (``--insecure``, or a private ``ipc://`` path).
    ``heartbeat_interval`` > 0, in seconds: the ZMTP heartbeat's period is
    half of it, and a connection silent for all of it is lost.
    """

    curve: ClientKeys | None = None
    heartbeat_interval: float = 0.5

    def __post_init__(self) -> None:
        if self.heartbeat_interval <= 0:
            raise ValueError("heartbeat_interval must be positive")

    def verdict(self, event: int, value: int, address: str) -> str | None:
        """The engine's death reason that a monitor ``event`` (with its
        ``value``) means, or None for progress. Rules 1-4 above."""
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return (
                f"the engine at {address} refused this server's CURVE key (ZAP status "
                f"{value}): its --keys directory holds no copy of this server's client.key"
            )
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                mismatch = "has --keys, the engine" if self.curve else "runs --insecure, the engine"
                return (
                    f"the engine at {address} speaks another security mechanism: this server "
                    f"{mismatch} not"
                )
            return f"the handshake with the engine at {address} failed (protocol error {value:#x})"
        if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # the engine hung up on us
            if self.curve is not None:
                hint = "is server.key in --keys the engine's, and does the engine run with --keys?"
            else:
                hint = "does the engine run with --keys? then this server needs them too"
            return f"the handshake with the engine at {address} failed (errno {value}): {hint}"
        if event == zmq.EVENT_DISCONNECTED:
            return (
                f"lost the connection to the engine at {address} (it exited, or answered no "
                f"heartbeat for {self.heartbeat_interval:g} s)"
            )
        return None


@contextlib.contextmanager
def engine_socket(
    context: zmq.Context[zmq.Socket[bytes]], address: str, *, hwm: int, link: Link | None
) -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None]]:
    """A DEALER connected to ``address`` and, with ``link``, its monitor; both
    closed after the block (the DEALER lingers to deliver its last frames)."""
    socket: zmq.Socket[bytes] = context.socket(zmq.DEALER)
    monitor: zmq.Socket[bytes] | None = None
    try:
        socket.setsockopt(zmq.SNDHWM, hwm)
        socket.setsockopt(zmq.RCVHWM, hwm)
        socket.setsockopt(zmq.LINGER, _LINGER_MS)
        if link is not None:
            socket.setsockopt(zmq.HEARTBEAT_IVL, max(1, round(link.heartbeat_interval * 500)))
            socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, round(link.heartbeat_interval * 1000)))
            if link.curve is not None:
                socket.curve_serverkey = link.curve.server_public
                socket.curve_publickey = link.curve.public
                socket.curve_secretkey = link.curve.secret
            monitor = socket.get_monitor_socket(_WATCHED)
        socket.connect(address)
        yield socket, monitor
    finally:
        if monitor is not None:
            socket.disable_monitor()
            monitor.close(linger=0)
        socket.close()


async def watch_link(
    monitor: zmq.Socket[bytes], link: Link, address: str, died: Callable[[str], None]
) -> None:
    """Read ``monitor`` until an event is death (:meth:`Link.verdict`); then call
    ``died(reason)`` and return. Cancellable at any time; owns ``monitor``'s reads."""
    channel = ZmqChannel(monitor)
    async with anyio.create_task_group() as tg:
        tg.start_soon(channel.watch)
        while True:
            event = parse_monitor_message([await channel.receive(), await channel.receive()])
            reason = link.verdict(int(event["event"]), int(event["value"]), address)
            if reason is not None:
                died(reason)
                break
        tg.cancel_scope.cancel()
