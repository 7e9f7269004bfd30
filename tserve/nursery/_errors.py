"""Errors a caller of the embeddable API can see.

A small, flat hierarchy under :class:`LLMError` (``tserve._errors``), as is
the mux's :class:`tserve.mux.EngineDeadError`; the web layer maps each class
to an OpenAI error type and HTTP status in one place.
"""

from __future__ import annotations

from tserve._errors import LLMError

__all__ = [
    "InvalidRequest",
    "LLMError",
    "Overloaded",
    "RequestFailed",
    "RequestTimeout",
    "ShuttingDown",
]


class Overloaded(LLMError):
    """``max_pending`` requests are already live; retry after ``retry_after`` s."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ShuttingDown(LLMError):
    """The server is draining and takes no new requests."""


class InvalidRequest(LLMError):
    """The request cannot be served as asked; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestFailed(LLMError):
    """The engine ended this request alone with an error (others are unaffected);
    ``param`` names the part of the request at fault, when one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestTimeout(LLMError):
    """The request's deadline passed; it was aborted in the engine."""
