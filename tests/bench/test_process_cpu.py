"""The side-by-side benchmarks' CPU-time reader: a server's whole process tree."""

from __future__ import annotations

import os
import subprocess
import sys

from benchmarks._memory import tree_cpu_seconds

_BURN = """
import sys, time
end = time.process_time() + 0.3
while time.process_time() < end:
    pass
print("burnt", flush=True)
sys.stdin.read()
"""


def test_a_tree_counts_its_children_running_and_exited() -> None:
    """A child that used 0.3 CPU seconds counts while it runs (through the
    children list) and after it was waited for (through the parent's totals)."""
    tick = 1 / os.sysconf("SC_CLK_TCK")
    before = tree_cpu_seconds(os.getpid())
    child = subprocess.Popen(
        [sys.executable, "-c", _BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdin is not None
    assert child.stdout.readline() == "burnt\n"
    running = tree_cpu_seconds(os.getpid())
    assert running - before >= 0.3 - 2 * tick
    child.stdin.close()
    assert child.wait(timeout=60) == 0
    assert tree_cpu_seconds(os.getpid()) >= running - 2 * tick
    assert tree_cpu_seconds(child.pid) == 0.0  # gone: nothing to read
