"""The quart-trio app: OpenAI routes over one :class:`tserve.LLM`.

Routes::

    POST /v1/completions, /v1/chat/completions   (JSON or SSE with "stream": true)
    POST /v1/embeddings                          (when open_llm has an embedding model)
    GET  /v1/models                              POST /tokenize, /detokenize
    GET  /version   /health   /ready   /metrics

Every response carries ``X-Request-Id`` (the client's, if it sent a sane one,
else a fresh one). With an API key configured, ``/v1/*``, ``/tokenize`` and
``/detokenize`` need ``Authorization: Bearer KEY`` (compared in constant
time); ``/health``, ``/ready``, ``/metrics`` and ``/version`` stay open so that
probes and scrapers need no secret (metrics hold counts, never content).

Errors anywhere become OpenAI error JSON through :func:`error_reply`.
Quart's ``RESPONSE_TIMEOUT`` is off: it would silently truncate long streams.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import re
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import msgspec
import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

import tserve
from tserve.nursery import (
    LLM,
    EngineDeadError,
    InvalidRequest,
    RequestStream,
    ShuttingDown,
)
from tserve.web._errors import ModelNotFound, NotFound, Unauthorized, error_reply
from tserve.web._metrics import CONTENT_TYPE, Metrics, RequestRecord
from tserve.web._requests import (
    ChatRequest,
    CompletionRequest,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_embeddings,
    parse_tokenize,
)
from tserve.web._responses import (
    ChatChoice,
    CompletionChoice,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    embedding_response,
    total_usage,
    usage_chunk,
)
from tserve.web._streaming import Choice, SSEBody, closed_on_error, collect, first_deltas

__all__ = ["AppConfig", "Frontend", "create_app"]

log = logging.getLogger("tserve.web")

_SANE_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_JSON = msgspec.json.Encoder()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AppConfig:
    """Frontend options. ``served_model_names`` empty = the model's own name."""

    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    body_timeout: float = 60.0
    request_log: bool = True


def _json(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        _JSON.encode(payload), status=status, headers=headers, content_type="application/json"
    )


