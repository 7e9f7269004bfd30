"""The server under test: ``python -m tserve serve`` started, found and stopped.

:func:`start_server` starts it on loopback with ``--port 0`` and its output
in a log file; :func:`wait_ready` reads the port from the log, waits for
``/health`` and finds the engine child; :func:`stop_server` sends SIGTERM,
then SIGKILL past a grace period, and checks that the engine is gone too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from benchmarks._results import REPO_ROOT
from benchmarks.seed_http._load import MODEL_NAME

__all__ = [
    "ServerProcs",
    "build_model",
    "server_command",
    "start_server",
    "stop_server",
    "wait_ready",
]

_URL_LINE = re.compile(rb"serving '.*' at http://127\.0\.0\.1:(\d+)/v1")
_ADMISSION_LINE = re.compile(
    rb"admission: (\d+) requests run at once; up to (\d+) more may wait, "
    rb"holding at most (\d+) prompt tokens"
)
_TERM_GRACE = 30.0  # seconds between SIGTERM and SIGKILL (the server drains for 10)
_ENGINE_GRACE = 10.0  # seconds the engine gets to follow its API process out


@dataclass
class ServerProcs:
    """The server's two processes, once it is ready."""

    api_pid: int
    engine_pid: int
    ipc_path: str  # the engine's ipc:// socket path
    port: int = 0  # the HTTP port the API process listens on
    # The admission bounds the server logged at start (--max-queued auto resolved).
    admission: dict[str, int] | None = None


def build_model(spec: str, scratch: Path) -> str:
    """The model argument for ``tserve serve``: a tiny model built now, or as given.

    Blocks while the tiny model is built (seconds, in a child process).
    """
    if spec != "tiny":
        return spec
    target = scratch / "tiny"
    code = (
        "import sys; from tserve.gpu.models._directory import build_tiny_model as b; b(sys.argv[1])"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(target)],
        cwd=REPO_ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return str(target)


def server_command(args: argparse.Namespace, model: str) -> list[str]:
    """The server's argv: loopback, any free port, admission above the request count
    (or, with ``--server-defaults``, every admission, engine and logging option
    at its default)."""
    command = [
        sys.executable, "-m", "tserve", "serve", model,
        "--host", "127.0.0.1", "--port", "0",
        "--served-model-name", MODEL_NAME,
        "--engine-kind", args.engine_kind,
        "--shutdown-timeout", "10",
    ]  # fmt: skip
    if args.server_defaults:
        return command
    return [
        *command,
        "--no-request-log",
        "--max-pending", str(args.max_pending),
        "--max-num-seqs", str(args.max_num_seqs),
        "--kv-cache-tokens", str(args.kv_cache_tokens),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
    ]  # fmt: skip


async def start_server(command: list[str], log_path: Path) -> trio.Process:
    """Start ``command`` with stdout and stderr in ``log_path`` (a checkpoint)."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        return await trio.lowlevel.open_process(
            command, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=log
        )
    finally:
        os.close(log)


async def _poll(check: Callable[[], Awaitable[bool]], period: float = 0.1) -> None:
    """Return once ``check()`` is true, asking every ``period`` seconds.

    For state in another process, which sends this one no event to wait on.
    """
    while not await check():  # noqa: ASYNC110 (another process's state: nothing to wait on)
        await trio.sleep(period)


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _find_engine(api_pid: int) -> ServerProcs | None:
    """The API process's generation engine child (``python -m tserve.gpu ipc://...``),
    if started; an embedding engine (``"task":"embed"`` in its config) is not it."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
            ppid = int(stat.rpartition(")")[2].split()[1])
            if ppid != api_pid:
                continue
            argv = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if any(b'"task":"embed"' in arg for arg in argv):
            continue
        for arg in argv:
            if arg.startswith(b"ipc://"):
                return ServerProcs(api_pid, int(entry.name), arg[6:].decode())
    return None


async def wait_ready(process: trio.Process, log_path: Path) -> ServerProcs:
    """Wait for the URL line, the engine child and ``/health`` 200; return the processes.

    Raises RuntimeError if the server exits first; the caller bounds the wait.
    """
    port = 0

    async def url_logged() -> bool:
        nonlocal port
        if process.returncode is not None:
            raise RuntimeError(f"the server exited with {process.returncode}; see {log_path}")
        match = _URL_LINE.search(await trio.Path(log_path).read_bytes())
        port = int(match.group(1)) if match else 0
        return bool(port)

    await _poll(url_logged)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:

        async def healthy() -> bool:
            return (await client.get("/health")).status_code == 200

        await _poll(healthy)
    procs = _find_engine(process.pid)
    if procs is None:
        raise RuntimeError(f"no engine process under the server (pid {process.pid})")
    procs.port = port
    bounds = _ADMISSION_LINE.search(await trio.Path(log_path).read_bytes())
    if bounds:
        names = ("max_pending", "max_queued", "max_queued_tokens")
        procs.admission = dict(zip(names, map(int, bounds.groups()), strict=True))
    return procs


async def stop_server(process: trio.Process, procs: ServerProcs | None) -> dict[str, Any]:
    """SIGTERM, then SIGKILL after a grace period; make sure the engine is gone too.

    Takes at most about 40 s; call it shielded from cancellation.
    """
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
    with trio.move_on_after(_TERM_GRACE):
        await process.wait()
    killed = process.returncode is None
    if killed:
        process.kill()
        await process.wait()
    engine_left = False
    if procs is not None:

        async def engine_gone() -> bool:
            return not _running(procs.engine_pid)

        with trio.move_on_after(_ENGINE_GRACE):
            await _poll(engine_gone)
        if _running(procs.engine_pid):
            engine_left = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(procs.engine_pid, signal.SIGKILL)
    return {"exit_code": process.returncode, "sigkilled": killed, "engine_left": engine_left}
