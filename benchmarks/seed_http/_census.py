"""What the server holds: its fds, its ZMQ sockets to the engine, its CPU time.

Everything is read from ``/proc`` and from ``ss`` (iproute2); nothing here
talks to the server. Two kinds of look:

* cheap, for every sample: :func:`fd_count` (``/proc/PID/fd``),
  :func:`rss_bytes` (``/proc/PID/statm``) and :func:`engine_ipc_connections`,
  the engine's accepted connections on its ``ipc://`` path
  (``/proc/PID/net/unix``);
* a full :func:`take_census`, about once a second: every API-process fd by
  kind, and the API-side ZMQ sockets counted exactly, as the API process's
  unix sockets whose peer is one of the engine's sockets on the ipc path
  (peer inodes from ``ss -x``), plus both processes' CPU seconds and the
  kernel's accept queue on the HTTP port.

:func:`tcp_counters` reads the kernel's listen-queue counters (the whole
network namespace), for a before/after difference.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import trio

from benchmarks.seed_http._server import ServerProcs

__all__ = [
    "FdCensus",
    "engine_ipc_connections",
    "fd_count",
    "rss_bytes",
    "take_census",
    "tcp_counters",
]

_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")
_TCP_COUNTERS = (
    "ListenOverflows",
    "ListenDrops",
    "TCPReqQFullDrop",
    "SyncookiesSent",
    "SyncookiesFailed",
    "TCPAbortOnData",
)


@dataclass
class FdCensus:
    """One full look at the API process's fds."""

    t: float
    total: int
    tcp_or_other_sockets: int
    unix_sockets: int
    zmq_to_engine: int | None  # API-side unix sockets whose peer is on the ipc path
    engine_ipc_connections: int
    other: dict[str, int]
    api_cpu_s: float  # user + system CPU seconds the API process has used so far
    accept_queue: int | None  # connections the kernel holds that the server has not accepted
    engine_cpu_s: float


def fd_count(pid: int) -> int:
    """How many fds ``pid`` has open, or -1 when it is gone."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` in bytes, or -1 when it is gone."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return -1


def engine_ipc_connections(procs: ServerProcs) -> int:
    """The engine's accepted (connected, state 03) sockets on its ipc path."""
    count = 0
    with contextlib.suppress(OSError), open(f"/proc/{procs.engine_pid}/net/unix") as table:
        for line in table:
            parts = line.split()
            if len(parts) >= 8 and parts[7] == procs.ipc_path and parts[5] == "03":
                count += 1
    return count


def tcp_counters() -> dict[str, int]:
    """The kernel's listen-queue counters (``/proc/net/netstat``; the whole namespace)."""
    try:
        lines = [line.split() for line in Path("/proc/net/netstat").read_text().splitlines()]
    except OSError:
        return {}
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names and names[0] == "TcpExt:":
            table = dict(zip(names[1:], values[1:], strict=True))
            return {name: int(table[name]) for name in _TCP_COUNTERS if name in table}
    return {}


async def take_census(procs: ServerProcs) -> FdCensus:
    """One full look at the server (two ``ss`` runs: tens of milliseconds)."""
    kinds, sockets = _fd_inodes(procs.api_pid)
    unix = sockets & _unix_inodes(procs.api_pid)
    peers = await _engine_peer_inodes(procs)
    return FdCensus(
        t=time.monotonic(),
        total=len(sockets) + sum(kinds.values()),
        tcp_or_other_sockets=len(sockets - unix),
        unix_sockets=len(unix),
        zmq_to_engine=None if peers is None else len(unix & peers),
        engine_ipc_connections=engine_ipc_connections(procs),
        other=dict(kinds),
        api_cpu_s=_cpu_seconds(procs.api_pid),
        engine_cpu_s=_cpu_seconds(procs.engine_pid),
        accept_queue=await _accept_queue(procs.port),
    )


def _fd_inodes(pid: int) -> tuple[Counter[str], set[int]]:
    """Counts of ``pid``'s fds by kind, and the inodes of its sockets."""
    kinds: Counter[str] = Counter()
    sockets: set[int] = set()
    with contextlib.suppress(OSError):
        for name in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{name}")
            except OSError:
                continue  # closed since listdir
            if target.startswith("socket:["):
                sockets.add(int(target[8:-1]))
            elif target.startswith("anon_inode:"):
                kinds[target[11:].strip("[]")] += 1
            elif target.startswith("pipe:"):
                kinds["pipe"] += 1
            else:
                kinds["file"] += 1
    return kinds, sockets


def _unix_inodes(pid: int) -> set[int]:
    """Inodes of every unix socket in ``pid``'s network namespace."""
    inodes: set[int] = set()
    with contextlib.suppress(OSError), open(f"/proc/{pid}/net/unix") as table:
        next(table)
        for line in table:
            inodes.add(int(line.split()[6]))
    return inodes


async def _ss(*args: str) -> list[list[str]] | None:
    """The rows of ``ss ARGS`` split into fields, or None without ``ss``."""
    try:
        done = await trio.run_process(["ss", *args], capture_stdout=True, check=False)
    except OSError:
        return None
    return [line.split() for line in done.stdout.decode().splitlines()]


async def _engine_peer_inodes(procs: ServerProcs) -> set[int] | None:
    """Peer inodes of the established sockets on the engine's ipc path, or None."""
    rows = await _ss("-xHn", "src", procs.ipc_path)
    if rows is None:
        return None
    return {int(row[7]) for row in rows if len(row) >= 8 and row[1] == "ESTAB"}


async def _accept_queue(port: int) -> int | None:
    """Connections waiting in the kernel for the server to accept them (``ss -l``)."""
    rows = await _ss("-Hltn", "sport", "=", f":{port}")
    if rows is None:
        return None
    return sum(int(row[1]) for row in rows if len(row) > 1 and row[0] == "LISTEN")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used (``/proc/PID/stat``), or NaN."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / _TICKS
