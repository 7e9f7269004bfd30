"""``--api-processes 2``: two API processes on one port (SO_REUSEPORT), one engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.processes import child_pids, command_line, process_gone
from tests.web.conftest import Server

pytestmark = pytest.mark.slow

TOKENS = 12


def children(pid: int) -> dict[int, str]:
    """The child processes of ``pid``, by pid, with their command lines."""
    found: dict[int, str] = {}
    for child in child_pids(pid):
        cmdline = command_line(child)
        if cmdline is not None:
            found[child] = cmdline.replace(b"\0", b" ").decode()
    return found


def wait_until_gone(pids: list[int], timeout: float = 60.0) -> list[int]:
    """Poll until every pid is gone; return those left (a hang guard, not a timing check)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(process_gone(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if not process_gone(p)]


def grammar_workers(server: Server, worker: int, timeout: float = 60.0) -> list[int]:
    """The API processes' grammar worker processes, once the second API process
    has started its own (it prepares its model's at startup; the first starts
    one at its first constrained request). A hang guard, not a timing check."""
    deadline = time.monotonic() + timeout
    while True:
        found = [
            pid
            for api in (server.process.pid, worker)
            for pid, cmd in children(api).items()
            if "tserve._grammar_worker" in cmd
        ]
        mine = [pid for pid in found if pid in children(worker)]
        if mine or time.monotonic() > deadline:
            assert mine, found
            return found
        time.sleep(0.1)


def stream_one(url: str, i: int) -> tuple[int, int]:
    """One streaming completion on a fresh connection: (status, completion tokens)."""
    body = {
        "prompt": f"request {i}",
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with (
        httpx.Client(base_url=url, timeout=120) as client,
        client.stream("POST", "/v1/completions", json=body) as r,
    ):
        if r.status_code != 200:
            return r.status_code, 0
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return 200, json.loads(events[-2])["usage"]["completion_tokens"]


def start(tiny_model_dir: Path, tmp_path: Path, *args: str) -> tuple[Server, int, int]:
    """A server with two API processes and request logs, and ``args``: (server, worker pid,
    engine pid)."""
    server = Server(
        tiny_model_dir,
        *("--api-processes", "2", "--log-level", "info", "--served-model-name", "tiny"),
        *("--embedding-model", "none", *args),
        log=tmp_path / "server.log",
    )
    kids = children(server.process.pid)
    workers = [pid for pid, cmd in kids.items() if "tserve.web._worker_main" in cmd]
    engines = [pid for pid, cmd in kids.items() if "tserve.gpu" in cmd]
    assert len(workers) == 1 and len(engines) == 1, kids
    return server, workers[0], engines[0]


def test_two_api_processes_share_the_port_and_the_engine(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """64 concurrent streams over fresh connections: every one 200 with exactly
    TOKENS tokens, served by both processes (the request log carries the pid);
    then SIGTERM drains both, stops the engine, exits 0 and leaves no child
    (the API processes' grammar workers included)."""
    server, worker, engine = start(tiny_model_dir, tmp_path)
    checkers = grammar_workers(server, worker)
    try:
        with ThreadPoolExecutor(64) as pool:
            results = list(pool.map(lambda i: stream_one(server.url, i), range(64)))
        assert results == [(200, TOKENS)] * 64
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(120) == 0
        assert wait_until_gone([worker, engine, *checkers]) == []
    finally:
        server.stop(signal.SIGKILL)
    served_by = [
        int(line.split()[2])
        for line in server.log.read_text().splitlines()
        if " tserve.access " in line and "/v1/completions 200" in line
    ]
    assert len(served_by) == 64
    assert set(served_by) == {server.process.pid, worker}


def test_kill_9_of_the_main_process_ends_the_workers_the_metrics_process_and_the_engine(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    server, worker, engine = start(tiny_model_dir, tmp_path, "--metrics-port", "0")
    (metrics,) = [p for p, cmd in children(server.process.pid).items() if "_metrics_main" in cmd]
    checkers = grammar_workers(server, worker)
    server.process.kill()
    server.process.wait(60)
    assert wait_until_gone([worker, metrics, engine, *checkers]) == []


def test_api_processes_appear_in_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tserve", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "200"},
    ).stdout
    assert "--api-processes" in out and "SO_REUSEPORT" in out
