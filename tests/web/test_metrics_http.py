"""The pieces of ``--metrics-port`` without a server: the stats files, the cached
rendering, the same families as the serving port, and ``GET /metrics`` on loopback.

The waits are hang guards, not timings; the rendering's clock is a list the
test moves by hand.
"""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
from pathlib import Path

import msgspec
import trio
import trio.testing

from tests.guards import HANG_GUARD
from tests.web.test_metrics_contract import samples
from tserve._metrics_dir import ENV
from tserve.nursery import LLMStats
from tserve.protocol import EngineStats
from tserve.web._browser import BrowserGuard
from tserve.web._metrics import CONTENT_TYPE
from tserve.web._metrics_http import MAX_AGE, REFRESH, Rendering, serve_metrics
from tserve.web._stats_files import PUBLISH_INTERVAL, ProcessStats, publish_stats, read_stats


def write_stats(directory: Path, pid: int, live: int, in_flight: int, engine: EngineStats) -> None:
    snapshot = ProcessStats(pid, 0.0, live, 0, 0, 1, in_flight, True, engine)
    (directory / f"stats-{pid}.msgpack").write_bytes(msgspec.msgpack.encode(snapshot))


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_the_stats_files_sum_the_live_processes_and_keep_the_engines_latest_report(
    tmp_path: Path,
) -> None:
    write_stats(tmp_path, os.getpid(), 2, 1, EngineStats(running=3, steps=10))
    write_stats(tmp_path, os.getppid(), 5, 4, EngineStats(running=1, steps=12))
    write_stats(tmp_path, dead_pid(), 100, 100, EngineStats(running=9, steps=99))
    stats, in_flight = read_stats(tmp_path)
    assert (stats.live_requests, stats.aborts_sent, in_flight) == (7, 2, 5)
    assert stats.engine == EngineStats(running=1, steps=12)  # the latest step's report
    assert stats.engine_alive


def test_without_stats_files_the_engine_reads_as_not_alive(tmp_path: Path) -> None:
    (tmp_path / "stats-1.msgpack").write_bytes(b"not msgpack")
    stats, in_flight = read_stats(tmp_path)
    assert (stats.live_requests, in_flight, stats.engine_alive) == (0, 0, False)


def test_publish_stats_rewrites_its_file_only_when_the_numbers_change(tmp_path: Path) -> None:
    numbers = {"live": 3}

    def llm_stats() -> LLMStats:
        return LLMStats(numbers["live"], 0, EngineStats(steps=4), engine_alive=True)

    path = tmp_path / f"stats-{os.getpid()}.msgpack"

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(publish_stats, tmp_path, llm_stats, lambda: 2)
            await trio.sleep(PUBLISH_INTERVAL / 2)
            assert read_stats(tmp_path)[0].live_requests == 3
            written = path.stat().st_ino
            await trio.sleep(PUBLISH_INTERVAL * 3)
            assert path.stat().st_ino == written  # unchanged: not rewritten
            numbers["live"] = 8
            await trio.sleep(PUBLISH_INTERVAL * 2)
            assert read_stats(tmp_path) == (
                LLMStats(8, 0, EngineStats(steps=4), engine_alive=True),
                2,
            )
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_scrape_reads_live_numbers_now_and_renders_the_shared_text_after_it() -> None:
    now = [100.0]
    renders: list[float] = []

    def shared() -> bytes:
        renders.append(now[0])
        return b"shared\n"

    async def main() -> None:
        rendering = Rendering(lambda: f"live {now[0]}\n".encode(), shared, lambda: now[0])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rendering.keep_fresh)
            assert rendering.text() == b"live 100.0\nshared\n"  # none yet: rendered first
            assert renders == [100.0]
            now[0] += REFRESH / 2
            assert rendering.text() == f"live {now[0]}\nshared\n".encode()  # fresh: from memory
            await trio.testing.wait_all_tasks_blocked()
            assert renders == [100.0]
            now[0] += REFRESH
            rendering.text()  # stale: answered from memory, rendered after it
            assert renders == [100.0]
            await trio.testing.wait_all_tasks_blocked()
            assert renders == [100.0, 100.0 + 1.5 * REFRESH]
            now[0] += MAX_AGE + 1  # too old to serve: rendered before the answer
            rendering.text()
            assert len(renders) == 3
            nursery.cancel_scope.cancel()

    trio.run(main)


