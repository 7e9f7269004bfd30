"""What probes and scrapers read: ``/version``, ``/health``, ``/ready``, ``/metrics``.

All answer from memory the API process already holds, so they stay fast
under any load, and need no API key (they hold counts, never content).
"""

from __future__ import annotations

from quart import Response

import tserve
from tserve.nursery import LLM
from tserve.web._inflight import InFlight
from tserve.web._metrics import CONTENT_TYPE, Metrics, RequestRecord
from tserve.web._routing import json_response

__all__ = ["Probes"]


class Probes:
    """The probe handlers of one app. ``started`` is set by ``serve()`` once it listens."""

    def __init__(self, llm: LLM, metrics: Metrics, in_flight: InFlight) -> None:
        self._llm = llm
        self._metrics = metrics
        self._in_flight = in_flight
        self.started = False

    async def version(self, record: RequestRecord) -> Response:
        return json_response({"version": tserve.__version__})

    async def health(self, record: RequestRecord) -> Response:
        """Liveness: 503 once the engine is dead."""
        if self._llm.engine_alive:
            return json_response({"status": "ok"})
        return json_response({"status": "engine dead"}, 503)

    async def ready(self, record: RequestRecord) -> Response:
        """Readiness: 503 while starting, draining, dead or saturated."""
        llm = self._llm
        if not self.started:
            state = "starting"
        elif not llm.engine_alive:
            state = "engine dead"
        elif llm.draining or self._in_flight.aborting is not None:
            state = "draining"
        elif llm.admission.saturated:  # a new request would get 503 now
            state = "saturated"
        else:
            return json_response({"status": "ready"})
        return json_response({"status": state}, 503)

    async def metrics(self, record: RequestRecord) -> Response:
        """The Prometheus text exposition."""
        return Response(self._metrics.render(), content_type=CONTENT_TYPE)