class Frontend:
    """The state behind the routes of one app: its LLM, metrics and live streams."""

    def __init__(self, llm: LLM, config: AppConfig) -> None:
        self.llm = llm
        self.config = config
        self.metrics = Metrics(lambda: llm.stats, lambda: self.in_flight)
        self.model_names = config.served_model_names or (llm.model,)
        self.started = False  # set by serve() once it listens
        self.created = int(time.time())
        self._api_key = None if config.api_key is None else config.api_key.encode()
        # Live work that abort_all() must end: SSE bodies and handler scopes.
        # Weak: a body that quart drops without entering it (its client left
        # in between) leaves the set by itself.
        self._live_bodies: weakref.WeakSet[SSEBody] = weakref.WeakSet()
        self._live_scopes: set[trio.CancelScope] = set()
        self._aborting: Exception | None = None
        self._idle_changed = trio.Event()  # set (and replaced) when a generation ends
        # id -> text of one token; bounded by the vocabulary size.
        self._token_texts: dict[int, str] = {}

    # -- lifecycle, for serve() ----------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Generation requests (streaming or not) that have not ended."""
        return len(self._live_bodies) + len(self._live_scopes)

    async def wait_idle(self) -> None:
        """Return once no generation is in flight. A checkpoint."""
        while self.in_flight:
            self._idle_changed = trio.Event()
            await self._idle_changed.wait()

    def _ended(self) -> None:
        self._idle_changed.set()

    def _body_closed(self, body: SSEBody) -> None:
        self._live_bodies.discard(body)
        self._ended()

    def abort_all(self, reason: Exception) -> None:
        """End every live generation now with ``reason``. Synchronous.

        Streams end with ``reason`` as their final SSE error event; non-
        streaming requests answer with its error JSON. Later ones too.
        """
        self._aborting = reason
        for body in list(self._live_bodies):
            body.abort(reason)
        for scope in list(self._live_scopes):
            scope.cancel()

    # -- plumbing ------------------------------------------------------------------

    def install(self, app: QuartTrio) -> None:
        routes: list[tuple[str, str, Callable[[RequestRecord], Awaitable[Response]], bool]] = [
            ("/v1/completions", "POST", self.completions, True),
            ("/v1/chat/completions", "POST", self.chat_completions, True),
            ("/v1/embeddings", "POST", self.embeddings, True),
            ("/v1/models", "GET", self.models, True),
            ("/tokenize", "POST", self.tokenize, True),
            ("/detokenize", "POST", self.detokenize, True),
            ("/version", "GET", self.version, False),
            ("/health", "GET", self.health, False),
            ("/ready", "GET", self.ready, False),
            ("/metrics", "GET", self.metrics_text, False),
        ]
        for path, method, handler, protected in routes:
            logged = path not in ("/health", "/ready", "/metrics")
            view = partial(self._view, path, handler, protected, logged)
            app.add_url_rule(path, path, view, methods=[method])
        app.register_error_handler(HTTPException, self._http_error)

    async def _view(
        self,
        route: str,
        handler: Callable[[RequestRecord], Awaitable[Response]],
        protected: bool,
        logged: bool,
    ) -> Response:
        rid = _request_id(request.headers.get("X-Request-Id"))
        record = RequestRecord(
            self.metrics, route, rid, log_line=logged and self.config.request_log
        )
        status = 499  # the client went away (cancelled) unless set below
        try:
            if protected:
                self._authorize()
            response = await handler(record)
            status = response.status_code
        except Exception as exc:
            reply = error_reply(exc, rid)
            status = reply.status
            response = _json(reply.body, reply.status, reply.headers)
            if status == 413:  # the rest of the body is unread: the connection is spent
                response.headers["Connection"] = "close"
        finally:
            if not record.streaming:
                record.done(status)
        response.headers["X-Request-Id"] = rid
        return response

    async def _http_error(self, exc: HTTPException) -> Response:
        """Routing errors (404, 405) raised before any view runs."""
        rid = _request_id(request.headers.get("X-Request-Id"))
        reply = error_reply(exc, rid)
        self.metrics.requests.labels("unmatched", str(reply.status)).inc()
        return _json(reply.body, reply.status, {**reply.headers, "X-Request-Id": rid})

    def _authorize(self) -> None:
        if self._api_key is None:
            return
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            key.strip().encode(), self._api_key
        ):
            raise Unauthorized("Invalid or missing API key (Authorization: Bearer ...)")

    def _model(self, name: str | None) -> str:
        if name is None:
            return self.model_names[0]
        if name not in self.model_names:
            raise ModelNotFound(f"The model '{name}' does not exist", param="model")
        return name

    def _precheck(self, count: int) -> None:
        """Refuse at once what admission would refuse, before any tokenizing."""
        if not self.llm.engine_alive:
            raise EngineDeadError("the engine is not running")
        if self._aborting is not None:
            raise ShuttingDown("the server is shutting down")
        self.llm.check_admission(count)

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.llm.decode([token_id])
        return text

    async def _body(self) -> bytes:
        data = await request.get_data(cache=False)
        return data if isinstance(data, bytes) else data.encode()

    # -- generation ----------------------------------------------------------------

    async def completions(self, record: RequestRecord) -> Response:
        req = parse_completion(await self._body())
        model = self._model(req.model)
        self._precheck(len(req.prompts) * req.n)
        return await self._abortable(partial(self._completions, record, req, model))

    async def chat_completions(self, record: RequestRecord) -> Response:
        req = parse_chat(await self._body())
        model = self._model(req.model)
        self._precheck(req.n)
        return await self._abortable(partial(self._chat_completions, record, req, model))

    async def _abortable(self, work: Callable[[], Awaitable[Response]]) -> Response:
        """Run ``work`` so that abort_all() ends it with its reason (a 503).

        A streaming response's body registers itself before ``work`` returns,
        so a request is in flight without a gap until its body is closed.
        """
        with trio.CancelScope() as scope:
            self._live_scopes.add(scope)
            try:
                if self._aborting is not None:
                    scope.cancel()
                return await work()
            finally:
                self._live_scopes.discard(scope)
                self._ended()
        raise self._aborting or ShuttingDown("the server is shutting down")

    async def _completions(
        self, record: RequestRecord, req: CompletionRequest, model: str
    ) -> Response:
        streams = await self._start_completion(req)
        prefixes = await self._echo_prefixes(req)
        logprobs = req.logprobs is not None
        choices = [
            CompletionChoice(i, self._token_text, logprobs=logprobs, prefix=prefixes[i // req.n])
            for i in range(len(streams))
        ]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            chunk = partial(completion_chunk, rid, created, model, include_usage=req.include_usage)
            usage = partial(usage_chunk, rid, created, model, "text_completion")
            return await self._stream(record, streams, choices, chunk, usage, req)
        await collect(streams, choices, record)
        usage_total = total_usage(choices, req.n)
        return _json(completion_response(rid, created, model, choices, usage_total))

    async def _chat_completions(
        self, record: RequestRecord, req: ChatRequest, model: str
    ) -> Response:
        streams = await self._start_chat(req)
        logprobs = req.logprobs is not None
        choices = [ChatChoice(i, self._token_text, logprobs=logprobs) for i in range(len(streams))]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            chunk = partial(chat_chunk, rid, created, model, include_usage=req.include_usage)
            usage = partial(usage_chunk, rid, created, model, "chat.completion.chunk")
            return await self._stream(record, streams, choices, chunk, usage, req)
        await collect(streams, choices, record)
        return _json(chat_response(rid, created, model, choices, total_usage(choices, req.n)))

    async def _start_completion(self, req: CompletionRequest) -> list[RequestStream]:
        """Admit ``n`` streams per prompt; a prompt used ``n > 1`` times is tokenized once."""
        streams: list[RequestStream] = []
        with closed_on_error(streams):
            for prompt in req.prompts:
                source: str | list[int] = prompt
                if req.n > 1 and isinstance(prompt, str):
                    source = await self.llm.tokenize(prompt)
                streams.extend(self.llm.generate(source, req.params) for _ in range(req.n))
        return streams

    async def _start_chat(self, req: ChatRequest) -> list[RequestStream]:
        """Admit ``n`` streams. Without max_tokens, the rest of the context is the limit."""
        if req.max_tokens is not None and req.n == 1:
            return [self.llm.chat(req.messages, req.params)]
        ids = await self.llm.tokenize_chat(req.messages)
        params = req.params
        if req.max_tokens is None:
            room = max(1, self.llm.ready.max_model_len - len(ids))
            params = msgspec.structs.replace(params, max_tokens=room)
        streams: list[RequestStream] = []
        with closed_on_error(streams):
            streams.extend(self.llm.generate(ids, params) for _ in range(req.n))
        return streams

    async def _echo_prefixes(self, req: CompletionRequest) -> list[str]:
        if not req.echo:
            return [""] * len(req.prompts)
        out = []
        for prompt in req.prompts:
            if isinstance(prompt, str):
                out.append(prompt)
            else:
                out.append(await trio.to_thread.run_sync(self.llm.decode, prompt))
        return out

    async def _stream(
        self,
        record: RequestRecord,
        streams: list[RequestStream],
        choices: Sequence[Choice],
        chunk: Callable[[dict[str, Any]], dict[str, Any]],
        usage: Callable[[Any], dict[str, Any]],
        req: CompletionRequest | ChatRequest,
    ) -> Response:
        firsts = await first_deltas(streams)
        body = SSEBody(
            streams,
            choices,
            firsts,
            chunk=chunk,
            usage_chunk=usage if req.include_usage else None,
            n=req.n,
            record=record,
            on_close=self._body_closed,
        )
        self._live_bodies.add(body)
        if self._aborting is not None:
            body.abort(self._aborting)
        record.streaming = True
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return Response(body, content_type="text/event-stream", headers=headers)

    # -- embeddings --------------------------------------------------------------------

    async def embeddings(self, record: RequestRecord) -> Response:
        """``/v1/embeddings``: one engine request per input, all in one batch when they fit."""
        req = parse_embeddings(await self._body())
        embedder = self.llm.embedder
        if embedder is None:
            raise NotFound("This server has no embedding model (see --embedding-model)")
        model = embedder.model
        if req.model is not None and req.model != model:
            raise ModelNotFound(
                f"The model '{req.model}' does not exist or does not embed; this server "
                f"embeds with '{model}'",
                param="model",
            )
        if req.dimensions is not None and req.dimensions != embedder.dimensions:
            raise InvalidRequest(
                f"'dimensions' must be {embedder.dimensions} for {model}: its vectors "
                "cannot be shortened",
                param="dimensions",
            )

        async def work() -> Response:
            result = await self.llm.embed(req.inputs)
            record.embedded(len(req.inputs), result.prompt_tokens)
            return _json(embedding_response(model, result, req.encoding_format))

        return await self._abortable(work)

    # -- the other routes ------------------------------------------------------------

    async def models(self, record: RequestRecord) -> Response:
        data = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "tserve",
                "max_model_len": self.llm.ready.max_model_len,
            }
            for name in self.model_names
        ]
        embedder = self.llm.embedder
        if embedder is not None:
            data.append(
                {
                    "id": embedder.model,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "tserve",
                    "max_model_len": embedder.max_input_tokens,
                }
            )
        return _json({"object": "list", "data": data})

    async def tokenize(self, record: RequestRecord) -> Response:
        req = parse_tokenize(await self._body())
        self._model(req.model)
        if req.messages is not None:
            ids = await self.llm.tokenize_chat(req.messages)
        else:
            ids = await self.llm.tokenize(req.prompt or "")
        limit = self.llm.ready.max_model_len
        return _json({"tokens": ids, "count": len(ids), "max_model_len": limit})

    async def detokenize(self, record: RequestRecord) -> Response:
        req = parse_detokenize(await self._body())
        self._model(req.model)
        vocab = self.llm.ready.vocab_size
        for i, t in enumerate(req.tokens):
            if t >= vocab:
                raise InvalidRequest(f"token id {t} is not below {vocab}", param=f"tokens[{i}]")
        text = await trio.to_thread.run_sync(self.llm.decode, req.tokens)
        return _json({"prompt": text})

    async def version(self, record: RequestRecord) -> Response:
        return _json({"version": tserve.__version__})

    async def health(self, record: RequestRecord) -> Response:
        """Liveness, from memory only: 503 once the engine is dead."""
        if self.llm.engine_alive:
            return _json({"status": "ok"})
        return _json({"status": "engine dead"}, 503)

    async def ready(self, record: RequestRecord) -> Response:
        """Readiness: 503 while starting, draining, dead or saturated."""
        llm = self.llm
        if not self.started:
            state = "starting"
        elif not llm.engine_alive:
            state = "engine dead"
        elif llm.draining or self._aborting is not None:
            state = "draining"
        elif llm.stats.live_requests >= llm.max_pending:
            state = "saturated"
        else:
            return _json({"status": "ready"})
        return _json({"status": state}, 503)

    async def metrics_text(self, record: RequestRecord) -> Response:
        return Response(self.metrics.render(), content_type=CONTENT_TYPE)


def _request_id(header: str | None) -> str:
    if header is not None and _SANE_ID.fullmatch(header):
        return header
    return uuid.uuid4().hex


def create_app(llm: LLM, config: AppConfig | None = None) -> QuartTrio:
    """A quart-trio app serving ``llm``; its :class:`Frontend` is ``app.extensions["tserve"]``."""
    config = config or AppConfig()
    app = QuartTrio("tserve")
    app.config.update(
        RESPONSE_TIMEOUT=None,  # never truncate a long stream
        BODY_TIMEOUT=config.body_timeout,
        MAX_CONTENT_LENGTH=config.max_body_bytes,
        PROVIDE_AUTOMATIC_OPTIONS=False,
    )
    frontend = Frontend(llm, config)
    frontend.install(app)
    app.extensions["tserve"] = frontend
    return app
