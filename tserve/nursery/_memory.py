"""Memory as the host reports it: a process's resident bytes, the machine's total,
the weight bytes of a model on disk. Linux ``/proc``; each call reads a small
file or stats a directory, synchronously (microseconds)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Final

__all__ = [
    "DEFAULT_BUDGET_FRACTION",
    "default_memory_budget",
    "machine_memory",
    "parse_byte_size",
    "resident_bytes",
    "weight_bytes",
]

DEFAULT_BUDGET_FRACTION: Final = 0.75
"""The share of the machine's memory (MemTotal) that models may hold by default."""

_PAGE: Final = os.sysconf("SC_PAGE_SIZE")

_SIZE: Final = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)(b?)", re.IGNORECASE)
_POWERS: Final = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_byte_size(text: str) -> int:
    """A byte count as people write it: ``8589934592``, ``8G``, ``512M``,
    ``1.5GiB``, ``2GB``. A bare letter (K, M, G, T) or one with ``i``/``iB``
    counts in powers of 1024, as memory is; with ``B`` alone (KB, MB, GB,
    TB) in powers of 1000. Case-insensitive. ValueError naming the forms for
    anything else, or for a size under one byte."""
    match = _SIZE.fullmatch(text.strip())
    if match is None or (match[3] and not match[2]):  # "iB" needs K, M, G or T
        raise ValueError(
            f"expected a size in bytes such as 8G, 512M, 1.5GiB or 2000000000; got {text!r}"
        )
    number, letter, binary, b = match.groups()
    decimal = bool(letter) and bool(b) and not binary
    size = int(float(number) * (1000 if decimal else 1024) ** _POWERS[letter.lower()])
    if size < 1:
        raise ValueError(f"a size must be at least one byte; got {text!r}")
    return size


def resident_bytes(pid: int) -> int:
    """Process ``pid``'s resident set (RSS: its pages in memory, shared ones
    included), from ``/proc/<pid>/statm``; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0


def machine_memory() -> int:
    """The machine's memory in bytes (MemTotal of ``/proc/meminfo``)."""
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemTotal line")


def default_memory_budget() -> int:
    """``DEFAULT_BUDGET_FRACTION`` of :func:`machine_memory`."""
    return int(machine_memory() * DEFAULT_BUDGET_FRACTION)


def weight_bytes(model: str) -> int:
    """What a model weighs on disk: a file's size, the sum of the files directly
    in a directory; 0 for a name that is no path (such as "default")."""
    path = Path(model)
    try:
        if path.is_dir():
            return sum(p.stat().st_size for p in path.iterdir() if p.is_file())
        return path.stat().st_size
    except OSError:
        return 0
