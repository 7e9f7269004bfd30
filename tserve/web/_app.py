"""The quart-trio app: the route table over one :class:`tserve.LLM`, or several models.

Routes::

    POST /v1/completions, /v1/chat/completions   (JSON or SSE with "stream": true)
    POST /v1/messages, /v1/messages/count_tokens (Anthropic's Messages API, its errors)
    POST /v1/responses   GET, DELETE /v1/responses/{id}   GET /v1/responses/{id}/input_items
    POST /v1/responses/{id}/cancel              (OpenAI's Responses API, its stored responses)
    POST /v1/embeddings                          (when open_llm has an embedding model)
    GET  /v1/models   /v1/models/{id}            POST /tokenize, /detokenize
    GET  /models   POST /models/load, /models/unload   (llama.cpp's router admin routes)
    GET  /version   /health   /ready   /metrics   /openapi.json

Every route that takes a ``model`` finds it through one
:class:`~tserve.web._model_lookup.ModelLookup`. ``/v1/*``, ``/models*``,
``/tokenize`` and ``/detokenize`` need the API key when one is configured;
``/health``, ``/ready``, ``/metrics``, ``/version`` and ``/openapi.json``
stay open.
Quart's ``RESPONSE_TIMEOUT`` is off: it would silently truncate long streams.
"""

from __future__ import annotations

import dataclasses

from quart_trio import QuartTrio

from tserve.nursery import LLM
from tserve.web._browser import BrowserGuard
from tserve.web._embeddings import Embeddings
from tserve.web._errors import anthropic_error_reply
from tserve.web._generation import Generation
from tserve.web._inflight import InFlight
from tserve.web._messages import Messages
from tserve.web._metrics import Metrics, ModelFigures, RequestRecord
from tserve.web._model_lookup import ModelLookup, OneModel
from tserve.web._models import ModelRoutes
from tserve.web._openapi import OpenAPI
from tserve.web._probes import Probes
from tserve.web._reasoning import PARSER_NAMES
from tserve.web._response_store import DEFAULT_STORE_BYTES, DEFAULT_STORE_TTL, ResponseStore
from tserve.web._responses_api import Responses
from tserve.web._routing import Route, Router
from tserve.web._send_buffer import BufferBudget
from tserve.web._tokens import Tokenization

