"""Prometheus metrics of one app, in its own CollectorRegistry (no global state).

Two kinds of number, read two ways:

* Request metrics (HTTP requests, tokens, successes, latency histograms) are
  counted by the request handlers through :class:`RequestRecord`. With
  ``--api-processes N`` every API process writes them to memory-mapped files
  in one shared directory (prometheus-client's multiprocess mode, on when
  :data:`SHARED_DIR_ENV` was set before ``prometheus_client`` was first
  imported: ``tserve._metrics_dir`` makes it), and a scrape of any process sums them over all.
* Engine metrics (running, waiting, KV usage, steps, prefix cache) are read
  from ``LLM.stats``, the engine's latest report, at scrape time by a
  collector, so nothing polls; every API process holds the same report.
  The metrics process of ``--metrics-port`` renders the same families from
  :func:`request_registry` and :func:`engine_registry`: the engine's
  numbers and the live counts from the stats files the API processes write
  (``_stats_files``).

The model-server contract carries vLLM's names and a ``model_name`` label
(``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``, ...), so
dashboards and endpoint pickers built for vLLM read them unchanged; tserve's
own numbers stay under ``tserve_``. With several models (:class:`ModelFigures`),
every engine family has one sample per loaded model, each with its
``model_name`` (tserve's own too), the request metrics count under the
request's model, and per-model families add each model's state, loads,
unloads, last load time and engines' resident bytes. A scrape never blocks on the engine: it
reads memory (and, in multiprocess mode, small files in a memory-backed
directory).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from tserve.nursery import Delta, LLMStats

__all__ = [
    "CONTENT_TYPE",
    "FINISHED_REASONS",
    "EngineCollector",
    "LiveNumbers",
    "Metrics",
    "ModelFigures",
    "RequestRecord",
    "engine_registry",
    "request_registry",
]

access_log = logging.getLogger("tserve.access")

CONTENT_TYPE = CONTENT_TYPE_LATEST

# prometheus-client's own variable (tserve._metrics_dir.ENV, named again here
# because web/ imports no top-level module but _host).
SHARED_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

# The finish reasons vllm:request_success_total counts, present from the start.
FINISHED_REASONS = ("stop", "length", "abort")

# What EngineCollector reads at each scrape: the LLM's stats and the requests in flight.
LiveNumbers = Callable[[], tuple[LLMStats, int]]

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class ModelFigures:
    """One served model's numbers at a scrape (several models): ``stats`` and the
    cache config while it is loaded, its lifecycle always."""

    name: str
    state: str  # a ModelState value
    stats: LLMStats | None = None
    cache_config: dict[str, str] = dataclasses.field(default_factory=dict)
    loads: int = 0
    unloads: int = 0
    load_seconds: float = 0.0
    resident_bytes: int = 0  # what the memory budget counts for it (its engines' RSS)


def _usage(s: LLMStats) -> float:
    e = s.engine
    return e.kv_tokens_used / e.kv_tokens_total if e.kv_tokens_total else 0.0


def _running(s: LLMStats) -> float:
    return s.engine.running


def _waiting(s: LLMStats) -> float:
    return s.engine.waiting


_STATES = ("unloaded", "loading", "loaded", "unloading", "failed")  # ModelState values

# tserve's engine families: (name, help, kind, the value from the stats).
_ENGINE_FAMILIES: tuple[tuple[str, str, str, Callable[[LLMStats], float]], ...] = (
    ("tserve_engine_alive", "1 while the engine runs", "gauge", lambda s: s.engine_alive),
    (
        "tserve_requests_live",
        "Admitted requests not yet closed",
        "gauge",
        lambda s: s.live_requests,
    ),
    (
        "tserve_requests_queued",
        "Admitted requests waiting for a slot",
        "gauge",
        lambda s: s.queued_requests,
    ),
    (
        "tserve_requests_queued_tokens",
        "Prompt tokens of the requests waiting for a slot",
        "gauge",
        lambda s: s.queued_tokens,
    ),
    ("tserve_requests_running", "Requests in the batch", "gauge", _running),
    ("tserve_requests_waiting", "Requests queued in the engine", "gauge", _waiting),
    ("tserve_kv_cache_used_tokens", "KV tokens in use", "gauge", lambda s: s.engine.kv_tokens_used),
    (
        "tserve_kv_cache_total_tokens",
        "KV token budget",
        "gauge",
        lambda s: s.engine.kv_tokens_total,
    ),
    ("tserve_kv_cache_usage_ratio", "KV used / total", "gauge", _usage),
    ("tserve_aborts_sent", "Aborts sent to the engine", "counter", lambda s: s.aborts_sent),
    (
        "tserve_engine_aborts_received",
        "Aborts the engine received",
        "counter",
        lambda s: s.engine.aborts_received,
    ),
    ("tserve_engine_steps", "Engine steps", "counter", lambda s: s.engine.steps),
)

# vLLM's engine families, each with ``model_name``.
_VLLM_FAMILIES: tuple[tuple[str, str, str, Callable[[LLMStats], float]], ...] = (
    ("vllm:num_requests_running", "Requests in the engine's batch", "gauge", _running),
    ("vllm:num_requests_waiting", "Requests queued in the engine", "gauge", _waiting),
    ("vllm:kv_cache_usage_perc", "KV cache usage, a fraction from 0 to 1", "gauge", _usage),
    (
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in tokens (each admitted request's known tokens)",
        "counter",
        lambda s: s.engine.prefix_cache_queries,
    ),
    (
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in tokens (those found cached)",
        "counter",
        lambda s: s.engine.prefix_cache_hits,
    ),
)


def _family(
    name: str, text: str, kind: str, labels: list[str]
) -> CounterMetricFamily | GaugeMetricFamily:
    if kind == "counter":
        return CounterMetricFamily(name, text, labels=labels)
    return GaugeMetricFamily(name, text, labels=labels)


@dataclasses.dataclass(frozen=True, slots=True)
class _Engine:
    """One loaded model's engine numbers at a scrape."""

    name: str
    stats: LLMStats
    cache_config: dict[str, str]


