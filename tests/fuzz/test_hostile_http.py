"""Hostile bodies over real HTTP: every endpoint gets every body; at least
``REQUESTS`` requests, no 5xx, no hang (a per-request timeout), every error the
OpenAI error JSON, and the server healthy after.

The requests of one body go out together (one thread each), so the server
works while hypothesis draws the next body.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
from hypothesis import HealthCheck, given, settings

from tests.fuzz.bodies import bodies
from tests.fuzz.conftest import assert_healthy, client_for
from tests.web.conftest import Server

POSTS = ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize"]
EXAMPLES = 1700  # bodies; each goes to every POST endpoint, with a GET /v1/models beside
REQUESTS = 10_000
JSON = {"Content-Type": "application/json"}


def _check(path: str, body: bytes, reply: httpx.Response) -> None:
    assert reply.status_code < 500, (path, body[:300], reply.text[:500])
    if reply.status_code >= 400:
        error = json.loads(reply.content)["error"]
        assert isinstance(error["message"], str), reply.text
    elif path == "/v1/models":
        assert reply.json()["data"][0]["id"] == "tiny"


def test_no_body_gets_a_5xx_or_hangs(fuzz_server: Server) -> None:
    statuses: list[int] = []
    with client_for(fuzz_server) as client, ThreadPoolExecutor(len(POSTS) + 1) as pool:

        def call(path: str, body: bytes) -> httpx.Response:
            if path == "/v1/models":
                return client.get(path)
            return client.post(path, content=body, headers=JSON)

        @given(body=bodies())
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def send(body: bytes) -> None:
            paths = [*POSTS, "/v1/models"]
            for path, reply in zip(paths, pool.map(call, paths, [body] * len(paths)), strict=True):
                statuses.append(reply.status_code)
                _check(path, body, reply)

        send()
    assert len(statuses) >= REQUESTS, len(statuses)
    print(f"hostile bodies: {len(statuses)} requests, statuses {sorted(set(statuses))}")
    assert {200, 400} <= set(statuses)
    assert_healthy(fuzz_server)
