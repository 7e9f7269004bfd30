"""The engine's errors: one small base and a flat hierarchy under it.

Plain Python, like the scheduler: the engine loop catches these at its edge and
turns a per-request error into a ``RequestOutput`` with ``FinishReason.ERROR``;
nothing here ever ends the engine process.
"""

from __future__ import annotations

__all__ = ["EngineError", "RequestRejected"]


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class RequestRejected(EngineError):
    """A request that can never run (empty prompt, longer than the context, larger
    than the whole KV budget, ...). The message is meant for the user; the engine
    answers that request alone with an error and carries on."""
