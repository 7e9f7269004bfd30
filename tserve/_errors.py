"""The root of every error type tserve raises to a caller: :class:`LLMError`.

A leaf below every package, so that each package's small hierarchy (the
mux's, the embeddable API's, the key files') derives from the one root and
``except tserve.LLMError`` catches whatever ``open_llm`` / ``attach_llm``
and the calls on their ``LLM`` raise, engine death included. Foreign
exceptions (pyzmq's, the tokenizer's) are mapped into these where they
arise. An argument of the wrong type or value (``max_pending=0``, an
unknown engine option) is a bug in the caller and raises ``TypeError`` or
``ValueError`` at the call, as in any Python API.
"""

from __future__ import annotations

__all__ = ["LLMError"]


class LLMError(Exception):
    """Base of every error of the embeddable API: the engine's death, an
    overload, a bad request, a timeout, shutting down, a failed start."""
