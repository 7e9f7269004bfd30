"""A process's memory as Linux counts it (``/proc/PID/status``), and finding an engine child."""

from __future__ import annotations

from pathlib import Path

__all__ = ["engine_child", "process_memory"]

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


def engine_child(pid: int) -> int:
    """The pid of the ``python -m tserve.gpu`` engine that server ``pid`` started.

    LookupError if it has none (yet)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        parent = int(stat.rpartition(")")[2].split()[1])  # the field after the state
        if parent == pid and b"tserve.gpu" in command:
            return int(entry.name)
    raise LookupError(f"process {pid} has no tserve engine child")
