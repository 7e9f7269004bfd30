"""The metrics process's HTTP: ``GET /metrics`` over h11, from one trio thread.

The metrics process (``_metrics_main``) serves nothing else, so its event
loop is idle between scrapes and a scrape costs it one wake-up: accept,
read the request, write the answer, all from this thread (no handoff to
another thread, whose wake-up a saturated machine would delay again).

What a scrape answers (:class:`Rendering`): ``live()`` read at that moment
(the engine's numbers, a few hundred bytes), then the text of ``shared()``
(the request counters and histograms of every API process, the costly part)
as rendered at most :data:`MAX_AGE` seconds ago. A scrape that finds that
text older renders it first; one that finds it older than :data:`REFRESH`
wakes :meth:`Rendering.keep_fresh`, which renders it again right after that
scrape is answered. So under frequent scrapes (an endpoint picker's 20 a
second) no scrape waits for a rendering, and an idle process renders nothing.

Bounds: at most :data:`MAX_CONNECTIONS` connections are held (more wait in
the kernel's accept queue: :mod:`tserve.web._accept`); a request head of at
most :data:`MAX_REQUEST_HEAD` bytes, complete within :data:`IDLE_TIMEOUT`
seconds of the last answer; an answer written within :data:`WRITE_TIMEOUT`
seconds. Past any of these the connection is closed.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import NoReturn

import h11
import trio

from tserve.web._accept import accept_connections
from tserve.web._browser import BrowserGuard
from tserve.web._errors import ForbiddenHost
from tserve.web._metrics import CONTENT_TYPE

__all__ = [
    "IDLE_TIMEOUT",
    "MAX_AGE",
    "MAX_CONNECTIONS",
    "MAX_REQUEST_HEAD",
    "REFRESH",
    "WRITE_TIMEOUT",
    "Rendering",
    "serve_metrics",
]

log = logging.getLogger("tserve.metrics")

MAX_AGE = 2.0  # seconds: older shared text is rendered again before it is served
REFRESH = 0.5  # seconds: older shared text is rendered again after the scrape
MAX_CONNECTIONS = 64
MAX_REQUEST_HEAD = 16 * 1024  # bytes
IDLE_TIMEOUT = 10.0  # seconds
WRITE_TIMEOUT = 10.0  # seconds

_TEXT = "text/plain; charset=utf-8"


class Rendering:
    """What a scrape answers (see the module docstring). Use from one trio thread.

    Invariant: ``_latest`` holds the shared text and the clock reading taken
    just before it was rendered, so its age is never understated.
    """

    def __init__(
        self,
        live: Callable[[], bytes],
        shared: Callable[[], bytes],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._live = live
        self._shared = shared
        self._clock = clock
        self._latest: tuple[float, bytes] = (-math.inf, b"")
        self._stale = trio.Event()  # set: keep_fresh should render

    def text(self) -> bytes:
        """The whole Prometheus text. Not a checkpoint; blocks the thread while it reads
        ``live()``, and while ``shared()`` renders when its text is older than MAX_AGE."""
        at, shared = self._latest
        age = self._clock() - at
        if age > MAX_AGE:
            shared = self._render()
        elif age > REFRESH:
            self._stale.set()
        return self._live() + shared  # disjoint families, valid in either order

    def _render(self) -> bytes:
        started = self._clock()
        body = self._shared()
        self._latest = (started, body)
        return body

    async def keep_fresh(self) -> NoReturn:
        """Render the shared text each time :meth:`text` found it older than REFRESH.

        Never returns; a checkpoint between renderings, which block the thread.
        A rendering that raises is logged (the next scrape past MAX_AGE tries again).
        """
        while True:
            await self._stale.wait()
            self._stale = trio.Event()
            if self._clock() - self._latest[0] > REFRESH:
                try:
                    self._render()
                except Exception:
                    log.exception("rendering the request metrics failed")


def _answer(
    request: h11.Request, rendering: Rendering, guard: BrowserGuard
) -> tuple[h11.Response, bytes]:
    """The response to ``request``: its head and its body."""
    host = next((v.decode("latin-1") for k, v in request.headers if k == b"host"), None)
    status, content_type, body = 200, CONTENT_TYPE, b""
    try:
        guard.check("GET", host, None)
    except ForbiddenHost as exc:
        status, content_type, body = 403, _TEXT, f"{exc}\n".encode()
    else:
        if request.method != b"GET":
            status, content_type, body = 405, _TEXT, b"only GET here\n"
        elif request.target.split(b"?", 1)[0] != b"/metrics":
            status, content_type, body = 404, _TEXT, b"only /metrics here\n"
        else:
            try:
                body = rendering.text()
            except Exception:
                log.exception("rendering the metrics failed")
                status, content_type, body = 500, _TEXT, b"rendering the metrics failed\n"
    headers = [("content-type", content_type), ("content-length", str(len(body)))]
    if status == 405:
        headers.append(("allow", "GET"))
    reason = HTTPStatus(status).phrase.encode()
    return h11.Response(status_code=status, headers=headers, reason=reason), body


async def _next_request(stream: trio.SocketStream, conn: h11.Connection) -> h11.Request | None:
    """The next complete request (its body, if any, read and dropped), or None once the
    client closed or broke the protocol. A checkpoint."""
    request: h11.Request | None = None
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            return None
        if event is h11.NEED_DATA:
            try:
                conn.receive_data(await stream.receive_some(MAX_REQUEST_HEAD))
            except trio.BrokenResourceError:
                return None
        elif isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.EndOfMessage):
            return request
        elif not isinstance(event, h11.Data):  # ConnectionClosed (PAUSED cannot come here)
            return None
        # h11.Data: a request body, dropped


async def _serve_connection(
    stream: trio.SocketStream, rendering: Rendering, guard: BrowserGuard
) -> None:
    """Answer the requests of one connection until it closes or a bound is passed."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_HEAD)
    while True:
        request: h11.Request | None = None
        with trio.move_on_after(IDLE_TIMEOUT):
            request = await _next_request(stream, conn)
        if request is None:
            return
        response, body = _answer(request, rendering, guard)
        data = conn.send(response) or b""
        data += conn.send(h11.Data(data=body)) or b""
        data += conn.send(h11.EndOfMessage()) or b""
        with trio.move_on_after(WRITE_TIMEOUT) as writing:
            try:
                await stream.send_all(data)
            except trio.BrokenResourceError:
                return
        if writing.cancelled_caught or conn.our_state is not h11.DONE:
            return
        try:
            conn.start_next_cycle()
        except h11.LocalProtocolError:  # the client's side is not done (it will close)
            return


async def serve_metrics(
    listener: socket.socket, rendering: Rendering, guard: BrowserGuard
) -> NoReturn:
    """Serve ``GET /metrics`` on ``listener`` (listening, non-blocking) until cancelled.

    Never returns; a cancel closes every connection at once. ``listener`` is
    the caller's to close.
    """
    room = trio.Semaphore(MAX_CONNECTIONS)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(rendering.keep_fresh)

        async def run(conn: socket.socket) -> None:
            try:
                stream = trio.SocketStream(trio.socket.from_stdlib_socket(conn))
            except BaseException:
                conn.close()
                room.release()
                raise
            try:
                await _serve_connection(stream, rendering, guard)
            finally:
                try:
                    await trio.aclose_forcefully(stream)
                finally:
                    room.release()

        await accept_connections(listener, room, lambda conn: nursery.start_soon(run, conn))
    raise AssertionError("unreachable: accept_connections never returns")