def _engine_metrics(
    engines: Sequence[_Engine], in_flight: int, *, labelled: bool
) -> Iterator[Metric]:
    """The engine families, one sample per engine; tserve's own carry ``model_name``
    only when ``labelled`` (several models)."""
    own = ["model_name"] if labelled else []
    for name, text, kind, value in _ENGINE_FAMILIES:
        family = _family(name, text, kind, own)
        for e in engines:
            family.add_metric([e.name] if labelled else [], value(e.stats))
        yield family
        if name == "tserve_requests_queued_tokens":  # the HTTP layer's own, for every model
            yield GaugeMetricFamily(
                "tserve_http_generations_in_flight", "Completion requests being answered", in_flight
            )
    for name, text, kind, value in _VLLM_FAMILIES:
        family = _family(name, text, kind, ["model_name"])
        for e in engines:
            family.add_metric([e.name], value(e.stats))
        yield family
    keys = list(engines[0].cache_config) if engines else ["block_size", "num_gpu_blocks"]
    info = GaugeMetricFamily(
        "vllm:cache_config_info",
        "KV cache configuration: tokens per block and blocks",
        labels=["model_name", *keys],
    )
    for e in engines:
        info.add_metric([e.name, *e.cache_config.values()], 1.0)
    yield info


class EngineCollector(Collector):
    """The engine's numbers and the live work, read once per scrape from ``numbers``
    (:data:`LiveNumbers`): one API process's own, or in the metrics process the whole
    server's."""

    def __init__(self, numbers: LiveNumbers, model_name: str, cache_config: dict[str, str]) -> None:
        self._numbers = numbers
        self._model_name = model_name
        self._cache_config = cache_config  # vllm:cache_config_info's labels

    def collect(self) -> Iterator[Metric]:
        stats, in_flight = self._numbers()
        engine = _Engine(self._model_name, stats, self._cache_config)
        yield from _engine_metrics([engine], in_flight, labelled=False)


