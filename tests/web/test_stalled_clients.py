"""Clients that stop reading, over real HTTP: raw sockets with a tiny receive buffer.

A stalled reader's requests leave admission once the engine has finished
them, its connection is closed after ``--stall-timeout``, other clients are
served meanwhile, and a SIGTERM drain never waits on it past
``--shutdown-timeout`` (the waits below are hang guards, not timings).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator

import pytest

from tests.web.conftest import Server

# About 64 x 128 chunks of some 2 KB each (20 alternatives per token, every
# choice to its max_tokens): some 17 MB, twice what a response's 4 MiB send
# buffer and the kernel's (tcp_wmem's 4 MiB here) hold between the server and a
# reader that never reads, so the server's writes stall. (At 64 tokens the two
# came within a few hundred KB of the whole response: a run whose choices
# were short could fit, finish, and leave its connection open.)
BIG_STREAM = {
    "messages": [{"role": "user", "content": "hi"}],
    "n": 64,
    "max_tokens": 128,
    "ignore_eos": True,
    "logprobs": True,
    "top_logprobs": 20,
}
# The same without logprobs (some 800 KB): within a response's 4 MiB send
# buffer, so the engine's work finishes while the client reads nothing.
BUFFERED_STREAM = {"messages": [{"role": "user", "content": "hi"}], "n": 64, "max_tokens": 64}


def stalled_reader(server: Server, body: dict[str, object]) -> socket.socket:
    """A connection that sends a streaming chat, reads its status line, then stops reading."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connect: a tiny window
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    sock.settimeout(60)  # a hang guard
    sock.connect((host, int(port)))
    payload = json.dumps({**body, "stream": True}).encode()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\n"
        + f"Host: {host}:{port}\r\nContent-Type: application/json\r\n".encode()
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    assert sock.recv(12).startswith(b"HTTP/1.1 200")
    return sock


def read_until_closed(sock: socket.socket) -> None:
    """Read until the server closes the connection (EOF or reset); hang-guarded."""
    while True:
        try:
            if not sock.recv(1 << 16):
                return
        except ConnectionResetError:
            return


def wait_for_log(server: Server, text: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout  # a hang guard
    while text not in server.log.read_text():
        assert time.monotonic() < deadline, f"the server never logged {text!r}"
        time.sleep(0.1)


@pytest.fixture
def stalled() -> Iterator[list[socket.socket]]:
    socks: list[socket.socket] = []
    yield socks
    for sock in socks:
        sock.close()


def test_stalled_readers_free_their_slots_and_are_disconnected(
    start_server: Callable[..., Server], stalled: list[socket.socket]
) -> None:
    server = start_server("--stall-timeout", "2", "--max-pending", "256")
    assert server.metric("tserve_stalled_responses_total") == 0
    stalled.extend(stalled_reader(server, BIG_STREAM) for _ in range(2))
    # Every request the stalled clients made is finished and released.
    server.wait_for_metric("tserve_requests_live", 0, timeout=120)
    # Others are served meanwhile, with the whole budget of slots.
    r = server.client.post(
        "/v1/chat/completions", json={**BIG_STREAM, "n": 128, "max_tokens": 2}, timeout=120
    )
    assert r.status_code == 200 and len(r.json()["choices"]) == 128
    # After the stall timeout the server closed both connections.
    wait_for_log(server, "accepted no bytes for 2.0 s")
    for sock in stalled:
        read_until_closed(sock)
    assert server.metric("tserve_stalled_responses_total") == 2  # /metrics counts both
    assert server.client.get("/health").status_code == 200


def test_sigterm_does_not_wait_on_stalled_readers(
    start_server: Callable[..., Server], stalled: list[socket.socket]
) -> None:
    server = start_server("--stall-timeout", "600", "--shutdown-timeout", "2")
    stalled.extend(stalled_reader(server, BUFFERED_STREAM) for _ in range(2))
    server.wait_for_metric("tserve_requests_live", 0, timeout=120)
    # Killed (not 0) past the hang guard: without a bound on writes, the
    # drain waited on the stalled clients for as long as they stayed.
    assert server.stop(timeout=60) == 0, server.log.read_text()[-3000:]
    for sock in stalled:
        read_until_closed(sock)
