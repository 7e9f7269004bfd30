"""The HTTP server under test: ``python -m tserve serve`` on the echo engine.

:func:`start_server` starts it on loopback with any free port and N API
processes, waits for its "serving" line and finds its processes (the main
API process, the worker API processes, the engine); :func:`stop_server`
sends SIGTERM, then SIGKILL past a grace period. Everything but the engine
(kind, step time, batch size) and the embedding model (none: it would only
add a start-up) is left at the server's defaults.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks._results import REPO_ROOT
from benchmarks.frontend_table._client import SERVED_NAME

__all__ = ["EchoServer", "cpu_seconds", "start_server", "stop_server"]

_TICKS = os.sysconf("SC_CLK_TCK")
_START_TIMEOUT = 180.0  # seconds for the "serving" line (a loaded machine is slow)
_TERM_GRACE = 30.0  # seconds between SIGTERM and SIGKILL
_SERVING = "tserve: serving "


@dataclass
class EchoServer:
    """A started server and its processes."""

    process: subprocess.Popen[bytes]
    url: str  # http://127.0.0.1:PORT
    api_pids: list[int]  # the main API process first, then the workers
    engine_pid: int


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU seconds ``pid`` has used so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def start_server(
    model: str, api_processes: int, step_time: float, max_num_seqs: int, log: Path
) -> EchoServer:
    """Start the server and wait until it serves. Blocks (seconds).

    Raises RuntimeError if it exits or does not serve within a few minutes.
    """
    command = [
        sys.executable, "-m", "tserve", "serve", model,
        "--host", "127.0.0.1", "--port", "0",
        "--served-model-name", SERVED_NAME,
        "--api-processes", str(api_processes),
        "--engine-kind", "echo",
        "--echo-step-time", str(step_time),
        "--max-num-seqs", str(max_num_seqs),
        "--embedding-model", "none",
    ]  # fmt: skip
    out = log.with_suffix(".stdout")
    with out.open("wb") as stdout, log.open("wb") as stderr:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr
        )
    deadline = time.monotonic() + _START_TIMEOUT
    while (url := _serving_url(out)) is None:
        if process.poll() is not None or time.monotonic() > deadline:
            stop_server(process)
            raise RuntimeError(f"the server did not start; see {log}")
        time.sleep(0.1)
    workers, engines = _children(process.pid)
    if len(engines) != 1 or len(workers) != api_processes - 1:
        stop_server(process)
        raise RuntimeError(f"unexpected processes under the server: {workers}, {engines}")
    return EchoServer(process, url, [process.pid, *workers], engines[0])


def stop_server(process: subprocess.Popen[bytes]) -> int | None:
    """SIGTERM, then SIGKILL after a grace period; the exit code (negative: a signal)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(_TERM_GRACE)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def _serving_url(stdout: Path) -> str | None:
    for line in stdout.read_text(errors="replace").splitlines():
        if line.startswith(_SERVING):
            return line.rsplit(" at ", 1)[1].strip().removesuffix("/v1")
    return None


def _children(pid: int) -> tuple[list[int], list[int]]:
    """The worker API processes and the engines among ``pid``'s children."""
    workers, engines = [], []
    for listing in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in map(int, listing.read_text().split()):
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            if b"tserve.gpu" in argv:
                engines.append(child)
            elif b"tserve.web._worker_main" in argv:
                workers.append(child)
    return workers, engines
