"""The sampler: time series of the server's fds, census and ``/metrics`` gauges.

:func:`sample_for` runs two tasks for a given time, each at a fixed period:
one counts the API process's fds and the engine's ipc connections and reads
its resident memory (and takes
a full census about once a second, see :mod:`._census`); the other scrapes
``/metrics`` for the gauges in :data:`GAUGES`. Both append to one
:class:`Samples`, which grows by a few entries per period: the run's
``--max-seconds`` bounds it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from benchmarks.seed_http._census import (
    FdCensus,
    engine_ipc_connections,
    fd_count,
    rss_bytes,
    take_census,
)
from benchmarks.seed_http._server import ServerProcs

__all__ = ["GAUGES", "Samples", "parse_metrics", "sample_for"]

GAUGES = {
    b"tserve_requests_live": "live",
    b"tserve_http_generations_in_flight": "http_in_flight",
    b"tserve_requests_running": "running",
    b"tserve_requests_waiting": "waiting",
    b"tserve_requests_queued": "queued",
    b"tserve_requests_queued_tokens": "queued_tokens",
}
_COMPLETIONS = b'tserve_http_requests_total{route="/v1/completions"'
_CENSUS_PERIOD = 1.0  # seconds between two full censuses
_SCRAPE_TIMEOUT = 10.0


@dataclass
class Samples:
    """Everything the sampler saw, as parallel time series (time.monotonic())."""

    fds: list[tuple[float, int, int]] = field(default_factory=list)  # t, fds, ipc conns
    rss: list[tuple[float, int]] = field(default_factory=list)  # t, API process RSS bytes
    # t, scrape latency, parse_metrics' values (or {"error": kind})
    metrics: list[tuple[float, float, dict[str, Any]]] = field(default_factory=list)
    censuses: list[FdCensus] = field(default_factory=list)


def parse_metrics(text: bytes) -> dict[str, Any]:
    """The gauges this benchmark watches, and ``tserve_http_requests_total`` by status."""
    values: dict[str, Any] = {}
    by_status: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(b" ")
        if name in GAUGES:
            values[GAUGES[name]] = float(value)
        elif name.startswith(_COMPLETIONS):
            status = name.split(b'status="')[1].split(b'"')[0].decode()
            by_status[status] = float(value)
    values["completions_by_status"] = by_status
    return values


async def sample_for(
    procs: ServerProcs, client: httpx.AsyncClient, samples: Samples, seconds: float, dt: float
) -> None:
    """Sample every ``dt`` seconds for ``seconds`` (or until cancelled)."""
    with trio.move_on_after(seconds):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_sample_fds, procs, samples, dt)
            nursery.start_soon(_sample_metrics, client, samples, dt)


async def _sample_fds(procs: ServerProcs, samples: Samples, interval: float) -> None:
    next_census = 0.0
    while True:
        now = time.monotonic()
        samples.fds.append((now, fd_count(procs.api_pid), engine_ipc_connections(procs)))
        samples.rss.append((now, rss_bytes(procs.api_pid)))
        if now >= next_census:
            samples.censuses.append(await take_census(procs))
            next_census = now + _CENSUS_PERIOD
        await trio.sleep(max(0.0, now + interval - time.monotonic()))


async def _sample_metrics(client: httpx.AsyncClient, samples: Samples, interval: float) -> None:
    while True:
        start = time.monotonic()
        try:
            response = await client.get("/metrics", timeout=_SCRAPE_TIMEOUT)
            values = parse_metrics(response.content)
        except httpx.HTTPError as exc:
            values = {"error": type(exc).__name__}
        samples.metrics.append((start, time.monotonic() - start, values))
        await trio.sleep(max(0.0, start + interval - time.monotonic()))