class ModelsCollector(Collector):
    """Several models' numbers, read once per scrape from ``figures``: the engine
    families of every loaded model, and every model's lifecycle."""

    def __init__(
        self, figures: Callable[[], Sequence[ModelFigures]], in_flight: Callable[[], int]
    ) -> None:
        self._figures = figures
        self._in_flight = in_flight

    def collect(self) -> Iterator[Metric]:
        figures = self._figures()
        engines = [_Engine(f.name, f.stats, f.cache_config) for f in figures if f.stats is not None]
        yield from _engine_metrics(engines, self._in_flight(), labelled=True)
        state = GaugeMetricFamily(
            "tserve_model_state", "1 for the model's load state", labels=["model_name", "state"]
        )
        loads = CounterMetricFamily(
            "tserve_model_loads", "Loads that finished", labels=["model_name"]
        )
        unloads = CounterMetricFamily(
            "tserve_model_unloads", "Engines stopped: unloaded or dead", labels=["model_name"]
        )
        seconds = GaugeMetricFamily(
            "tserve_model_load_seconds", "How long the last load took", labels=["model_name"]
        )
        resident = GaugeMetricFamily(
            "tserve_model_resident_bytes",
            "Resident memory of the model's engine processes, as the memory budget "
            "counts it (0 without one; while loading, its estimate)",
            labels=["model_name"],
        )
        for f in figures:
            for value in _STATES:
                state.add_metric([f.name, value], float(value == f.state))
            loads.add_metric([f.name], f.loads)
            unloads.add_metric([f.name], f.unloads)
            seconds.add_metric([f.name], f.load_seconds)
            resident.add_metric([f.name], f.resident_bytes)
        yield from (state, loads, unloads, seconds, resident)


