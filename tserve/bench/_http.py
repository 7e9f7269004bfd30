"""A small HTTP/1.1 client for streaming POSTs: a sans-IO response parser and one IO edge.

Why not httpx: on this 2-core machine the client shares the CPU with the server
it measures, so every microsecond it spends per SSE chunk is taken from the
server. httpx (h11 + httpcore) costs several times more per chunk than this
parser, which only splits bytes.

Rules of :class:`ResponseParser` (one response per parser):

* States run ``STATUS → HEADERS → BODY → DONE``; ``feed`` returns the body
  bytes decoded from the data it is given (possibly empty) and never raises
  for a short read, only for bytes that are not HTTP (:class:`ProtocolError`).
* The body is framed by ``Transfer-Encoding: chunked``, else by
  ``Content-Length``, else it runs until the connection closes (``eof``).
* ``keep_alive`` is true only when the response said nothing against it and
  its framing let it end before the connection did.
"""

from __future__ import annotations

import enum
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import anyio
import anyio.abc

__all__ = [
    "Connection",
    "ConnectionPool",
    "Origin",
    "ProtocolError",
    "ResponseParser",
    "encode_post",
]

_MAX_HEAD = 64 * 1024  # bytes of status line + headers at most
_RECEIVE = 65536


class ProtocolError(Exception):
    """The peer sent bytes that are not an HTTP/1.1 response."""


class _State(enum.Enum):
    STATUS = "status"
    HEADERS = "headers"
    BODY = "body"
    DONE = "done"


class _Framing(enum.Enum):
    CHUNKED = "chunked"
    LENGTH = "length"
    CLOSE = "close"


class ResponseParser:
    """Parses one HTTP/1.1 response from bytes as they arrive (sans-IO)."""

    def __init__(self) -> None:
        self.state = _State.STATUS
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep_alive = True
        self._framing = _Framing.CLOSE
        self._remaining = 0  # LENGTH: body bytes left; CHUNKED: bytes left in this chunk
        self._buf = bytearray()  # bytes not yet consumed (head, or chunk framing)
        self._trailers = False  # CHUNKED: after the last chunk, reading the trailer section

    @property
    def done(self) -> bool:
        return self.state is _State.DONE

    def feed(self, data: bytes) -> bytes:
        """Consume ``data``; return the body bytes it completed."""
        if self.state is _State.DONE:
            return b""
        if self.state is not _State.BODY:
            self._buf += data
            if not self._parse_head():
                return b""
            data, self._buf = bytes(self._buf), bytearray()
        if self._framing is _Framing.CLOSE:
            return data
        if self._framing is _Framing.LENGTH:
            body = data[: self._remaining]
            self._remaining -= len(body)
            if self._remaining == 0:
                self.state = _State.DONE
            return body
        return self._dechunk(data)

    def eof(self) -> None:
        """The connection closed; raise if the body was framed and is cut short."""
        if self.state is _State.DONE:
            return
        self.keep_alive = False
        if self.state is _State.BODY and self._framing is _Framing.CLOSE:
            self.state = _State.DONE
            return
        raise ProtocolError(f"connection closed in {self.state.value} of the response")

    # -- the head -----------------------------------------------------------------

    def _parse_head(self) -> bool:
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > _MAX_HEAD:
                raise ProtocolError("response head too long")
            return False
        head = bytes(self._buf[:end]).decode("latin-1").split("\r\n")
        del self._buf[: end + 4]
        version, _, rest = head[0].partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/1.") or not code.isdigit():
            raise ProtocolError(f"bad status line {head[0]!r}")
        self.status = int(code)
        for line in head[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise ProtocolError(f"bad header line {line!r}")
            self.headers[name.strip().lower()] = value.strip()
        if 100 <= self.status < 200:  # an interim response: the real one follows
            self.status, self.headers = 0, {}
            return self._parse_head()
        self._choose_framing(version)
        return True

    def _choose_framing(self, version: str) -> None:
        connection = self.headers.get("connection", "").lower()
        self.keep_alive = "close" not in connection and (
            version == "HTTP/1.1" or "keep-alive" in connection
        )
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            self._framing = _Framing.CHUNKED
        elif "content-length" in self.headers:
            self._framing = _Framing.LENGTH
            self._remaining = int(self.headers["content-length"])
        else:
            self._framing = _Framing.CLOSE
            self.keep_alive = False
        no_body = self.status in (204, 304) or (
            self._framing is _Framing.LENGTH and self._remaining == 0
        )
        self.state = _State.DONE if no_body else _State.BODY

    # -- chunked bodies -------------------------------------------------------------

    def _dechunk(self, data: bytes) -> bytes:
        out = bytearray()
        if self._remaining and not self._buf:  # the common case: inside a chunk
            take = data[: self._remaining]
            out += take
            self._remaining -= len(take)
            data = data[len(take) :]
        self._buf += data
        buf = self._buf
        pos = 0
        while self.state is not _State.DONE:
            if self._remaining:
                piece = buf[pos : pos + self._remaining]
                out += piece
                self._remaining -= len(piece)
                pos += len(piece)
                if self._remaining:
                    break
                continue
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            line = bytes(buf[pos:eol])
            pos = eol + 2
            if self._trailers:
                if not line:
                    self.state = _State.DONE
                continue
            if not line:  # the CRLF that ends a chunk's data
                continue
            try:
                size = int(line.split(b";", 1)[0], 16)
            except ValueError:
                raise ProtocolError(f"bad chunk size line {line!r}") from None
            if size == 0:
                self._trailers = True
            self._remaining = size
        del buf[:pos]
        return bytes(out)


@dataclass(frozen=True)
class Origin:
    """Where requests go: scheme, host and port of a base URL, and its path prefix."""

    scheme: str
    host: str
    port: int
    prefix: str

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname, port, parts.path.rstrip("/"))

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass
class Connection:
    """One open HTTP/1.1 connection; one request at a time."""

    stream: anyio.abc.ByteStream
    reusable: bool = field(default=True)

    async def post(self, request: bytes) -> ResponseParser:
        """Send a whole request (a checkpoint); return a parser for its response."""
        await self.stream.send(request)
        return ResponseParser()

    async def receive(self) -> bytes:
        """The next bytes of the response, ``b""`` at end of stream (a checkpoint)."""
        try:
            return await self.stream.receive(_RECEIVE)
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            return b""

    async def aclose(self) -> None:
        self.reusable = False
        await anyio.aclose_forcefully(self.stream)


