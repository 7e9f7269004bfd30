"""``GET /openapi.json``: an OpenAPI 3.1 description of what this server accepts and returns.

Request bodies are generated from the msgspec Structs of
:mod:`tserve.web._bodies` (``msgspec.json.schema_components``), so the
description cannot drift from the decoder: a body the schema allows decodes,
and a body it refuses is a 400. Rules across fields (``n`` times the prompts,
refused features, token ids against the vocabulary, the context length) are
not expressible in the schema: they are 400s, documented as such.

Responses are written here, next to what writes them (:mod:`._responses`,
:mod:`._errors`); every error is the one OpenAI error body, but on the
Messages routes, Anthropic's (``AnthropicError``). ``OPERATIONS`` is
keyed by (method, path) and must cover the route table exactly (a test checks);
a route's ``<name>`` is the document's path parameter ``{name}``.
Sans-IO: the document is built once, as a dict.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Final

import msgspec
from quart import Response

import tserve
from tserve.web._bodies import (
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    EmbeddingBody,
    ModelAdminBody,
    TokenizeBody,
)
from tserve.web._message_bodies import CountTokensBody, MessagesBody
from tserve.web._metrics import RequestRecord
from tserve.web._response_bodies import ResponsesBody
from tserve.web._routing import json_response

__all__ = ["OPERATIONS", "OpenAPI", "Operation", "openapi_document"]

JSON = dict[str, Any]

_REF = "#/components/schemas/{name}"


def _object(required: str, **properties: JSON) -> JSON:
    """An object schema: ``required`` names its required keys, space-separated."""
    return {"type": "object", "required": required.split(), "properties": properties}


def _list_of(item: JSON) -> JSON:
    return {"type": "array", "items": item}


_STR: Final[JSON] = {"type": "string"}
_NULLABLE_STR: Final[JSON] = {"type": ["string", "null"]}
_INT: Final[JSON] = {"type": "integer"}
_STATE: Final[JSON] = {"enum": ["unloaded", "loading", "loaded", "unloading", "failed"]}
_USAGE_REF: Final[JSON] = {"$ref": _REF.format(name="Usage")}
_ERROR: Final = _object(
    "error",
    error=_object(
        "message type param code",
        message=_STR,
        type=_STR,
        param=_NULLABLE_STR,
        code=_NULLABLE_STR,
    ),
)
_ANTHROPIC_ERROR: Final = _object(
    "type error",
    type={"const": "error"},
    error=_object("type message", type=_STR, message=_STR),
)
_MESSAGE: Final = _object(  # a whole Messages API message
    "id type role model content stop_reason stop_sequence usage",
    id=_STR,
    type={"const": "message"},
    role={"const": "assistant"},
    model=_STR,
    content=_list_of(_object("type", type={"enum": ["text", "tool_use"]})),
    stop_reason={"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use", None]},
    stop_sequence=_NULLABLE_STR,
    usage=_object("input_tokens output_tokens", input_tokens=_INT, output_tokens=_INT),
)
_RESPONSE: Final = _object(  # a whole Responses API response
    "id object created_at status model output usage",
    id=_STR,
    object={"const": "response"},
    created_at=_INT,
    status={"enum": ["completed", "incomplete", "failed", "cancelled", "queued", "in_progress"]},
    model=_STR,
    output=_list_of(_object("type id", type={"enum": ["message", "function_call"]}, id=_STR)),
    usage={
        "anyOf": [
            _object(
                "input_tokens output_tokens total_tokens input_tokens_details",
                input_tokens=_INT,
                output_tokens=_INT,
                total_tokens=_INT,
                input_tokens_details=_object("cached_tokens", cached_tokens=_INT),
            ),
            {"type": "null"},
        ]
    },
    previous_response_id=_NULLABLE_STR,
)
_INPUT_ITEMS: Final = _object(
    "object data first_id last_id has_more",
    object={"const": "list"},
    data=_list_of(_object("type id", type=_STR, id=_STR)),
    first_id=_NULLABLE_STR,
    last_id=_NULLABLE_STR,
    has_more={"type": "boolean"},
)
_USAGE: Final = _object(
    "prompt_tokens total_tokens", prompt_tokens=_INT, completion_tokens=_INT, total_tokens=_INT
)
_GENERATED: Final = _object(  # a whole completion or chat completion
    "id object created model choices usage",
    id=_STR,
    object={"enum": ["text_completion", "chat.completion"]},
    created=_INT,
    model=_STR,
    choices=_list_of(
        _object("index logprobs finish_reason", index=_INT, finish_reason=_NULLABLE_STR)
    ),
    usage=_USAGE_REF,
)
_EMBEDDINGS: Final = _object(
    "object data model usage",
    object={"const": "list"},
    data=_list_of(
        _object(
            "object index embedding",
            index=_INT,
            embedding={"anyOf": [_list_of({"type": "number"}), _STR]},  # float or base64
        )
    ),
    model=_STR,
    usage=_USAGE_REF,
)
_MODELS: Final = _object(
    "object data",
    object={"const": "list"},
    data=_list_of(
        _object(
            "id object created owned_by state",
            id=_STR,
            max_model_len=_INT,
            state=_STATE,
            status=_object("value", value=_STATE),
            reason=_STR,
        )
    ),
)
_TOKENS: Final = _object(
    "tokens count max_model_len", tokens=_list_of(_INT), count=_INT, max_model_len=_INT
)
_STATUS: Final = _object("status", status=_STR)
_READY: Final = _object(
    "status", status=_STR, models={"type": "object", "additionalProperties": _STATE}
)
_ADMIN: Final = _object("success model", success={"type": "boolean"}, model=_STR)

_WHY: Final = {
    400: "invalid request: malformed JSON, a wrong type, a value out of range, an "
    "unsupported feature (the field is named in error.param where there is one)",
    401: "a missing or wrong API key",
    403: "a Host header that is not allowed",
    404: "an unknown model, or no embedding model; an unknown, deleted, evicted or "
    "expired stored response",
    413: "a body larger than --max-body-bytes",
    415: "a body that is not application/json",
    422: "the engine refused this one request",
    503: "overloaded, draining, the engine is not running, or the model failed to load "
    "or did not load within --model-load-timeout (Retry-After)",
    504: "the request ran past --request-timeout",
    529: "overloaded, draining, or the engine is not running (Retry-After; Anthropic's "
    "overloaded_error, where the OpenAI routes answer 503)",
}
_EVERY: Final = (403,)  # what any route may answer besides its own statuses
_POST: Final = (400, 401, 413, 415)  # every POST with a body, behind the key


@dataclasses.dataclass(frozen=True, slots=True)
class Operation:
    """One operation: its summary, request body Struct, 200 schema and error statuses."""

    summary: str
    ok: JSON  # the 200 content, by media type
    body: type[msgspec.Struct] | None = None
    errors: tuple[int, ...] = ()
    protected: bool = True  # needs the API key when the server has one
    anthropic: bool = False  # its errors are Anthropic's body (the Messages routes)
    query: tuple[tuple[str, JSON], ...] = ()  # query parameters: (name, schema)


def _json(schema: JSON) -> JSON:
    return {"application/json": {"schema": schema}}


_SSE_EVENT: Final = _object("data", data=_STR)  # each event: a chunk, an error, or [DONE]
_GENERATION_OK: Final = {
    **_json(_GENERATED),
    "text/event-stream": {"schema": _SSE_EVENT},  # with "stream": true
}

OPERATIONS: Final[dict[tuple[str, str], Operation]] = {
    ("post", "/v1/completions"): Operation(
        "Complete a prompt", _GENERATION_OK, CompletionBody, (*_POST, 404, 422, 503, 504)
    ),
    ("post", "/v1/chat/completions"): Operation(
        "Complete a chat", _GENERATION_OK, ChatBody, (*_POST, 404, 422, 503, 504)
    ),
    ("post", "/v1/messages"): Operation(
        "Create a message (Anthropic's Messages API)",
        {**_json(_MESSAGE), "text/event-stream": {"schema": _object("event data", data=_STR)}},
        MessagesBody,
        (*_POST, 404, 422, 504, 529),
        anthropic=True,
    ),
    ("post", "/v1/messages/count_tokens"): Operation(
        "Count a message request's input tokens (Anthropic's Messages API)",
        _json(_object("input_tokens", input_tokens=_INT)),
        CountTokensBody,
        (*_POST, 404),
        anthropic=True,
    ),
    ("post", "/v1/responses"): Operation(
        "Create a response (OpenAI's Responses API; background: true answers at once)",
        {**_json(_RESPONSE), "text/event-stream": {"schema": _object("event data", data=_STR)}},
        ResponsesBody,
        (*_POST, 404, 422, 503, 504),
    ),
    ("get", "/v1/responses/<response_id>"): Operation(
        "A stored response", _json(_RESPONSE), None, (401, 404)
    ),
    ("delete", "/v1/responses/<response_id>"): Operation(
        "Delete a stored response",
        _json(
            _object(
                "id object deleted",
                id=_STR,
                object={"const": "response"},
                deleted={"const": True},
            )
        ),
        None,
        (401, 404),
    ),
    ("get", "/v1/responses/<response_id>/input_items"): Operation(
        "A stored response's input items, a page at a time",
        _json(_INPUT_ITEMS),
        None,
        (400, 401, 404),
        query=(
            ("order", {"enum": ["asc", "desc"]}),
            ("limit", {"type": "integer", "minimum": 1, "maximum": 100}),
            ("after", _STR),
        ),
    ),
    ("post", "/v1/responses/<response_id>/cancel"): Operation(
        "Cancel a background response (its engine request is aborted)",
        _json(_RESPONSE),
        None,
        (400, 401, 404, 415),  # a POST, so declared JSON even without a body
    ),
    ("post", "/v1/embeddings"): Operation(
        "Embed texts or token ids", _json(_EMBEDDINGS), EmbeddingBody, (*_POST, 404, 422, 503, 504)
    ),
    ("get", "/v1/models"): Operation("The served models", _json(_MODELS), None, (401,)),
    ("get", "/v1/models/<model_id>"): Operation(
        "One served model", _json(_MODELS["properties"]["data"]["items"]), None, (401, 404)
    ),
    ("get", "/models"): Operation(
        "The served models (llama.cpp's router name)", _json(_MODELS), None, (401,)
    ),
    ("post", "/models/load"): Operation(
        "Load a model; returns once it is loaded", _json(_ADMIN), ModelAdminBody, (*_POST, 404, 503)
    ),
    ("post", "/models/unload"): Operation(
        "Unload a model once no request holds it; returns once its engine is gone",
        _json(_ADMIN),
        ModelAdminBody,
        (*_POST, 404),
    ),
    ("post", "/tokenize"): Operation(
        "A prompt or chat as token ids", _json(_TOKENS), TokenizeBody, (*_POST, 404)
    ),
    ("post", "/detokenize"): Operation(
        "Token ids as text",
        _json(_object("prompt", prompt=_STR)),
        DetokenizeBody,
        (*_POST, 404),
    ),
    ("get", "/version"): Operation(
        "The server's version",
        _json(_object("version", version=_STR)),
        protected=False,
    ),
    ("get", "/health"): Operation("Liveness", _json(_STATUS), None, (503,), protected=False),
    ("get", "/ready"): Operation("Readiness", _json(_READY), None, (503,), protected=False),
    ("get", "/metrics"): Operation(
        "Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}}, protected=False
    ),
    ("get", "/openapi.json"): Operation(
        "This description", _json(_object("openapi paths", openapi=_STR)), protected=False
    ),
}


def _operation(op: Operation, path: str, bodies: dict[type[msgspec.Struct], JSON]) -> JSON:
    error = _json({"$ref": _REF.format(name="AnthropicError" if op.anthropic else "Error")})
    responses: JSON = {"200": {"description": "OK", "content": op.ok}}
    for status in sorted({*op.errors, *_EVERY}):
        # 503 from /health and /ready is a status body, not an error body
        content = _json(_STATUS) if status == 503 and op.body is None else error
        responses[str(status)] = {"description": _WHY[status], "content": content}
    out: JSON = {"summary": op.summary, "responses": responses}
    parameters = [
        {"name": name, "in": "path", "required": True, "schema": _STR}
        for name in re.findall(r"<([a-z_]+)>", path)
    ]
    parameters += [
        {"name": name, "in": "query", "required": False, "schema": schema}
        for name, schema in op.query
    ]
    if parameters:
        out["parameters"] = parameters
    if op.body is not None:
        out["requestBody"] = {"required": True, "content": _json(bodies[op.body])}
    if not op.protected:
        out["security"] = []
    return out


def openapi_document(*, api_key: bool) -> JSON:
    """The whole description; ``api_key``: whether protected routes need a key (a bearer
    token, or the key alone in ``x-api-key``)."""
    kinds = sorted({op.body for op in OPERATIONS.values() if op.body}, key=lambda t: t.__name__)
    refs, components = msgspec.json.schema_components(kinds, ref_template=_REF)
    bodies = dict(zip(kinds, refs, strict=True))
    components.update(Error=_ERROR, AnthropicError=_ANTHROPIC_ERROR, Usage=_USAGE)
    paths: JSON = {}
    for (method, path), op in OPERATIONS.items():
        shown = re.sub(r"<([a-z_]+)>", r"{\1}", path)
        paths.setdefault(shown, {})[method] = _operation(op, path, bodies)
    doc: JSON = {
        "openapi": "3.1.0",
        "info": {"title": "tserve", "version": tserve.__version__},
        "paths": paths,
        "components": {"schemas": components},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
        }
        doc["security"] = [{"bearer": []}, {"apiKey": []}]
    return doc


class OpenAPI:
    """The handler of ``GET /openapi.json``: the document, built once."""

    def __init__(self, *, api_key: bool) -> None:
        self._doc = openapi_document(api_key=api_key)

    async def openapi(self, record: RequestRecord) -> Response:
        return json_response(self._doc)
