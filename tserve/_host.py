"""This process and its neighbours on the host: the fd limit, whether a pid
lives, the priority of background threads, and the log format every tserve
process writes to stderr.

A stdlib-only leaf: the engine process, the API processes and the benchmark
client all import it.
"""

from __future__ import annotations

import logging
import os
import resource
import sys
import threading

__all__ = [
    "BACKGROUND_NICENESS",
    "configure_logging",
    "lower_thread_priority",
    "pid_alive",
    "raise_fd_limit",
]

BACKGROUND_NICENESS = 10
"""How much nicer than the rest of its process a background thread runs (grammar work)."""

log = logging.getLogger("tserve")


def lower_thread_priority() -> None:
    """Make the calling thread ``BACKGROUND_NICENESS`` nicer, for good: on Linux a
    thread has its own nice value, so a busy core gives its time to the
    process's other threads first (a grammar compile never slows a forward
    pass or the event loop by more than the scheduler's share). Nothing where
    the OS has no per-thread priority."""
    if sys.platform != "linux":
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(
            os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICENESS
        )
    except OSError as exc:  # a sandbox may forbid it: the thread keeps its priority
        log.debug("could not lower a thread's priority: %s", exc)


def raise_fd_limit() -> int:
    """Raise this process's RLIMIT_NOFILE soft limit to the hard limit; return the new soft limit.

    Never raises: a limit that cannot be raised is logged and kept.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the fd limit from %d to %d: %s", soft, target, exc)
            return soft
    return target


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (signal 0). Subject to pid reuse: prefer
    a pidfd or ``os.getppid()`` where the caller has one."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


def configure_logging(level: str, who: str = "%(process)d %(name)s") -> None:
    """Log to stderr at ``level`` with a timestamp and ``who`` (a format fragment)."""
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {who} %(levelname)s %(message)s",
        stream=sys.stderr,
    )