_BOTH = """
import sys
from pathlib import Path
from prometheus_client.exposition import generate_latest
from tserve.nursery import Delta, LLMStats, Usage
from tserve.protocol import EngineStats
from tserve.web._metrics import Metrics, RequestRecord, engine_registry, request_registry
from tserve.web._stats_files import read_stats
directory = sys.argv[1]
stats = LLMStats(live_requests=1, aborts_sent=0, engine=EngineStats(running=1), engine_alive=True)
m = Metrics(lambda: stats, lambda: 1, "smol", block_size=16, num_gpu_blocks=64)
r = RequestRecord(m, "/v1/completions", "r", log_line=False)
r.delta(0, Delta("x", [1], finish_reason="stop", usage=Usage(2, 1)))
r.done(200)
live = engine_registry(
    lambda: read_stats(Path(directory)), "smol", block_size=16, num_gpu_blocks=64
)
sys.stdout.write(m.render().decode() + "\\f")
sys.stdout.write((generate_latest(live) + generate_latest(request_registry(directory))).decode())
"""


def test_the_metrics_process_renders_the_families_of_the_serving_port(tmp_path: Path) -> None:
    """One process writes its request metrics and its stats file; the metrics
    process's registries render the same samples as that process's own /metrics."""
    engine = EngineStats(running=1)
    env = {**os.environ, ENV: str(tmp_path)}
    write_stats(tmp_path, os.getpid(), 1, 1, engine)  # as the writer's publish_stats would
    out = subprocess.run(
        [sys.executable, "-c", _BOTH, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout
    serving, metrics_port = (samples(text) for text in out.split("\f"))
    assert serving.keys() == metrics_port.keys()
    for name in ("vllm:request_success_total", "vllm:num_requests_running", "tserve_requests_live"):
        assert serving[name] == metrics_port[name], name
    assert metrics_port["vllm:cache_config_info"][0][0]["num_gpu_blocks"] == "64"


def get(conn: http.client.HTTPConnection, path: str, **headers: str) -> tuple[int, str, bytes]:
    conn.request("GET", path, headers=headers)
    response = conn.getresponse()
    return response.status, response.getheader("content-type", ""), response.read()


def test_get_metrics_on_loopback_keeps_the_connection_and_checks_host(
    listener: socket.socket,
) -> None:
    host, port = listener.getsockname()
    rendering = Rendering(lambda: b"live 1\n", lambda: b"shared 2\n")

    def client() -> None:
        conn = http.client.HTTPConnection(host, port, timeout=HANG_GUARD)
        try:
            assert get(conn, "/metrics") == (200, CONTENT_TYPE, b"live 1\nshared 2\n")
            assert get(conn, "/metrics?name=x")[0] == 200  # the same connection, kept
            assert get(conn, "/v1/models")[0] == 404
            assert get(conn, "/metrics", Host="evil.example")[0] == 403  # DNS rebinding
            conn.request("POST", "/metrics", body=b"{}")
            response = conn.getresponse()
            assert (response.status, response.getheader("allow")) == (405, "GET")
            response.read()
        finally:
            conn.close()
        with socket.create_connection((host, port), timeout=HANG_GUARD) as raw:  # HTTP/1.0
            raw.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            answer = b"".join(iter(lambda: raw.recv(4096), b""))  # the server closes
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
        assert answer.endswith(b"live 1\nshared 2\n")

    async def main() -> None:
        with trio.fail_after(HANG_GUARD):
            async with trio.open_nursery() as nursery:
                guard = BrowserGuard.for_bind("127.0.0.1")
                nursery.start_soon(serve_metrics, listener, rendering, guard)
                await trio.to_thread.run_sync(client)
                nursery.cancel_scope.cancel()

    trio.run(main)
