"""The largest chats a client may send, over real HTTP, while ``/health`` is polled.

A real server of the tiny model (context: 512 tokens) gets the chats of
``benchmarks.huge_chat``: 50,000 empty messages (past ``MAX_MESSAGES``),
``MAX_MESSAGES`` empty messages (templated off the event loop), and
``MAX_MESSAGES`` messages filling a body to just under the 4 MiB limit (a
megabyte-sized prompt, tokenized off the loop). Every one gets a clear 400
(the bound on messages; the other two do not fit the context), ``/health``
answers 200 every 50 ms throughout, and the engine serves a normal chat
after. The poll latencies are printed (``pytest -s``;
``python -m benchmarks.huge_chat`` reports p50/p99); no timing is asserted:
a poll that waits past the hang guard (the heartbeat timeout, the client's
socket timeout) fails, and its status 0 fails the test.
"""

from __future__ import annotations

import os

import pytest

from benchmarks.huge_chat import huge_chats, measure_huge_chat
from tests.web.test_faults import StartServer
from tserve.web._bodies import MAX_MESSAGES

pytestmark = pytest.mark.slow

HEARTBEAT_TIMEOUT = 30.0  # s: the server's default; a poll past it would be a stalled loop


def test_huge_chats_get_a_clear_400_while_health_stays_200(start_server: StartServer) -> None:
    server = start_server()
    engine = server.engine_pid
    chats = huge_chats()
    assert len(chats["full_body"]) > 4_000_000
    run = measure_huge_chat(server.url, chats, guard=HEARTBEAT_TIMEOUT)
    print(run.report())

    chat = {c.name: c for c in run.chats}
    assert (chat["over_bound"].status, chat["over_bound"].error_param) == (400, "messages")
    assert f"<= {MAX_MESSAGES}" in (chat["over_bound"].error_message or "")
    for name in ("at_bound", "full_body"):
        assert chat[name].status == 400, chat[name]
        assert "exceeds the context length of 512 tokens" in (chat[name].error_message or "")
    assert len(run.during_chats()) >= 1  # polls overlapped the chats
    # Each poll's socket times out at the guard: a stalled loop shows as status 0 here.
    assert {p.status for p in run.polls} == {200}

    os.kill(engine, 0)  # the engine process is alive: ProcessLookupError otherwise
    assert server.client.get("/health").status_code == 200
    reply = server.client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_the_chat_bodies_are_what_they_claim() -> None:
    chats = huge_chats()
    assert chats["over_bound"].count(b'"role"') == 50_000 > MAX_MESSAGES
    assert chats["at_bound"].count(b'"role"') == MAX_MESSAGES
    assert chats["full_body"].count(b'"role"') == MAX_MESSAGES
    assert 4 * 2**20 - 2048 < len(chats["full_body"]) <= 4 * 2**20
