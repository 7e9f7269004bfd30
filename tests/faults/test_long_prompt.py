"""A legal long prompt on a loaded machine is slow, never the server's death.

The default model on one engine thread, beside two processes that burn both
cores, gets a 7,500-token prompt while 8 short streams run. Every request
completes, the server stays up, and ``/health`` answers 200 at every poll:
the heartbeat comes from the pulse thread while the long prefill works
(``tserve/gpu/engine/_pulse.py``), so no step, however long, reads as a dead engine.
"""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.guards import HANG_GUARD
from tests.web.conftest import Server

pytestmark = pytest.mark.slow

LONG_PROMPT_TOKENS = 7500
SHORT_STREAMS = 8
VOCAB = 49152  # SmolLM2's


@contextlib.contextmanager
def cpu_burners(count: int) -> Iterator[None]:
    """``count`` processes that spin on a core each until the block ends."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def stream_completion(url: str, body: dict[str, object]) -> str | None:
    """POST a streamed completion; its finish reason (None if it never came)."""
    finish = None
    body = {**body, "stream": True}
    with (
        httpx.Client(base_url=url, timeout=HANG_GUARD) as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            finish = event["choices"][0]["finish_reason"] or finish
    return finish


def test_a_long_prompt_beside_busy_cores_completes_and_health_stays_200(
    tmp_path: Path,
) -> None:
    server = Server(None, "--threads", "1", "--no-request-log", log=tmp_path / "server.log")
    rng = random.Random(7500)
    long_prompt = [rng.randrange(1, VOCAB) for _ in range(LONG_PROMPT_TOKENS)]
    finishes: dict[str, str | None] = {}
    health: list[int] = []
    done = threading.Event()

    def run(name: str, body: dict[str, object]) -> None:
        finishes[name] = stream_completion(server.url, body)

    def poll_health() -> None:
        with httpx.Client(base_url=server.url, timeout=HANG_GUARD) as client:
            while not done.wait(0.5):
                health.append(client.get("/health").status_code)

    try:
        with cpu_burners(2):
            poller = threading.Thread(target=poll_health)
            poller.start()
            threads = [
                threading.Thread(
                    target=run,
                    args=("long", {"prompt": long_prompt, "max_tokens": 4, "ignore_eos": True}),
                )
            ]
            for i in range(SHORT_STREAMS):
                body = {"prompt": f"Story {i}: once upon a time", "max_tokens": 48}
                threads.append(threading.Thread(target=run, args=(f"short{i}", body)))
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(HANG_GUARD)
            done.set()
            poller.join(HANG_GUARD)
        assert finishes["long"] == "length"
        assert all(finishes[f"short{i}"] in ("stop", "length") for i in range(SHORT_STREAMS))
        assert health and set(health) == {200}, health
        assert server.process.poll() is None, server.log.read_text()[-3000:]
    finally:
        server.stop()
