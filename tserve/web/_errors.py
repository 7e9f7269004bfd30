"""The one place where exceptions become error JSON and an HTTP status.

OpenAI's body (:func:`error_reply`): ``{"error": {"message", "type",
"param", "code"}}``. The table:

======================================  ======  ==========================
exception                               status  type / code
======================================  ======  ==========================
InvalidRequest, malformed JSON          400     invalid_request_error
RecursionError (input nested too deep)  400     invalid_request_error / nested_too_deeply
Unauthorized (bad or missing API key)   401     invalid_request_error / invalid_api_key
ForbiddenHost (``Host`` not served)     403     invalid_request_error / forbidden_host
NotFound (unknown model or route)       404     invalid_request_error / model_not_found, not_found
method not allowed                      405     invalid_request_error / method_not_allowed
body larger than the configured limit   413     invalid_request_error / payload_too_large
UnsupportedMediaType (POST, not JSON)   415     invalid_request_error / unsupported_media_type
RequestFailed (the engine failed ONE    422     invalid_request_error / request_failed
request, e.g. a per-request fault)
Overloaded                              503     server_error / overloaded, ``Retry-After``
ShuttingDown (draining)                 503     server_error / shutting_down, ``Retry-After``
RequestAborted (engine aborted it)      503     server_error / request_aborted, ``Retry-After``
ModelLoadError (its model's load        503     server_error / model_load_failed, ``Retry-After``
failed; the next request retries)
ModelLoadTimeout (past                  503     server_error / model_load_timeout, ``Retry-After``
``--model-load-timeout``)
EngineDeadError                         503     server_error / engine_dead, ``Retry-After``
RequestTimeout                          504     server_error / timeout
anything else: a bug                    500     server_error / internal_error (logged with
                                                its traceback and the request id)
======================================  ======  ==========================

Anthropic's body (:func:`anthropic_error_reply`, the Messages API):
``{"type": "error", "error": {"type", "message"}}``, made from the OpenAI
reply: the same status but 503 (overloaded, draining, engine down), which
is Anthropic's 529 ``overloaded_error``; the type by status (400, 415 and 422
``invalid_request_error``, 401 ``authentication_error``, 403
``permission_error``, 404 ``not_found_error``, 405 ``invalid_request_error``,
413 ``request_too_large``, 429 ``rate_limit_error``, 504 ``timeout_error``,
else ``api_error``); the field, when the message does not quote it already,
appended to the message (Anthropic's body has no ``param``).

Why 422 for RequestFailed: input the API process can check (prompt too long,
token ids out of the vocabulary, bad parameters) is already a 400 before the
engine sees it; what the engine still refuses per request is about this
request alone and would fail again if retried, so it must not be a 5xx (the
SDK retries those), yet it is not a malformed request either.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any, Final

from werkzeug.exceptions import HTTPException

from tserve.nursery import (
    EngineDeadError,
    InvalidRequest,
    Overloaded,
    RequestFailed,
    RequestTimeout,
    ShuttingDown,
)

__all__ = [
    "ErrorReply",
    "ErrorShape",
    "ForbiddenHost",
    "ModelLoadError",
    "ModelLoadTimeout",
    "ModelNotFound",
    "NotFound",
    "RequestAborted",
    "Unauthorized",
    "UnsupportedMediaType",
    "WebError",
    "anthropic_error_reply",
    "error_reply",
]

log = logging.getLogger("tserve.web")


class WebError(Exception):
    """An error of the HTTP layer itself, carrying its status and OpenAI code."""

    status = 400
    code: str | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Unauthorized(WebError):
    status = 401
    code = "invalid_api_key"


class ForbiddenHost(WebError):
    """A ``Host`` this server does not answer to (DNS rebinding; see ``_browser``)."""

    status = 403
    code = "forbidden_host"


class UnsupportedMediaType(WebError):
    """A POST whose body is not declared JSON (a cross-site form; see ``_browser``)."""

    status = 415
    code = "unsupported_media_type"


class NotFound(WebError):
    status = 404
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class ModelLoadError(WebError):
    """The request's model could not be loaded; the message names it. The next request retries."""

    status = 503
    code = "model_load_failed"


class ModelLoadTimeout(WebError):
    """The request's model did not load within ``--model-load-timeout``."""

    status = 503
    code = "model_load_timeout"


class RequestAborted(WebError):
    """The engine aborted the request on its own (its deadline, or it is stopping)."""

    status = 503
    code = "request_aborted"


@dataclasses.dataclass(frozen=True, slots=True)
class ErrorReply:
    status: int
    body: dict[str, Any]
    headers: dict[str, str]


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}


def _body(message: str, type_: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def error_reply(exc: BaseException, request_id: str) -> ErrorReply:
    """Status, OpenAI error body and headers for ``exc``. Never raises.

    Anything unexpected is a 500 that names ``request_id``; it is logged here
    with its traceback.
    """
    client = "invalid_request_error"
    server = "server_error"
    match exc:
        case InvalidRequest():
            return ErrorReply(400, _body(str(exc), client, exc.param, None), {})
        case WebError():
            headers = _retry_after(1) if exc.status == 503 else {}
            type_ = server if exc.status >= 500 else client
            return ErrorReply(exc.status, _body(str(exc), type_, exc.param, exc.code), headers)
        case HTTPException():
            status = exc.code or 500
            code = _HTTP_CODES.get(status)
            message = exc.description or exc.name
            return ErrorReply(status, _body(message, client, None, code), {})
        case RequestFailed():
            return ErrorReply(422, _body(str(exc), client, exc.param, "request_failed"), {})
        case Overloaded():
            body = _body(f"The server is overloaded: {exc}", server, None, "overloaded")
            return ErrorReply(503, body, _retry_after(exc.retry_after))
        case ShuttingDown():
            body = _body(f"The server is shutting down: {exc}", server, None, "shutting_down")
            return ErrorReply(503, body, _retry_after(1))
        case EngineDeadError():
            body = _body(f"The engine is not running: {exc}", server, None, "engine_dead")
            return ErrorReply(503, body, _retry_after(5))
        case RequestTimeout():
            return ErrorReply(504, _body(str(exc), server, None, "timeout"), {})
        case RecursionError():  # only input nests without bound; logged in case it was not
            log.warning("request %s: %s", request_id, exc)
            message = "The request is nested too deeply to process"
            return ErrorReply(400, _body(message, client, None, "nested_too_deeply"), {})
    log.error("internal error in request %s", request_id, exc_info=exc)
    message = f"Internal server error (request id {request_id})"
    return ErrorReply(500, _body(message, server, None, "internal_error"), {})


ErrorShape = Callable[[BaseException, str], ErrorReply]
"""An API's mapping of an exception (and the request id) to its error reply."""

_ANTHROPIC_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}
ANTHROPIC_OVERLOADED: Final = 529


def anthropic_error_reply(exc: BaseException, request_id: str) -> ErrorReply:
    """Status, Anthropic error body and headers for ``exc`` (the module docstring). Never raises."""
    reply = error_reply(exc, request_id)
    status = ANTHROPIC_OVERLOADED if reply.status == 503 else reply.status
    error = reply.body["error"]
    message, param = str(error["message"]), error.get("param")
    if param and f"'{param}'" not in message:
        message = f"{message} ('{param}')"
    body = {
        "type": "error",
        "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message},
    }
    return ErrorReply(status, body, reply.headers)
