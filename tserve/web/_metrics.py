"""Prometheus metrics of one app, in its own CollectorRegistry (no global state).

Counters and histograms are updated by the request handlers; the engine's
gauges (live, running, waiting, KV usage, aborts) and counters (steps, prefix
cache) are read from ``LLM.stats`` at scrape time by a collector, so nothing
polls. The prefix-cache counters carry vLLM's names and ``model_name`` label
(``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``, in
tokens), so dashboards built for vLLM read them unchanged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from tserve.nursery import Delta, LLMStats

__all__ = ["CONTENT_TYPE", "Metrics", "RequestRecord"]

access_log = logging.getLogger("tserve.access")

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class _EngineCollector(Collector):
    def __init__(
        self, stats: Callable[[], LLMStats], in_flight: Callable[[], int], model_name: str
    ) -> None:
        self._stats = stats
        self._in_flight = in_flight
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        e = s.engine
        yield GaugeMetricFamily("tserve_engine_alive", "1 while the engine runs", s.engine_alive)
        yield GaugeMetricFamily(
            "tserve_requests_live", "Admitted requests not yet closed", s.live_requests
        )
        yield GaugeMetricFamily(
            "tserve_http_generations_in_flight",
            "Completion requests being answered",
            self._in_flight(),
        )
        yield GaugeMetricFamily("tserve_requests_running", "Requests in the batch", e.running)
        yield GaugeMetricFamily(
            "tserve_requests_waiting", "Requests queued in the engine", e.waiting
        )
        yield GaugeMetricFamily("tserve_kv_cache_used_tokens", "KV tokens in use", e.kv_tokens_used)
        yield GaugeMetricFamily(
            "tserve_kv_cache_total_tokens", "KV token budget", e.kv_tokens_total
        )
        usage = e.kv_tokens_used / e.kv_tokens_total if e.kv_tokens_total else 0.0
        yield GaugeMetricFamily("tserve_kv_cache_usage_ratio", "KV used / total", usage)
        yield CounterMetricFamily("tserve_aborts_sent", "Aborts sent to the engine", s.aborts_sent)
        yield CounterMetricFamily(
            "tserve_engine_aborts_received", "Aborts the engine received", e.aborts_received
        )
        yield CounterMetricFamily("tserve_engine_steps", "Engine steps", e.steps)
        for name, text, value in (
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in tokens (each admitted request's known tokens)",
                e.prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in tokens (those found cached)",
                e.prefix_cache_hits,
            ),
        ):
            counter = CounterMetricFamily(name, text, labels=["model_name"])
            counter.add_metric([self._model_name], value)
            yield counter


class Metrics:
    """The app's metrics. Updating them never blocks.

    ``model_name`` is the label of the metrics that carry one (the first
    served model name).
    """

    def __init__(
        self, stats: Callable[[], LLMStats], in_flight: Callable[[], int], model_name: str
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tserve_http_requests", "HTTP requests by route and status", ["route", "status"],
            registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "tserve_time_to_first_token_seconds", "Time to first token",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "tserve_inter_token_latency_seconds", "Time between output tokens",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.latency = Histogram(
            "tserve_request_latency_seconds", "Whole request latency",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter("tserve_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("tserve_generation_tokens", "Output tokens", registry=r)
        self.embedding_inputs = Counter(
            "tserve_embedding_inputs", "Inputs embedded (their tokens count as prompt tokens)",
            registry=r,
        )  # fmt: skip
        r.register(_EngineCollector(stats, in_flight, model_name))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class RequestRecord:
    """What one HTTP request did, for its metrics and its one log line.

    ``done`` is idempotent: the first call counts the request and logs it.
    """

    def __init__(self, metrics: Metrics, route: str, request_id: str, *, log_line: bool) -> None:
        self.route = route
        self.request_id = request_id
        self.streaming = False  # the response body, not the handler, calls done()
        self._metrics = metrics
        self._log_line = log_line
        self._start = time.perf_counter()
        self._last: dict[int, float] = {}  # choice index -> time of its last delta
        self._prompt_tokens = 0
        self._completion_tokens = 0
        self._done = False

    def delta(self, index: int, delta: Delta) -> None:
        """Observe one delta of choice ``index`` (TTFT, inter-token latency, tokens)."""
        if delta.usage is not None:
            self._prompt_tokens += delta.usage.prompt_tokens
            self._completion_tokens += delta.usage.completion_tokens
        n = len(delta.token_ids)
        if not n:
            return
        now = time.perf_counter()
        last = self._last.get(index)
        if last is None:
            self._metrics.ttft.observe(now - self._start)
        else:
            self._metrics.itl.observe((now - last) / n)
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
        m.latency.observe(elapsed)
        m.prompt_tokens.inc(self._prompt_tokens)
        m.generation_tokens.inc(self._completion_tokens)
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
