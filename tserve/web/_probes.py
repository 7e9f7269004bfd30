"""What probes and scrapers read: ``/version``, ``/health``, ``/ready``, ``/metrics``.

All answer from memory the API process already holds, so they stay fast
under any load (a model that loads never blocks them), and need no API key
(they hold counts and model names, never content).
"""

from __future__ import annotations

from quart import Response

import tserve
from tserve.web._inflight import InFlight
from tserve.web._metrics import CONTENT_TYPE, Metrics, RequestRecord
from tserve.web._model_lookup import ModelLookup
from tserve.web._routing import json_response

__all__ = ["Probes"]


class Probes:
    """The probe handlers of one app. ``started`` is set by ``serve()`` once it listens."""

    def __init__(self, models: ModelLookup, metrics: Metrics, in_flight: InFlight) -> None:
        self._models = models
        self._metrics = metrics
        self._in_flight = in_flight
        self.started = False

    async def version(self, record: RequestRecord) -> Response:
        return json_response({"version": tserve.__version__})

    async def health(self, record: RequestRecord) -> Response:
        """Liveness: 503 once the one engine is dead or, with several models, once
        every model's last load failed or its engine died (none loaded since)."""
        if self._models.alive():
            return json_response({"status": "ok"})
        return json_response({"status": self._models.dead_status}, 503)

    async def ready(self, record: RequestRecord) -> Response:
        """Readiness: 503 while starting, draining, dead or (one model) saturated;
        ``models`` maps each served name to its state; with several models,
        ``memory_budget`` and ``resident_bytes`` (their engines' RSS now)."""
        models = self._models
        states = {s.name: s.state.value for s in models.statuses()}
        if not self.started:
            state = "starting"
        elif not models.alive():
            state = "engine dead"
        elif models.draining or self._in_flight.aborting is not None:
            state = "draining"
        elif models.saturated():
            state = "saturated"  # a new request would get 503 now
        else:
            state = "ready"
        body: dict[str, object] = {"status": state, "models": states}
        memory = models.memory()
        if memory is not None:
            body["memory_budget"] = memory.budget
            body["resident_bytes"] = memory.resident
        return json_response(body, 200 if state == "ready" else 503)

    async def metrics(self, record: RequestRecord) -> Response:
        """The Prometheus text exposition."""
        return Response(self._metrics.render(), content_type=CONTENT_TYPE)
