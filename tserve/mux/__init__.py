"""The one-socket multiplexer between an API process and the engine process.

One task (:meth:`Mux.run`) owns the API process's only ZMQ socket to the
engine; every request reaches it through a :class:`Mailbox` and the mux's
synchronous ``submit``/``abort``. Imports only :mod:`tserve.protocol`.
"""

from tserve.mux._errors import EngineDeadError, MuxClosedError, MuxError
from tserve.mux._mailbox import Mailbox
from tserve.mux._mux import Mux, MuxStats, open_mux

__all__ = [
    "EngineDeadError",
    "Mailbox",
    "Mux",
    "MuxClosedError",
    "MuxError",
    "MuxStats",
    "open_mux",
]
