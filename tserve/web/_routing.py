"""How a request reaches its handler: routes, the API key, request ids, errors as replies.

Every response carries ``X-Request-Id`` (the client's, if it sent a sane one,
else a fresh one). With an API key configured, a :class:`Route` marked
``protected`` needs ``Authorization: Bearer KEY`` (compared in constant
time), or the key alone in ``x-api-key`` (Anthropic's header); probes and
scrapers need no secret. Before either, every route
passes the browser checks (:class:`BrowserGuard`: 403, 415). An exception
from a handler, or a routing error (404, 405) before any handler runs,
becomes error JSON in its route's
shape (:data:`ErrorShape`: OpenAI's unless the route says otherwise) through
the one mapping of :mod:`._errors`. Each request leaves one
:class:`RequestRecord` (metrics, and a log line on ``logged`` routes).
"""

from __future__ import annotations

import dataclasses
import hmac
import re
import uuid
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import msgspec
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from tserve.web._browser import BrowserGuard
from tserve.web._errors import ErrorShape, Unauthorized, error_reply
from tserve.web._metrics import Metrics, RequestRecord

__all__ = ["Handler", "Route", "Router", "json_response", "read_body", "request_id"]

_SANE_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_JSON = msgspec.json.Encoder()

Handler = Callable[..., Awaitable[Response]]
"""A route's handler: its request's record, then the path's variables as keywords."""


@dataclasses.dataclass(frozen=True, slots=True)
class Route:
    """One row of the route table."""

    path: str
    method: str
    handler: Handler
    protected: bool  # needs the API key, when the server has one
    logged: bool = True  # a log line per request (not for probes and scrapes)
    errors: ErrorShape = error_reply  # how its errors look (OpenAI's, or Anthropic's)


def json_response(
    payload: Any, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    """``payload`` as an ``application/json`` response."""
    return Response(
        _JSON.encode(payload), status=status, headers=headers, content_type="application/json"
    )


async def read_body() -> bytes:
    """The current request's whole body. A checkpoint; bounded by quart's
    ``MAX_CONTENT_LENGTH`` (413) and ``BODY_TIMEOUT``."""
    data = await request.get_data(cache=False)
    return data if isinstance(data, bytes) else data.encode()


def request_id(header: str | None) -> str:
    """The client's ``X-Request-Id`` if it is sane, else a fresh one."""
    if header is not None and _SANE_ID.fullmatch(header):
        return header
    return uuid.uuid4().hex


class Router:
    """Installs routes on an app, each behind the key check and the error mapping."""

    def __init__(
        self,
        metrics: Metrics,
        *,
        api_key: str | None,
        request_log: bool,
        browser: BrowserGuard,
    ) -> None:
        self._metrics = metrics
        self._browser = browser
        self._api_key = None if api_key is None else api_key.encode()
        self._request_log = request_log

    def install(self, app: QuartTrio, routes: Sequence[Route]) -> None:
        for route in routes:
            view = partial(self._view, route)
            endpoint = f"{route.method} {route.path}"
            app.add_url_rule(route.path, endpoint, view, methods=[route.method])
        app.register_error_handler(HTTPException, self._http_error)

    async def _view(self, route: Route, **path: str) -> Response:
        rid = request_id(request.headers.get("X-Request-Id"))
        log_line = route.logged and self._request_log
        record = RequestRecord(self._metrics, route.path, rid, log_line=log_line)
        status = 499  # the client went away (cancelled) unless set below
        try:
            headers = request.headers
            self._browser.check(request.method, headers.get("Host"), headers.get("Content-Type"))
            if route.protected:
                self._authorize()
            response = await route.handler(record, **path)
            status = response.status_code
        except Exception as exc:
            reply = route.errors(exc, rid)
            status = reply.status
            response = json_response(reply.body, reply.status, reply.headers)
            if status in (403, 413, 415):  # the body is unread: the connection is spent
                response.headers["Connection"] = "close"
        finally:
            if not record.streaming:
                record.done(status)
        response.headers["X-Request-Id"] = rid
        return response

    async def _http_error(self, exc: HTTPException) -> Response:
        """Routing errors (404, 405) raised before any view runs."""
        rid = request_id(request.headers.get("X-Request-Id"))
        reply = error_reply(exc, rid)
        self._metrics.requests.labels("unmatched", str(reply.status)).inc()
        return json_response(reply.body, reply.status, {**reply.headers, "X-Request-Id": rid})

    def _authorize(self) -> None:
        if self._api_key is None:
            return
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), self._api_key):
            return
        key = request.headers.get("x-api-key", "")
        if key and hmac.compare_digest(key.strip().encode(), self._api_key):
            return
        raise Unauthorized("Invalid or missing API key (Authorization: Bearer ... or x-api-key)")
