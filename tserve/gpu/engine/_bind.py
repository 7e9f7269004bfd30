"""The engine's socket: one ROUTER, bound to a private ``ipc://`` path or a network address.

Always: ``ROUTER_MANDATORY`` (a send to a peer that is gone raises
EHOSTUNREACH instead of vanishing), finite high-water marks (:data:`SNDHWM`,
:data:`RCVHWM`; what happens at them is in ``_outbox.py``), and a short LINGER.

For ``tserve engine``, whose peers are known by their connections alone:

* ZMTP heartbeats (``heartbeat_interval``). libzmq's I/O thread pings every
  connection every half interval and closes one that answered nothing for
  a whole interval; the ROUTER then forgets that peer, so the next frame
  sent to it raises EHOSTUNREACH and its requests are aborted
  (``_process.py``, which probes idle peers every half interval). So the
  requests of an API server that vanished (killed, its host gone, the
  network cut) are dropped within 2 intervals, or at the end of a longer
  step. The I/O thread answers the API servers' own pings while the step
  loop computes, so a long step never looks like a vanished engine.
* CURVE, given :class:`~tserve._curve.ServerKeys`: traffic is encrypted, and
  pyzmq's ZAP authenticator (a thread of its own) admits exactly the clients
  whose public keys are in a ``*.key`` file of the key directory, read once
  at start; a refused key is logged once. A ``tcp://`` address without keys
  (``--insecure``) gets a warning.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import zmq

from tserve._curve import ServerKeys, is_network_address

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

__all__ = ["RCVHWM", "SNDHWM", "bind_engine_socket"]

log = logging.getLogger("tserve.engine")

# Bounds of the engine's socket, in frames. At SNDHWM a send raises zmq.Again
# and the Outbox coalesces (see _outbox.py); at RCVHWM ZMQ stops reading from
# the peer and the peer's own send waits: nothing is dropped either way.
SNDHWM = 1000
RCVHWM = 1000
_LINGER_MS = 1000


class _KnownKeys:
    """The ZAP policy: admit a client iff its public key (z85) is one of ``keys.clients``."""

    def __init__(self, keys: ServerKeys) -> None:
        self._keys = keys
        self._refused: set[bytes] = set()  # logged once each

    def callback(self, domain: str, key: bytes) -> bool:
        """Called by pyzmq's authenticator thread for each CURVE handshake."""
        if key in self._keys.clients:
            return True
        if key not in self._refused:
            self._refused.add(key)
            log.warning(
                "refused an API server whose CURVE public key %s is not in %s",
                key.decode(),
                self._keys.directory,
            )
        return False


@contextlib.contextmanager
def bind_engine_socket(
    context: zmq.Context[zmq.Socket[bytes]],
    address: str,
    *,
    heartbeat_interval: float | None,
    keys: ServerKeys | None,
) -> Iterator[zmq.Socket[bytes]]:
    """A ROUTER bound to ``address`` for the block (see the module docstring); closed after.

    ``heartbeat_interval`` None: no ZMTP heartbeats (an engine whose one peer
    is its parent). ``keys`` None: no CURVE. Raises zmq.ZMQError when the
    address cannot be bound.
    """
    sock: zmq.Socket[bytes] = context.socket(zmq.ROUTER)
    auth: ThreadAuthenticator | None = None
    try:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        sock.setsockopt(zmq.LINGER, _LINGER_MS)
        if heartbeat_interval is not None:
            sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, round(heartbeat_interval * 500)))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, round(heartbeat_interval * 1000)))
        if keys is not None:
            # Imported here: it imports asyncio, which an engine without keys never needs.
            from zmq.auth.thread import ThreadAuthenticator

            auth = ThreadAuthenticator(context, log=logging.getLogger("tserve.engine.zap"))
            auth.start()
            auth.configure_curve_callback(domain="*", credentials_provider=_KnownKeys(keys))
            sock.curve_publickey = keys.public
            sock.curve_secretkey = keys.secret
            sock.curve_server = True
        elif is_network_address(address):
            log.warning(
                "%s WITHOUT CURVE (--insecure): anyone who reaches it can use the engine "
                "and read its outputs",
                address,
            )
        sock.bind(address)
        yield sock
    finally:
        sock.close()
        if auth is not None:
            auth.stop()
