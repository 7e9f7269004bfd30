"""The mux's errors: one small, flat hierarchy under :class:`tserve.LLMError`.

Foreign exceptions (``zmq.ZMQError``, ``tserve.protocol.ProtocolError``) are
mapped into these at the boundary where they arise, so callers above the mux
never catch a pyzmq type.
"""

from __future__ import annotations

from tserve._errors import LLMError

__all__ = ["EngineDeadError", "MuxClosedError", "MuxError"]


class MuxError(LLMError):
    """Base of every error the mux raises; also a misuse of its API."""


class EngineDeadError(MuxError):
    """The engine process is gone, hung, or never became ready.

    Every open mailbox fails with it at once, and later submits raise it.
    ``reason`` says what was observed (an EngineDead message, silence past the
    heartbeat timeout, the process exiting, a malformed frame).
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class MuxClosedError(MuxError):
    """The mux task has stopped (it was cancelled); nothing more will arrive."""
