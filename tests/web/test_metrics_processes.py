"""One scrape sees the whole server: ``--api-processes 2`` and vLLM's metric names."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.web.test_api_processes import TOKENS, start, stream_one
from tests.web.test_metrics_contract import VLLM_NAMES, Samples, samples

pytestmark = pytest.mark.slow

REQUESTS = 100


def scrape(url: str) -> Samples:
    """/metrics on a fresh connection, so the kernel may hand it to either process."""
    response = httpx.get(f"{url}/metrics", timeout=30)
    assert response.status_code == 200
    return samples(response.text)


def total(found: Samples, name: str) -> float:
    return sum(value for _, value in found[name])


def test_one_scrape_sums_both_api_processes_and_the_gauges_follow_the_engine(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    server, _, _ = start(tiny_model_dir, tmp_path)
    try:
        for name in VLLM_NAMES:
            assert all(labels.get("model_name") == "tiny" for labels, _ in scrape(server.url)[name])

        seen_busy: list[float] = []
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                found = scrape(server.url)
                seen_busy.append(
                    total(found, "vllm:num_requests_running")
                    + total(found, "vllm:num_requests_waiting")
                    + total(found, "vllm:kv_cache_usage_perc")
                )

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            with ThreadPoolExecutor(16) as pool:
                results = list(pool.map(lambda i: stream_one(server.url, i), range(REQUESTS)))
        finally:
            done.set()
            watcher.join()
        assert results == [(200, TOKENS)] * REQUESTS
        assert max(seen_busy) > 0, "the engine gauges never moved under load"

        # Every scrape, whichever process answers, counts all 100.
        for _ in range(12):
            found = scrape(server.url)
            assert total(found, "vllm:request_success_total") == REQUESTS
            assert total(found, "vllm:generation_tokens_total") == REQUESTS * TOKENS
            assert total(found, "vllm:e2e_request_latency_seconds_count") == REQUESTS
            assert total(found, "tserve_stalled_responses_total") == 0  # from the shared files
            for name in VLLM_NAMES:
                assert all(labels.get("model_name") == "tiny" for labels, _ in found[name]), name

        # At idle the engine gauges return to 0 in every process's view (each
        # hears the engine at least once per heartbeat). A hang guard only.
        idle = 0
        deadline = time.monotonic() + 30
        while idle < 6:
            assert time.monotonic() < deadline, "the engine gauges never returned to 0"
            busy = scrape(server.url)
            if all(
                total(busy, name) == 0
                for name in (
                    "vllm:num_requests_running",
                    "vllm:num_requests_waiting",
                    "vllm:kv_cache_usage_perc",
                )
            ):
                idle += 1
            else:
                idle = 0
                time.sleep(0.1)
    finally:
        server.stop()
