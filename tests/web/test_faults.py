"""Faults against real servers: overload, engine kill -9, SIGTERM while streaming."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx
import openai
import pytest

from tests.web.conftest import Server

pytestmark = pytest.mark.slow

StartServer = Callable[..., Server]
LONG = {"prompt": "x", "max_tokens": 480, "ignore_eos": True}
# The echo engine at 10 steps a second: a LONG request needs 48 s, so a test
# that ends it long before cannot race it.
PACED = ("--engine-kind", "echo", "--echo-step-time", "0.1")


def read_stream(url: str, body: dict[str, object], out: list[list[str]]) -> None:
    """Read one SSE stream to its end (in a thread) and append its data lines."""
    with (
        httpx.Client(base_url=url, timeout=120) as client,
        client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r,
    ):
        if r.status_code != 200:  # failed before its first token: a plain error
            r.read()
            status = f"status:{r.status_code}:{r.json()['error']['code']}"
            if r.status_code == 503 and not r.headers.get("Retry-After", "").isdigit():
                status += ":no-retry-after"
            out.append([status])
            return
        out.append([line[6:] for line in r.iter_lines() if line.startswith("data: ")])


def finish_of(events: list[str]) -> str | None:
    """The finish reason of a completed stream, or the error code of a failed one."""
    if events[0].startswith("status:"):
        return events[0]
    assert events[-1] == "[DONE]", events[-3:]
    last = json.loads(events[-2])
    if "error" in last:
        return f"error:{last['error']['code']}"
    return str(last["choices"][0]["finish_reason"])


def start_streams(
    server: Server, count: int, body: dict[str, object]
) -> tuple[list[threading.Thread], list[list[str]]]:
    out: list[list[str]] = []
    threads = [
        threading.Thread(target=read_stream, args=(server.url, body, out)) for _ in range(count)
    ]
    for t in threads:
        t.start()
    server.wait_for_metric("tserve_requests_live", count)
    return threads, out


def test_overload_gets_503_at_once_and_admitted_complete(start_server: StartServer) -> None:
    """Four streams take the four slots while the engine is stopped, so none can
    finish before the burst is refused; once it runs again, all four complete."""
    server = start_server("--max-pending", "4", "--max-queued", "0", "--max-num-seqs", "1")
    with server.engine_stopped():
        threads, out = start_streams(server, 4, LONG)
        with httpx.Client(base_url=server.url, timeout=30) as client:
            burst = [client.post("/v1/completions", json=LONG) for _ in range(40)]
            assert client.get("/health").status_code == 200
            assert client.get("/ready").status_code == 503  # saturated
        sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as info:
            sdk.completions.create(model="tiny", prompt="x", max_tokens=480)
        assert info.value.status_code == 503
    assert {r.status_code for r in burst} == {503}
    assert all(r.headers["Retry-After"].isdigit() for r in burst)
    assert {r.json()["error"]["code"] for r in burst} == {"overloaded"}
    for t in threads:
        t.join(120)
    assert [finish_of(events) for events in out] == ["length"] * 4
    server.wait_for_metric("tserve_requests_live", 0)
    assert server.client.get("/ready").status_code == 200


def test_requests_queue_up_to_the_bound_then_get_503(start_server: StartServer) -> None:
    """2 running and 3 waiting for a slot fill the queue (the engine stopped, so
    none leaves it): the next get 503 at once, /ready says saturated, and all
    5 admitted complete once the engine runs again."""
    server = start_server("--max-pending", "2", "--max-queued", "3", "--max-num-seqs", "1")
    with server.engine_stopped():
        threads, out = start_streams(server, 5, LONG)
        with httpx.Client(base_url=server.url, timeout=30) as client:
            burst = [client.post("/v1/completions", json=LONG) for _ in range(10)]
            assert client.get("/ready").status_code == 503  # saturated
    assert {r.status_code for r in burst} == {503}
    assert {r.json()["error"]["code"] for r in burst} == {"overloaded"}
    for t in threads:
        t.join(120)
    assert [finish_of(events) for events in out] == ["length"] * 5
    server.wait_for_metric("tserve_requests_live", 0)
    assert server.client.get("/ready").status_code == 200


T = TypeVar("T")


def wait_for_a_started_stream(server: Server) -> None:
    """Until some stream has its second token: its headers were sent, so it must
    end with an error event rather than a status."""
    deadline = time.monotonic() + 60  # a hang guard
    while server.metric("vllm:inter_token_latency_seconds_count") < 1:
        assert time.monotonic() < deadline, "no stream ever got past its first token"
        time.sleep(0.05)


def stream_through_engine_kill(
    server: Server, path: str, body: dict[str, object], events: Callable[[httpx.Response], T]
) -> T:
    """Stream ``body`` to ``path`` in a thread, SIGKILL the engine once the stream
    is past its first token (so it must end with an error event, not a status),
    and return what ``events`` read from the response."""
    out: list[T] = []

    def read() -> None:
        with (
            httpx.Client(base_url=server.url, timeout=120) as client,
            client.stream("POST", path, json={**body, "stream": True}) as r,
        ):
            out.append(events(r))

    reader = threading.Thread(target=read)
    reader.start()
    server.wait_for_metric("tserve_requests_live", 1)
    wait_for_a_started_stream(server)
    os.kill(server.engine_pid, signal.SIGKILL)
    reader.join(60)
    assert out, "the stream did not end within 60 s of the kill"
    return out[0]


def test_engine_kill_fails_every_request_and_exits_nonzero(start_server: StartServer) -> None:
    """The echo engine at 10 steps a second runs one request at a time: the
    running stream needs 48 s for its 480 tokens, so at the kill (its second
    token) it is mid-stream, and the others are still waiting for a first one."""
    server = start_server("--max-num-seqs", "1", *PACED)
    threads, out = start_streams(server, 3, LONG)
    plain: list[httpx.Response] = []
    blocker = threading.Thread(
        target=lambda: plain.append(
            httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=60)
        )
    )
    blocker.start()
    server.wait_for_metric("tserve_requests_live", 4)
    wait_for_a_started_stream(server)
    os.kill(server.engine_pid, signal.SIGKILL)
    for t in [*threads, blocker]:
        t.join(60)
    # The started stream ends with an error event; the two still waiting for
    # their first token get a plain 503, as does the non-streamed request.
    finishes = sorted(str(finish_of(e)) for e in out)
    assert finishes == ["error:engine_dead", "status:503:engine_dead", "status:503:engine_dead"]
    assert plain[0].status_code == 503 and plain[0].json()["error"]["code"] == "engine_dead"
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 503
    assert server.process.wait(60) != 0


@pytest.mark.parametrize(
    ("sig", "to_group"),
    [(signal.SIGTERM, False), (signal.SIGINT, True), (signal.SIGTERM, True)],
    ids=["sigterm", "ctrl-c-to-the-group", "sigterm-to-the-group"],
)
def test_sigterm_drains_streams_then_exits_zero(
    start_server: StartServer, sig: signal.Signals, to_group: bool
) -> None:
    """SIGTERM or Ctrl-C drains; a signal to the whole process group (a terminal's
    Ctrl-C, a supervisor's stop) does not reach the engine, which lives in a
    process group of its own (in the server's session, where the scheduler
    weighs its threads' nice values against the API process's), so the
    streams still finish. The signal comes while the engine is stopped, so
    all three streams are in flight when it does."""
    server = start_server("--max-num-seqs", "1", "--shutdown-timeout", "60")
    engine = server.engine_pid
    assert os.getsid(engine) == os.getsid(server.process.pid)
    assert os.getpgid(engine) == engine != os.getpgid(server.process.pid)
    with server.engine_stopped():
        threads, out = start_streams(server, 3, LONG)
        if to_group:
            os.killpg(server.process.pid, sig)
        else:
            server.process.send_signal(sig)
    for t in threads:
        t.join(120)
    assert [finish_of(e) for e in out] == ["length"] * 3
    assert all(sum('"text"' in e for e in events) >= 1 for events in out)
    assert server.process.wait(60) == 0
    assert not Path(f"/proc/{engine}").exists() or _is_zombie(engine)


def test_sigterm_past_the_timeout_ends_streams_with_an_error_event(
    start_server: StartServer,
) -> None:
    """Past --shutdown-timeout every request still running ends with an error, never a cut.

    The echo engine at 10 steps a second runs one request at a time and the
    others queue in it. SIGTERM comes once the running stream had its second
    token; it needs 48 s for its 480, far past the 0.2 s timeout. A response
    whose headers were sent ends with a final ``shutting_down`` error event
    and ``[DONE]``; one still waiting for its first token has sent nothing
    yet, so it gets the plain 503 + Retry-After error JSON.
    """
    server = start_server("--max-num-seqs", "1", "--shutdown-timeout", "0.2", *PACED)
    threads, out = start_streams(server, 4, {**LONG, "prompt": "y"})
    engine = server.engine_pid
    wait_for_a_started_stream(server)
    server.process.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    finishes = sorted(str(finish_of(e)) for e in out)  # each stream ends with a final event
    assert finishes == ["error:shutting_down"] + ["status:503:shutting_down"] * 3
    assert server.process.wait(60) == 0
    assert not Path(f"/proc/{engine}").exists() or _is_zombie(engine)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True
