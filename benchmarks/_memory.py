"""A process's memory and CPU time as Linux counts them (``/proc/PID/status``,
``/proc/PID/stat``), and finding its children."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["children", "engine_child", "process_memory", "tree_cpu_seconds"]

_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def process_memory(pid: int) -> dict[str, float]:
    """MiB of ``pid``'s resident set now (``VmRSS``: ``RssAnon`` + ``RssFile``
    + ``RssShmem``; file pages are those of its mapped files, a memory-mapped
    model's weights among them) and at its peak (``VmHWM``)."""
    found: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in _FIELDS:
            found[key] = int(value.split()[0]) / 1024  # kB
    return found


def children(pid: int) -> dict[int, list[bytes]]:
    """``pid``'s child processes now: pid -> command line (its arguments).

    One pass over ``/proc``; a process that exits meanwhile is left out."""
    found: dict[int, list[bytes]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        parent = int(stat.rpartition(")")[2].split()[1])  # the field after the state
        if parent == pid:
            found[int(entry.name)] = command
    return found


def engine_child(pid: int) -> int:
    """The pid of the ``python -m tserve.gpu`` engine that server ``pid`` started.

    LookupError if it has none (yet)."""
    for child, command in children(pid).items():
        if b"tserve.gpu" in command:
            return child
    raise LookupError(f"process {pid} has no tserve engine child")


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) that ``pid`` and its descendants have used
    so far, children that exited and were waited for included. A process that
    exits meanwhile is left out."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    own = sum(int(v) for v in fields[11:15]) / tick  # utime, stime, cutime, cstime
    return own + sum(tree_cpu_seconds(child) for child in children(pid))
