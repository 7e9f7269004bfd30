"""How long an engine's death takes to reach the live streams, over real HTTP.

A server of MODEL with an embedding engine (``--embedding-model``) gets
``--streams`` live streaming completions; once each has had its first
token, one engine process (generation or embedding) is killed with
SIGKILL. The generation engine is held (SIGSTOP) until every stream is
admitted, so that all start at the same step and none can finish before
the kill (with the tiny test model, whose steps take a millisecond, the
first streams used to finish before the last had started). Reported: the
time from the kill to the last stream's error event, and how each stream
ended. Run one server per engine (the kill ends it)::

    python -m benchmarks.engine_death MODEL [--engine generation|embedding|both]

``measure_engine_death`` is the measurement alone, for a server the caller
started (tests/web/test_engine_death.py uses it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks._serve import serve

__all__ = ["DeathTiming", "engine_pids", "main", "measure_engine_death"]

_BODY = {"prompt": "x", "max_tokens": 480, "ignore_eos": True, "stream": True}
_LIVE = re.compile(r"^tserve_requests_live (\S+)$", re.MULTILINE)


@dataclass
class DeathTiming:
    """What one kill did to the live streams."""

    engine: str  # "generation" or "embedding"
    streams: int
    killed_at: float = 0.0  # time.monotonic() of the kill
    exited_at: float = 0.0  # when its pidfd said the process was gone (the kernel's share)
    # How each stream ended: "error:<code>", a finish reason, or "status:<n>".
    endings: list[str] = field(default_factory=list)
    ended_at: list[float] = field(default_factory=list)  # monotonic, per ending

    @property
    def last_error_after(self) -> float:
        """Seconds from the kill to the last stream's end."""
        return max(self.ended_at) - self.killed_at

    def report(self) -> str:
        kinds = sorted(set(self.endings))
        gone = (self.exited_at - self.killed_at) * 1000
        return (
            f"{self.engine} engine kill -9 with {self.streams} live streams: last error event "
            f"{self.last_error_after * 1000:.0f} ms after the kill (the process was gone after "
            f"{gone:.0f} ms); endings {kinds}"
        )


def engine_pids(api_pid: int) -> dict[str, int]:
    """The API process's engine children by kind ("generation", "embedding")."""
    tasks = Path(f"/proc/{api_pid}/task").glob("*/children")
    pids = [int(p) for children in tasks for p in children.read_text().split()]
    found: dict[str, int] = {}
    for pid in pids:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"-m\0tserve.gpu\0" not in command:
            continue  # an API worker, a grammar worker
        found["embedding" if b'"task":"embed"' in command else "generation"] = pid
    return found


def measure_engine_death(
    url: str, engine: str, pids: dict[str, int], *, streams: int = 50, guard: float = 120.0
) -> DeathTiming:
    """Start ``streams`` streams at ``url``, SIGKILL ``pids[engine]`` once each has a
    token, and time how they end. ``pids`` is :func:`engine_pids`: the generation
    engine is stopped until every stream is admitted. Blocks; ``guard`` s bounds
    every wait (AssertionError)."""
    timing = DeathTiming(engine, streams)
    lock = threading.Lock()
    started = threading.Semaphore(0)
    threads = [
        threading.Thread(target=_stream, args=(url, timing, lock, started, guard), daemon=True)
        for _ in range(streams)
    ]
    os.kill(pids["generation"], signal.SIGSTOP)
    try:
        for thread in threads:
            thread.start()
        _wait_admitted(url, streams, guard)
    finally:
        os.kill(pids["generation"], signal.SIGCONT)
    for _ in range(streams):
        if not started.acquire(timeout=guard):
            raise AssertionError("a stream never got its first token")
    pidfd = os.pidfd_open(pids[engine])
    try:
        timing.killed_at = time.monotonic()
        os.kill(pids[engine], signal.SIGKILL)
        select.select([pidfd], [], [], guard)  # readable once the kernel has torn it down
        timing.exited_at = time.monotonic()
    finally:
        os.close(pidfd)
    for thread in threads:
        thread.join(guard)
        if thread.is_alive():
            raise AssertionError("a stream never ended after the kill")
    return timing


def _wait_admitted(url: str, streams: int, guard: float) -> None:
    """Poll ``/metrics`` until ``streams`` requests are live. Blocks up to ``guard`` s."""
    deadline = time.monotonic() + guard
    with httpx.Client(base_url=url, timeout=guard) as client:
        while time.monotonic() < deadline:
            found = _LIVE.search(client.get("/metrics").text)
            if found is not None and float(found.group(1)) >= streams:
                return
            time.sleep(0.01)
    raise AssertionError(f"{streams} streams were never live at once")


def _stream(
    url: str,
    timing: DeathTiming,
    lock: threading.Lock,
    started: threading.Semaphore,
    guard: float,
) -> None:
    """One streaming completion: signal ``started`` at its first token, record its end."""
    ending, first = "cut", True
    with (
        httpx.Client(base_url=url, timeout=guard) as client,
        client.stream("POST", "/v1/completions", json=_BODY) as response,
    ):
        if response.status_code != 200:
            ending = f"status:{response.status_code}"
            started.release()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                ending = f"error:{event['error']['code']}"
                break
            if first:
                first = False
                started.release()
            reason = event["choices"][0].get("finish_reason")
            if reason is not None:
                ending = str(reason)
    with lock:
        timing.ended_at.append(time.monotonic())
        timing.endings.append(ending)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a model directory for tserve serve")
    parser.add_argument("--engine", choices=["generation", "embedding", "both"], default="both")
    parser.add_argument("--streams", type=int, default=50)
    parser.add_argument("--log", type=Path, default=Path("/tmp/tserve-engine-death.log"))
    args = parser.parse_args(argv)
    engines = ["generation", "embedding"] if args.engine == "both" else [args.engine]
    for engine in engines:
        options = ("--embedding-model", "default", "--max-num-seqs", "64")
        process, url = serve(args.model, args.log, *options)
        try:
            pids = engine_pids(process.pid)
            print(measure_engine_death(url, engine, pids, streams=args.streams).report())
        finally:
            if process.poll() is None:
                process.kill()
            process.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
