"""Browser safety and key checks, over real HTTP: what a web page must not make a local
server do (415, 403), ``--allowed-hosts``, an empty key refused at start, the warning of
an open bind; and a refused request that asked ``Connection: close`` gets it."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.web.conftest import Server

BODY = {"prompt": "hi", "max_tokens": 2}


def error_code(r: httpx.Response) -> str:
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return str(error["code"])


def test_posts_must_be_json_and_hosts_loopback(start_server: Callable[..., Server]) -> None:
    server = start_server()
    client, port = server.client, server.url.rsplit(":", 1)[1]
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {} if content_type is None else {"Content-Type": content_type}
        r = client.post("/v1/completions", content=json.dumps(BODY), headers=headers)
        assert r.status_code == 415 and error_code(r) == "unsupported_media_type"
    r = client.post(
        "/v1/completions",
        content=json.dumps(BODY),
        headers={"Content-Type": "application/json; charset=utf-8"},
    )
    assert r.status_code == 200
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.2:{port}"):
        r = client.post("/v1/completions", json=BODY, headers={"Host": host})
        assert r.status_code == 403 and error_code(r) == "forbidden_host"
        assert client.get("/metrics", headers={"Host": host}).status_code == 403
    for host in (f"localhost:{port}", "LOCALHOST", f"127.0.0.1:{port}", f"[::1]:{port}"):
        assert client.post("/v1/completions", json=BODY, headers={"Host": host}).status_code == 200


def test_allowed_hosts_widen_the_loopback_names(start_server: Callable[..., Server]) -> None:
    server = start_server("--allowed-hosts", "tserve.internal, other.example")
    client = server.client
    assert client.get("/health", headers={"Host": "tserve.internal:80"}).status_code == 200
    assert client.get("/health", headers={"Host": "localhost"}).status_code == 200
    assert client.get("/health", headers={"Host": "evil.example"}).status_code == 403
    anyone = start_server("--allowed-hosts", "*")
    assert anyone.client.get("/health", headers={"Host": "evil.example"}).status_code == 200


def test_an_open_bind_without_a_key_warns(start_server: Callable[..., Server]) -> None:
    server = start_server("--host", "0.0.0.0")
    assert "WITHOUT AN API KEY" in server.log.read_text()
    # Reached by names nobody can list, it does not check Host.
    assert server.client.get("/health", headers={"Host": "gpu-7.lan"}).status_code == 200


def test_an_empty_api_key_is_an_error_at_start(tiny_model_dir: Path) -> None:
    command = [sys.executable, "-m", "tserve", "serve", str(tiny_model_dir), "--port", "0"]
    env = {**os.environ, "TSERVE_EMBEDDING_MODEL": "none"}
    for args, extra in (((["--api-key", ""]), {}), ([], {"TSERVE_API_KEY": ""})):
        done = subprocess.run(
            [*command, *args], env={**env, **extra}, capture_output=True, timeout=120
        )
        assert done.returncode != 0
        assert b"--api-key (or TSERVE_API_KEY) is empty" in done.stderr


def test_a_refused_request_with_connection_close_is_closed(
    start_server: Callable[..., Server],
) -> None:
    # One slot, held by a slow echo request (100 steps of 1 s) in a thread.
    server = start_server(
        "--max-pending", "1", "--max-queued", "0", "--engine-kind", "echo", "--echo-step-time", "1"
    )

    def hold() -> None:
        with contextlib.suppress(httpx.HTTPError):  # the server is killed under it
            httpx.post(
                f"{server.url}/v1/completions", json={**BODY, "max_tokens": 100}, timeout=300
            )

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    server.wait_for_metric("tserve_requests_live", 1)
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(BODY).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:  # a hang guard
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nConnection: close\r\n"
            + f"Host: {host}:{port}\r\nContent-Type: application/json\r\n".encode()
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        response = b""
        while chunk := sock.recv(1 << 16):  # to EOF: the server closes the connection
            response += chunk
    assert response.startswith(b"HTTP/1.1 503")
    assert b"overloaded" in response
