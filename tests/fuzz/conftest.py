"""One live server for the fuzz suite: the tiny model behind ``python -m tserve serve``.

Its context is 32 tokens (``--max-model-len``), so no request a fuzzer makes,
however large its ``n`` or ``max_tokens``, generates more than 32 tokens per
choice. It keeps an API key: the fuzzers send it, and unauthenticated calls
must be 401s, not 5xx.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.web.conftest import API_KEY, Server

REQUEST_TIMEOUT = 60.0  # seconds per request: past it, a hang (a hang guard, not a timing check)


@pytest.fixture(scope="package")
def fuzz_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    srv = Server(
        tiny_model_dir,
        *("--served-model-name", "tiny", "--api-key", API_KEY, "--no-request-log"),
        *("--max-model-len", "32", "--max-pending", "4096"),
        log=log,
    )
    srv.client.headers["Authorization"] = f"Bearer {API_KEY}"
    yield srv
    srv.stop()


def assert_healthy(server: Server) -> None:
    """The server survived: ``/health`` is 200, a normal completion works, and the
    log holds no internal error (a 500 the status codes might have hidden)."""
    assert server.client.get("/health").status_code == 200
    reply = server.client.post(
        "/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0}
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
    log = server.log.read_text(errors="replace")
    assert "internal error" not in log and "Traceback" not in log, log[-3000:]


def client_for(server: Server) -> httpx.Client:
    """A client of ``server`` with its key and the per-request timeout."""
    return httpx.Client(
        base_url=server.url,
        timeout=REQUEST_TIMEOUT,
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
