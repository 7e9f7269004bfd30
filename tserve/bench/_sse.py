"""Server-sent events: body bytes in, ``data`` payloads out (sans-IO).

Events end at a blank line; lines may end with ``\\n``, ``\\r\\n`` or ``\\r``
(sse-starlette, used by several peers, writes ``\\r\\n``). Only ``data:``
fields matter to the benchmark; comments, ``event:``, ``id:`` and ``retry:``
are dropped. An event of several ``data:`` lines joins them with ``\\n``.
"""

from __future__ import annotations

__all__ = ["SSEDecoder"]


class SSEDecoder:
    """Splits a byte stream into the ``data`` payloads of its events."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        """The payloads of the events that ``data`` completed, in order."""
        buf = self._buf + data
        if b"\r" in buf:
            held = buf.endswith(b"\r")  # maybe the first half of a CRLF
            body = buf[:-1] if held else buf
            buf = body.replace(b"\r\n", b"\n").replace(b"\r", b"\n") + (b"\r" if held else b"")
        *events, self._buf = buf.split(b"\n\n")
        out: list[bytes] = []
        for event in events:
            if event.startswith(b"data:") and b"\n" not in event:  # the common case
                out.append(event[6:] if event[5:6] == b" " else event[5:])
                continue
            lines = [
                line[6:] if line[5:6] == b" " else line[5:]
                for line in event.split(b"\n")
                if line.startswith(b"data:")
            ]
            if lines:
                out.append(b"\n".join(lines))
        return out

    def flush(self) -> list[bytes]:
        """Payloads of a last event that the stream ended without a blank line after."""
        rest, self._buf = self._buf, b""
        return self.feed(rest + b"\n\n") if rest.strip() else []
