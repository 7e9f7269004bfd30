"""Processes as ``/proc`` shows them, read so that one ending mid-read is not an error.

A thread or child can exit between listing ``/proc/PID/task`` and opening one
of its files; every reader here treats a vanished entry as absent.
"""

from __future__ import annotations

import os


def process_gone(pid: int) -> bool:
    """No such process, or only its zombie is left (it has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def child_pids(pid: int | str = "self") -> set[int]:
    """The children of ``pid`` (this process by default) that have not exited."""
    found: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.update(int(child) for child in f.read().split())
        except FileNotFoundError:
            continue  # the thread ended after the listing
    return {child for child in found if not process_gone(child)}


def command_line(pid: int) -> bytes | None:
    """``pid``'s NUL-separated command line, or None once it has gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None