class Metrics:
    """The app's metrics. Updating them never blocks.

    ``model_name`` is the label of the metrics that carry one (the first
    served model name), and of a request that names no model; ``block_size``
    and ``num_gpu_blocks`` describe the engine's KV cache for
    ``vllm:cache_config_info``. ``models`` (several models): the engine
    numbers come from it instead of ``stats`` (then None), per model. Request metrics are
    shared by every API process when :data:`SHARED_DIR_ENV` names
    a directory (see the module docstring).
    """

    def __init__(
        self,
        stats: Callable[[], LLMStats] | None,
        in_flight: Callable[[], int],
        model_name: str,
        *,
        block_size: int = 0,
        num_gpu_blocks: int = 0,
        models: Callable[[], Sequence[ModelFigures]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        shared_dir = os.environ.get(SHARED_DIR_ENV)
        # In multiprocess mode the request metrics live in the shared files,
        # which one collector reads for every process; registering them here
        # too would count this process twice.
        r = None if shared_dir else self.registry
        if shared_dir:
            MultiProcessCollector(self.registry, path=shared_dir)  # type: ignore[no-untyped-call]
        self.requests = Counter(
            "tserve_http_requests", "HTTP requests by route and status", ["route", "status"],
            registry=r,
        )  # fmt: skip
        self.embedding_inputs = Counter(
            "tserve_embedding_inputs", "Inputs embedded (their tokens count as prompt tokens)",
            registry=r,
        )  # fmt: skip
        # Incremented by the connections' StallGuard (_connections.py).
        self.stalled_responses = Counter(
            "tserve_stalled_responses",
            "Responses ended, their connection closed, because the client took no byte in time",
            registry=r,
        )
        self._models = _ModelMetrics(r)
        self._default = model_name
        self.model = self.model_for(model_name)  # labels present before any request
        if models is not None or stats is None:
            self.registry.register(ModelsCollector(models or list, in_flight))
            return
        cache_config = _cache_config(block_size, num_gpu_blocks)
        live = EngineCollector(lambda: (stats(), in_flight()), model_name, cache_config)
        self.registry.register(live)

    def model_for(self, name: str | None) -> _ModelLabels:
        """vLLM's request metrics of the model ``name`` (None: ``model_name``)."""
        return self._models.labels(self._default if name is None else name)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


def _cache_config(block_size: int, num_gpu_blocks: int) -> dict[str, str]:
    """vllm:cache_config_info's labels besides ``model_name``."""
    return {"block_size": str(block_size), "num_gpu_blocks": str(num_gpu_blocks)}


def request_registry(shared_dir: str) -> CollectorRegistry:
    """The request metrics of every API process that writes to ``shared_dir``, for a
    process that serves none of the requests. Rendering it reads their files."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=shared_dir)  # type: ignore[no-untyped-call]
    return registry


def engine_registry(
    numbers: LiveNumbers, model_name: str, *, block_size: int, num_gpu_blocks: int
) -> CollectorRegistry:
    """The engine's numbers and the live work from ``numbers`` alone: with
    :func:`request_registry`, the families of :class:`Metrics`."""
    registry = CollectorRegistry()
    cache_config = _cache_config(block_size, num_gpu_blocks)
    registry.register(EngineCollector(numbers, model_name, cache_config))
    return registry


class _ModelLabels:
    """vLLM's request metrics bound to one ``model_name`` label value."""

    def __init__(self, families: _ModelMetrics, model_name: str) -> None:
        self.ttft = families.ttft.labels(model_name)
        self.itl = families.itl.labels(model_name)
        self.e2e = families.e2e.labels(model_name)
        self.prompt_tokens = families.prompt_tokens.labels(model_name)
        self.generation_tokens = families.generation_tokens.labels(model_name)
        self.success = {
            reason: families.success.labels(model_name, reason) for reason in FINISHED_REASONS
        }


class _ModelMetrics:
    """vLLM's request metric families, by ``model_name``.

    Bound: one label set per served model name (names come from the server, never
    from a request that names a model it does not serve: that one is a 404 first).
    """

    def __init__(self, registry: CollectorRegistry | None) -> None:
        def histogram(name: str, text: str) -> Histogram:
            return Histogram(
                name, text, ["model_name"], buckets=_LATENCY_BUCKETS, registry=registry
            )

        def counter(name: str, text: str) -> Counter:
            return Counter(name, text, ["model_name"], registry=registry)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between output tokens")
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Generation request latency, arrival to last byte"
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens")
        self.success = Counter(
            "vllm:request_success", "Choices finished, by finish reason",
            ["model_name", "finished_reason"], registry=registry,
        )  # fmt: skip
        self._labels: dict[str, _ModelLabels] = {}

    def labels(self, model_name: str) -> _ModelLabels:
        found = self._labels.get(model_name)
        if found is None:
            found = self._labels[model_name] = _ModelLabels(self, model_name)
        return found


class RequestRecord:
    """What one HTTP request did, for its metrics and its one log line.

    ``done`` is idempotent: the first call counts the request and logs it.
    """

    def __init__(self, metrics: Metrics, route: str, request_id: str, *, log_line: bool) -> None:
        self.route = route
        self.request_id = request_id
        self.model_name: str | None = None  # the served model that answered, once held
        self.streaming = False  # the response body, not the handler, calls done()
        # Choices per prompt (``n``): choice i * n is the first of its prompt's,
        # whose usage alone counts that prompt, as the response's usage does.
        self.choices_per_prompt = 1
        self._metrics = metrics
        self._log_line = log_line
        self._start = time.perf_counter()
        self._last: dict[int, float] = {}  # choice index -> time of its last delta
        self._prompt_tokens = 0
        self._completion_tokens = 0
        self._finished = 0  # choices that got a finish reason
        self._done = False

    def delta(self, index: int, delta: Delta) -> None:
        """Observe one delta of choice ``index`` (TTFT, inter-token latency, tokens, finish)."""
        m = self._metrics.model_for(self.model_name)
        if delta.usage is not None:
            if index % self.choices_per_prompt == 0:
                self._prompt_tokens += delta.usage.prompt_tokens
            self._completion_tokens += delta.usage.completion_tokens
        if delta.finish_reason is not None:
            self._finished += 1
            success = m.success.get(delta.finish_reason)
            if success is not None:
                success.inc()
        n = len(delta.token_ids)
        if not n:
            return
        now = time.perf_counter()
        last = self._last.get(index)
        if last is None:
            m.ttft.observe(now - self._start)
        else:
            m.itl.observe((now - last) / n)
        self._last[index] = now

    def embedded(self, inputs: int, tokens: int) -> None:
        """Observe an embedding response: ``inputs`` vectors from ``tokens`` prompt tokens."""
        self._prompt_tokens += tokens
        self._metrics.embedding_inputs.inc(inputs)

    def done(self, status: int) -> None:
        if self._done:
            return
        self._done = True
        elapsed = time.perf_counter() - self._start
        m = self._metrics
        m.requests.labels(self.route, str(status)).inc()
        model = m.model_for(self.model_name)
        if self._finished:
            model.e2e.observe(elapsed)
        model.prompt_tokens.inc(self._prompt_tokens)
        model.generation_tokens.inc(self._completion_tokens)
        if self._log_line:
            access_log.info(
                "%s %s %d prompt_tokens=%d completion_tokens=%d %.1fms",
                self.request_id,
                self.route,
                status,
                self._prompt_tokens,
                self._completion_tokens,
                elapsed * 1000,
            )