__all__ = ["AppConfig", "Frontend", "create_app"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AppConfig:
    """Frontend options. ``served_model_names`` empty = the model's own name.
    ``allowed_hosts``: ``Host`` names served besides the loopback ones (``*``: any;
    see ``_browser``). ``reasoning_parser``: one of ``PARSER_NAMES`` (see ``_reasoning``)."""

    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 1024 * 1024
    body_timeout: float = 60.0
    request_log: bool = True
    # Stored responses (see _response_store): the directory every API process shares
    # (None: a private one), its budget in bytes, and the age past which one is gone.
    responses_store_dir: str | None = None
    responses_store_bytes: int = DEFAULT_STORE_BYTES
    responses_store_ttl: float = DEFAULT_STORE_TTL
    reasoning_parser: str = "auto"

    def __post_init__(self) -> None:
        if self.reasoning_parser not in PARSER_NAMES:
            raise ValueError(f"reasoning_parser must be one of {', '.join(PARSER_NAMES)}")


class Frontend:
    """The state behind the routes of one app: its models, metrics, handlers and live work.

    ``models``: one LLM (served under ``config.served_model_names``), or a
    :class:`ModelLookup` of several (whose names are its own).
    """

    def __init__(self, models: LLM | ModelLookup, config: AppConfig) -> None:
        if not isinstance(models, ModelLookup):
            models = OneModel(models, config.served_model_names, config.reasoning_parser)
        self.models = models
        self.config = config
        self.in_flight = InFlight()  # what serve()'s drain waits for, then aborts
        self.metrics = self._metrics(models)
        self.probes = Probes(models, self.metrics, self.in_flight)  # serve() sets .started
        self.buffers = BufferBudget()  # the bytes streaming responses hold for their clients
        self.generation = Generation(models, self.in_flight, self.buffers)
        self.messages = Messages(self.generation)
        store = ResponseStore(
            config.responses_store_dir,
            max_bytes=config.responses_store_bytes,
            ttl=config.responses_store_ttl,
        )
        self.responses = Responses(
            self.generation,
            store,
            lambda rid: RequestRecord(
                self.metrics, "/v1/responses", rid, log_line=config.request_log
            ),
        )
        self.embedding = Embeddings(models, self.in_flight)
        self.tokenization = Tokenization(models)
        self.model_routes = ModelRoutes(models)
        self.openapi = OpenAPI(api_key=config.api_key is not None)

    def _metrics(self, models: ModelLookup) -> Metrics:
        count = lambda: self.in_flight.count  # noqa: E731
        if isinstance(models, OneModel):
            llm, ready = models.llm, models.llm.ready
            return Metrics(
                lambda: llm.stats,
                count,
                models.names[0],
                block_size=ready.kv_block_size,
                num_gpu_blocks=ready.kv_tokens_total // max(ready.kv_block_size, 1),
            )
        return Metrics(None, count, models.names[0], models=lambda: _figures(models))

    # -- the route table -----------------------------------------------------------

    def routes(self) -> list[Route]:
        g, t, p, m = self.generation, self.tokenization, self.probes, self.messages
        r = self.responses
        anthropic = anthropic_error_reply
        return [
            Route("/v1/completions", "POST", g.completions, protected=True),
            Route("/v1/chat/completions", "POST", g.chat_completions, protected=True),
            Route("/v1/messages", "POST", m.create, protected=True, errors=anthropic),
            Route(
                "/v1/messages/count_tokens",
                "POST",
                m.count_tokens,
                protected=True,
                errors=anthropic,
            ),
            Route("/v1/responses", "POST", r.create, protected=True),
            Route("/v1/responses/<response_id>", "GET", r.retrieve, protected=True),
            Route("/v1/responses/<response_id>", "DELETE", r.delete, protected=True),
            Route("/v1/responses/<response_id>/input_items", "GET", r.input_items, protected=True),
            Route("/v1/responses/<response_id>/cancel", "POST", r.cancel, protected=True),
            Route("/v1/embeddings", "POST", self.embedding.embeddings, protected=True),
            Route("/v1/models", "GET", self.model_routes.models, protected=True),
            Route("/v1/models/<model_id>", "GET", self.model_routes.model, protected=True),
            Route("/models", "GET", self.model_routes.models, protected=True),
            Route("/models/load", "POST", self.model_routes.load, protected=True),
            Route("/models/unload", "POST", self.model_routes.unload, protected=True),
            Route("/tokenize", "POST", t.tokenize, protected=True),
            Route("/detokenize", "POST", t.detokenize, protected=True),
            Route("/version", "GET", p.version, protected=False),
            Route("/health", "GET", p.health, protected=False, logged=False),
            Route("/ready", "GET", p.ready, protected=False, logged=False),
            Route("/metrics", "GET", p.metrics, protected=False, logged=False),
            Route("/openapi.json", "GET", self.openapi.openapi, protected=False),
        ]


def create_app(
    models: LLM | ModelLookup, config: AppConfig | None = None, *, bind_host: str = "127.0.0.1"
) -> QuartTrio:
    """A quart-trio app serving ``models`` (one LLM, or several: see :class:`Frontend`)
    on ``bind_host`` (for the ``Host`` check); its :class:`Frontend` is
    ``app.extensions["tserve"]``."""
    config = config or AppConfig()
    app = QuartTrio("tserve")
    app.config.update(
        RESPONSE_TIMEOUT=None,  # never truncate a long stream
        BODY_TIMEOUT=config.body_timeout,
        MAX_CONTENT_LENGTH=config.max_body_bytes,
        PROVIDE_AUTOMATIC_OPTIONS=False,
    )
    frontend = Frontend(models, config)
    router = Router(
        frontend.metrics,
        api_key=config.api_key,
        request_log=config.request_log,
        browser=BrowserGuard.for_bind(bind_host, config.allowed_hosts),
    )
    router.install(app, frontend.routes())
    app.extensions["tserve"] = frontend
    return app


def _figures(models: ModelLookup) -> list[ModelFigures]:
    """Every served model's numbers for a scrape (several models)."""
    figures = []
    for status in models.statuses():
        llm = status.llm
        stats, cache = None, {}
        if llm is not None:
            ready = llm.ready
            stats = llm.stats
            blocks = ready.kv_tokens_total // max(ready.kv_block_size, 1)
            cache = {"block_size": str(ready.kv_block_size), "num_gpu_blocks": str(blocks)}
        figures.append(
            ModelFigures(
                status.name,
                status.state.value,
                stats,
                cache,
                loads=status.loads,
                unloads=status.unloads,
                load_seconds=status.load_seconds,
                resident_bytes=status.resident_bytes or 0,
            )
        )
    return figures