class ConnectionPool:
    """Keep-alive connections to one origin; grows with the peak number in use.

    Bound: it holds at most as many idle connections as were ever in use at
    once, which the benchmark caps by its concurrency (or its request count).
    """

    def __init__(self, origin: Origin, *, connect_timeout: float = 30.0) -> None:
        self.origin = origin
        self.connect_timeout = connect_timeout
        self._idle: list[Connection] = []
        self._ssl = ssl.create_default_context() if origin.scheme == "https" else None

    async def acquire(self) -> Connection:
        """An idle connection, or a new one (a checkpoint when it connects)."""
        if self._idle:
            return self._idle.pop()
        host, port = self.origin.host, self.origin.port
        stream: anyio.abc.ByteStream
        with anyio.fail_after(self.connect_timeout):
            if self._ssl is None:
                stream = await anyio.connect_tcp(host, port)
            else:
                stream = await anyio.connect_tcp(
                    host, port, ssl_context=self._ssl, tls_standard_compatible=False
                )
        return Connection(stream)

    def release(self, conn: Connection) -> None:
        """Give back a connection whose response ended cleanly; others must be closed."""
        self._idle.append(conn)

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.aclose()

    def request_bytes(self, path: str, body: bytes, headers: Mapping[str, str]) -> bytes:
        """The bytes of ``POST prefix+path`` with a JSON ``body`` (:func:`encode_post`)."""
        return encode_post(self.origin, path, body, headers)


def encode_post(origin: Origin, path: str, body: bytes, headers: Mapping[str, str]) -> bytes:
    """The bytes of ``POST prefix+path`` to ``origin`` with a JSON ``body`` and ``headers``."""
    lines = [
        f"POST {origin.prefix}{path} HTTP/1.1",
        f"Host: {origin.host_header}",
        "Content-Type: application/json",
        "Accept: text/event-stream",
        f"Content-Length: {len(body)}",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
