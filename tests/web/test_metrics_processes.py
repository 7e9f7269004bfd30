"""One scrape sees the whole server: ``--api-processes 2`` and vLLM's metric names,
on the serving port and on the metrics process's (``--metrics-port``) alike."""

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
    """/metrics on a fresh connection, so that on the serving port the kernel may hand
    it to either process."""
    response = httpx.get(f"{url}/metrics", timeout=30)
    assert response.status_code == 200
    return samples(response.text)


def total(found: Samples, name: str) -> float:
    return sum(value for _, value in found[name])


def wait_for_total(url: str, name: str, value: float) -> None:
    """Scrape until ``name`` sums to ``value``: the metrics process's request metrics
    may be up to its MAX_AGE old. A hang guard, not a timing check."""
    deadline = time.monotonic() + 30
    while total(scrape(url), name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value} at {url}"
        time.sleep(0.1)


def test_one_scrape_sums_both_api_processes_and_the_gauges_follow_the_engine(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    server, _, _ = start(tiny_model_dir, tmp_path, "--metrics-port", "0")
    assert server.metrics_url is not None
    urls = (server.url, server.metrics_url)
    try:
        for url in urls:
            for name in VLLM_NAMES:
                assert all(labels.get("model_name") == "tiny" for labels, _ in scrape(url)[name])

        # Each view must see the engine busy (and the metrics port the live
        # requests, summed over both processes) while a round of REQUESTS runs;
        # a round can end between two scrapes of a view, so there may be more.
        seen_busy: dict[str, float] = dict.fromkeys(urls, 0.0)
        seen_live = 0.0
        sent = 0

        def watch(done: threading.Event) -> None:
            nonlocal seen_live
            while not done.is_set():
                for url in urls:
                    found = scrape(url)
                    busy = sum(
                        total(found, name)
                        for name in (
                            "vllm:num_requests_running",
                            "vllm:num_requests_waiting",
                            "vllm:kv_cache_usage_perc",
                        )
                    )
                    seen_busy[url] = max(seen_busy[url], busy)
                seen_live = max(seen_live, total(found, "tserve_requests_live"))

        for _ in range(5):  # a hang guard
            done = threading.Event()
            watcher = threading.Thread(target=watch, args=(done,))
            watcher.start()
            try:
                with ThreadPoolExecutor(16) as pool:
                    requests = range(sent, sent + REQUESTS)
                    results = list(pool.map(lambda i: stream_one(server.url, i), requests))
            finally:
                done.set()
                watcher.join()
            assert results == [(200, TOKENS)] * REQUESTS
            sent += REQUESTS
            if min(seen_busy.values()) > 0 and seen_live > 0:
                break
        assert min(seen_busy.values()) > 0, f"the engine gauges never moved: {seen_busy}"
        assert seen_live > 0

        # Every scrape, whichever process answers, counts every request. A
        # request's success counts at its finish, its tokens when its response
        # ends, after the client has read the last byte: both are waited for.
        for url in urls:
            wait_for_total(url, "vllm:request_success_total", sent)
            wait_for_total(url, "vllm:generation_tokens_total", sent * TOKENS)
        for _ in range(6):
            for url in urls:
                found = scrape(url)
                assert total(found, "vllm:request_success_total") == sent
                assert total(found, "vllm:generation_tokens_total") == sent * TOKENS
                assert total(found, "vllm:e2e_request_latency_seconds_count") == sent
                assert total(found, "tserve_stalled_responses_total") == 0  # the shared files
                for name in VLLM_NAMES:
                    assert all(labels.get("model_name") == "tiny" for labels, _ in found[name])

        # At idle the engine gauges return to 0 in every view (each API process
        # hears the engine at least once per heartbeat). A hang guard only.
        for url in urls:
            idle = 0
            deadline = time.monotonic() + 30
            while idle < 6:
                assert time.monotonic() < deadline, f"the engine gauges stayed up at {url}"
                busy = scrape(url)
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
        assert total(scrape(server.metrics_url), "tserve_requests_live") == 0
    finally:
        server.stop()
