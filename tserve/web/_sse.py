"""Server-sent events as OpenAI streams them. Sans-IO: payloads in, bytes out.

A stream is zero or more ``data: {json}`` events, then optionally one error
event ``data: {"error": {...}}`` (the stream failed after its headers were
sent, so the status is already 200), then always ``data: [DONE]``.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

__all__ = ["DONE", "event"]

DONE: Final = b"data: [DONE]\n\n"

_ENCODER: Final = msgspec.json.Encoder()


def event(payload: Any) -> bytes:
    """One SSE event carrying ``payload`` as JSON."""
    return b"data: " + _ENCODER.encode(payload) + b"\n\n"
