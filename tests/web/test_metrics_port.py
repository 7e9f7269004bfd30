"""``--metrics-port`` with one API process: a real server on loopback, real scrapes.

The metrics process answers from the shared directory alone; what it says
must agree with the serving port's ``/metrics``. The waits are hang guards.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import httpx
import pytest

from tests.web.conftest import Server
from tests.web.test_api_processes import children, wait_until_gone
from tests.web.test_metrics_contract import VLLM_NAMES, Samples, samples

pytestmark = pytest.mark.slow

REQUESTS = 3


def scrape(url: str, **headers: str) -> httpx.Response:
    return httpx.get(f"{url}/metrics", headers=headers, timeout=30)


def total(found: Samples, name: str) -> float:
    return sum(value for _, value in found[name])


def test_the_metrics_port_sees_what_the_serving_port_sees(
    start_server: Callable[..., Server],
) -> None:
    server = start_server("--metrics-port", "0")
    url = server.metrics_url
    assert url is not None and url != server.url
    (metrics_pid,) = [p for p, cmd in children(server.process.pid).items() if "_metrics_" in cmd]
    before = samples(scrape(url).text)
    assert total(before, "tserve_engine_alive") == 1
    for name in VLLM_NAMES:
        assert all(labels.get("model_name") == "tiny" for labels, _ in before[name]), name

    for i in range(REQUESTS):
        body = {"model": "tiny", "prompt": f"hi {i}", "max_tokens": 4, "ignore_eos": True}
        assert server.client.post("/v1/completions", json=body).status_code == 200
    deadline = time.monotonic() + 30
    while True:  # until the request metrics' text and the stats file caught up
        found, serving = samples(scrape(url).text), samples(scrape(server.url).text)
        steps = total(found, "tserve_engine_steps_total")
        if total(found, "vllm:request_success_total") == REQUESTS and steps == total(
            serving, "tserve_engine_steps_total"
        ):
            break
        assert time.monotonic() < deadline, "the metrics port never caught up"
        time.sleep(0.1)
    assert steps > 0  # the engine's report, as the API process holds it
    assert found.keys() == serving.keys()
    for name in ("vllm:generation_tokens_total", "vllm:prompt_tokens_total"):
        assert total(found, name) == total(serving, name) > 0, name
    assert total(found, "vllm:e2e_request_latency_seconds_count") == REQUESTS
    (info,) = found["vllm:cache_config_info"]
    assert info == serving["vllm:cache_config_info"][0]

    assert scrape(url).headers["content-type"] == scrape(server.url).headers["content-type"]
    assert httpx.get(f"{url}/health", timeout=30).status_code == 404
    assert scrape(url, Host="attacker.example").status_code == 403

    assert server.stop(signal.SIGTERM) == 0
    assert wait_until_gone([metrics_pid]) == []
