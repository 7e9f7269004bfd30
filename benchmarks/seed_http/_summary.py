"""The run summed up: one flat JSON-able dict of the report's fields.

:func:`summarize` turns the load generator's per-request records, the
sampler's series and the run's settings into the result that is printed and
written to ``results/``; :func:`passed` says whether it kept tserve's two
promises. Percentiles are :func:`tserve.bench._metrics.percentile`'s (linear
interpolation, as numpy's default), the same as ``python -m tserve bench``'s.
Times in the timeline are seconds since the load generator started.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
from collections import Counter
from dataclasses import asdict
from typing import Any

from benchmarks.seed_http._load import DUE, END, FIRST, KIND, START, TOKENS
from benchmarks.seed_http._run import LoadRun
from benchmarks.seed_http._sampler import GAUGES, Samples
from tserve.bench._metrics import percentile
from tserve.nursery._admission import WAITING_REQUEST_BYTES

__all__ = ["passed", "summarize"]

_GAUGE_KEYS = frozenset(GAUGES.values())
_BYTES_PER_QUEUED_TOKEN = 40  # a waiting prompt id: a Python int in a list (docs/configuration.md)
_MB = 2**20


def _rounded(x: float | None, digits: int = 4) -> float | None:
    return None if x is None or math.isnan(x) else round(x, digits)


def _client_summary(args: argparse.Namespace, client: dict[str, Any]) -> dict[str, Any]:
    """Outcomes, rates and latencies from the load generator's per-request records."""
    records = [r for r in client.get("records", []) if r is not None]
    kinds = Counter(r[KIND] for r in records)
    kinds["never_started"] = args.requests - len(records)
    errors = {k: n for k, n in kinds.items() if k != "ok" and n}
    ok = [r for r in records if r[KIND] == "ok"]
    wrong_tokens = Counter(r[TOKENS] for r in ok if r[TOKENS] != args.max_tokens)
    starts = sorted(r[START] for r in records)
    ends = [r[END] for r in records if r[END] is not None]
    wall = (max(ends) - starts[0]) if ends and starts else 0.0
    lag = [r[START] - r[DUE] for r in records]
    latency = [r[END] - r[START] for r in ok]
    first_byte = [r[FIRST] - r[START] for r in ok if r[FIRST] is not None]
    failed = [r for r in records if r[KIND] != "ok" and r[END] is not None]
    failed_durations = [r[END] - r[START] for r in failed]
    t0 = starts[0] if starts else 0.0
    tokens = sum(r[TOKENS] for r in ok)

    def per_s(n: float) -> float | None:
        return _rounded(n / wall, 1) if wall else None

    return {
        "ok": len(ok),
        "errors": sum(errors.values()),
        "errors_by_kind": errors,
        "wrong_token_counts": sum(wrong_tokens.values()),
        "wrong_token_values": {str(k): n for k, n in wrong_tokens.items()},
        "failed_duration_min_s": _rounded(min(failed_durations, default=None)),
        "failed_duration_max_s": _rounded(max(failed_durations, default=None)),
        "error_samples": [  # about 50, spread over the run
            {
                "start_s": round(r[START] - t0, 3),
                "duration_s": round(r[END] - r[START], 3),
                "kind": r[KIND],
                "got_bytes": r[FIRST] is not None,
            }
            for r in failed[:: max(1, len(failed) // 50)]
        ],
        "achieved_rate": _rounded((len(starts) - 1) / (starts[-1] - starts[0]), 1)
        if len(starts) > 1
        else None,
        "arrival_span_s": _rounded(starts[-1] - starts[0]) if starts else None,
        "send_lag_p99_s": _rounded(percentile(lag, 99)),
        "send_lag_max_s": _rounded(max(lag, default=None)),
        "wall_s": _rounded(wall, 2),
        "throughput_req_s": per_s(len(ok)),
        "throughput_tokens_s": per_s(tokens),
        "latency_p50_s": _rounded(percentile(latency, 50)),
        "latency_p99_s": _rounded(percentile(latency, 99)),
        "latency_max_s": _rounded(max(latency, default=None)),
        "first_byte_p50_s": _rounded(percentile(first_byte, 50)),
        "first_byte_p99_s": _rounded(percentile(first_byte, 99)),
        "peak_in_flight_client": client.get("peak_in_flight"),
        "client_fd_limit": client.get("fd_limit"),
        "client_processes": client.get("clients"),
        "cpu_cores_client": _rounded(client.get("cpu_s", math.nan) / wall, 2) if wall else None,
        "client_cpu_us_per_request": _rounded(1e6 * client.get("cpu_s", math.nan) / len(records), 1)
        if records
        else None,
    }


def _server_summary(load: LoadRun, samples: Samples) -> dict[str, Any]:
    """Peaks of the server's gauges, fds, ZMQ sockets and CPU, before/during/after the load."""

    def during(t: float) -> bool:
        return load.start <= t <= load.end

    base_fds = [f for t, f, _ in samples.fds if t < load.start]
    after_fds = [f for t, f, _ in samples.fds if t > load.end]
    ipc = [c for _, _, c in samples.fds]
    censuses = samples.censuses
    zmq = [c.zmq_to_engine for c in censuses if c.zmq_to_engine is not None]
    base_census = next((c for c in censuses if c.t < load.start), None)
    peak_census = max(censuses, key=lambda c: c.total, default=None)
    metric_values = [v for _, _, v in samples.metrics if "error" not in v]
    in_load = [c for c in censuses if during(c.t)]
    api_cpu = engine_cpu = math.nan
    if len(in_load) > 1:
        span = in_load[-1].t - in_load[0].t
        api_cpu = (in_load[-1].api_cpu_s - in_load[0].api_cpu_s) / span
        engine_cpu = (in_load[-1].engine_cpu_s - in_load[0].engine_cpu_s) / span

    def peak(key: str) -> float | None:
        return max((v[key] for v in metric_values if key in v), default=None)

    return {
        "server_completions_by_status": load.completions_by_status,
        "kernel_tcp_counters": load.tcp_counters,
        "peak_live_server": peak("live"),
        "peak_http_in_flight_server": peak("http_in_flight"),
        "peak_engine_running": peak("running"),
        "peak_engine_waiting": peak("waiting"),
        "peak_accept_queue": max(
            (c.accept_queue for c in censuses if c.accept_queue is not None), default=None
        ),
        "metrics_scrapes": len(samples.metrics),
        "metrics_scrape_errors": len(samples.metrics) - len(metric_values),
        "metrics_latency_max_s": _rounded(max((s[1] for s in samples.metrics), default=None)),
        "fds_baseline": int(statistics.median(base_fds)) if base_fds else None,
        "fds_peak": max((f for t, f, _ in samples.fds if during(t)), default=None),
        "fds_after": after_fds[-1] if after_fds else None,
        "fd_census_baseline": asdict(base_census) if base_census else None,
        "fd_census_peak": asdict(peak_census) if peak_census else None,
        "zmq_sockets_to_engine_min": min(zmq, default=None),
        "zmq_sockets_to_engine_max": max(zmq, default=None),
        "engine_ipc_connections_min": min(ipc, default=None),
        "engine_ipc_connections_max": max(ipc, default=None),
        "cpu_cores_api": _rounded(api_cpu, 2),
        "cpu_cores_engine": _rounded(engine_cpu, 2),
        "peak_queued_server": peak("queued"),
        "peak_queued_tokens_server": peak("queued_tokens"),
        **_memory_summary(load, samples),
    }


def _memory_summary(load: LoadRun, samples: Samples) -> dict[str, Any]:
    """The API process's resident memory before the first request, at its peak and after,
    against the bound docs/configuration.md's "Admission" states for the server's queue.

    The bound: ``--max-queued`` requests at ``WAITING_REQUEST_BYTES`` each plus
    ``--max-queued-tokens`` prompt tokens at 40 bytes each, above the idle
    server's memory.
    """
    before = [r for t, r in samples.rss if t < load.start and r > 0]
    seen = [r for _, r in samples.rss if r > 0]
    baseline = statistics.median(before) if before else None
    peak = max(seen, default=None)
    bound = None
    if load.admission:
        bound = (
            load.admission["max_queued"] * WAITING_REQUEST_BYTES
            + load.admission["max_queued_tokens"] * _BYTES_PER_QUEUED_TOKEN
        )
    growth = None if baseline is None or peak is None else peak - baseline
    return {
        "server_max_pending": (load.admission or {}).get("max_pending"),
        "server_max_queued": (load.admission or {}).get("max_queued"),
        "server_max_queued_tokens": (load.admission or {}).get("max_queued_tokens"),
        "api_rss_before_mb": _rounded(baseline / _MB, 1) if baseline else None,
        "api_rss_peak_mb": _rounded(peak / _MB, 1) if peak else None,
        "api_rss_after_mb": _rounded(seen[-1] / _MB, 1) if seen else None,
        "api_rss_growth_mb": _rounded(growth / _MB, 1) if growth is not None else None,
        "queue_memory_bound_mb": _rounded(bound / _MB, 1) if bound is not None else None,
        "api_rss_within_bound": None if bound is None or growth is None else growth <= bound,
    }


def _timeline(load: LoadRun, samples: Samples) -> dict[str, Any]:
    """Every sample, with times in seconds since the load generator started."""
    t0 = load.start
    return {
        "server_fds": [(round(t - t0, 3), f, c) for t, f, c in samples.fds],
        "metrics": [
            (round(t - t0, 3), round(lat, 4), {k: v for k, v in m.items() if k in _GAUGE_KEYS})
            for t, lat, m in samples.metrics
        ],
        "client": [
            (round(t - t0, 3), *rest) for t, *rest in (load.client or {}).get("timeline", [])
        ],
        "accept_queue": [
            (round(c.t - t0, 3), c.accept_queue)
            for c in samples.censuses
            if c.accept_queue is not None
        ],
        "api_rss_mb": [(round(t - t0, 3), round(r / _MB, 1)) for t, r in samples.rss[::10]],
    }


def summarize(args: argparse.Namespace, load: LoadRun, samples: Samples) -> dict[str, Any]:
    """The run's settings, the client's and the server's figures, and every sample."""
    settings: tuple[str, ...] = ("requests", "rate", "arrivals", "max_tokens", "model")
    settings += ("engine_kind", "server_defaults")
    overridden = ("max_pending", "max_num_seqs", "kv_cache_tokens", "max_num_batched_tokens")
    return {
        "benchmark": "seed_http",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **{name: getattr(args, name) for name in settings},
        # The server's own defaults (None here) when it ran with them.
        **{name: None if args.server_defaults else getattr(args, name) for name in overridden},
        **_client_summary(args, load.client or {}),
        **_server_summary(load, samples),
        "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "timeline": _timeline(load, samples),
    }


def passed(result: dict[str, Any]) -> bool:
    """No failed request, no wrong token count, never a change in the ZMQ sockets, and
    the API process's memory within the queue's stated bound (when the bound is known)."""
    zmq_constant = result["zmq_sockets_to_engine_min"] == result["zmq_sockets_to_engine_max"]
    ipc_constant = result["engine_ipc_connections_min"] == result["engine_ipc_connections_max"]
    return bool(
        result["errors"] == 0
        and result["wrong_token_counts"] == 0
        and zmq_constant
        and ipc_constant
        and result["api_rss_within_bound"] is not False
    )
