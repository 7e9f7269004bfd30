"""The one-socket multiplexer between an API process and the engine process.

One task (:meth:`Mux.run`) owns the API process's only ZMQ socket to the
engine; every request reaches it through a :class:`Mailbox` and the mux's
synchronous ``submit``/``abort``. Imports only :mod:`tserve.protocol` (and
:mod:`tserve._curve`'s key types).

Modules:

* ``_mux.py`` — :class:`Mux`, the task that owns the socket: handshake,
  sending inputs, receiving outputs, engine death.
* ``_open.py`` — ``open_mux``: a mux run for the duration of a block.
* ``_link.py`` — the mux's socket; for an engine reached by address alone
  (:class:`Link`): CURVE keys, ZMTP heartbeats, and the monitor events that
  are its death (a refused key, a failed handshake, a lost connection).
* ``_heartbeat.py`` — the heartbeat watch: when engine silence is the
  engine's death and when it is only the event loop's lateness (the
  sans-IO :class:`SilenceClock` and the task that looks at it).
* ``_lifecycle.py`` — :class:`Lifecycle`, the sans-IO state machine of one
  request in the API process: what is sent, routed, aborted (once) and
  failed, as actions for each event.
* ``_router.py`` — the sans-IO routing table: request id -> mailbox, the
  inbox of adds and aborts for the next frame; it feeds each request's
  lifecycle and carries out its actions.
* ``_mailbox.py`` — :class:`Mailbox`, one request's merged deltas and its
  reader's side.
* ``_parking.py`` — the one-shot waiter a mailbox reader parks on.
* ``_zmqio.py`` — the non-blocking pyzmq adapter for anyio (one watcher on
  ``zmq.FD``, no lost message on cancel).
* ``_errors.py`` — the mux's error types.
"""

from tserve.mux._errors import EngineDeadError, MuxClosedError, MuxError
from tserve.mux._lifecycle import IllegalTransition, Lifecycle, RequestState
from tserve.mux._link import Link
from tserve.mux._mailbox import Mailbox
from tserve.mux._mux import Mux, MuxStats
from tserve.mux._open import open_mux

__all__ = [
    "EngineDeadError",
    "IllegalTransition",
    "Lifecycle",
    "Link",
    "Mailbox",
    "Mux",
    "MuxClosedError",
    "MuxError",
    "MuxStats",
    "RequestState",
    "open_mux",
]
