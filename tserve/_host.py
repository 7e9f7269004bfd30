"""This process and its neighbours on the host: the fd limit, whether a pid
lives, the priority of background threads, the process group of a child
process, the C heap's freed pages, and the log format every tserve process
writes to stderr.

A stdlib-only leaf: the engine process, the API processes and the benchmark
client all import it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import signal
import sys
import threading
from typing import Any

__all__ = [
    "BACKGROUND_NICENESS",
    "configure_logging",
    "libc_function",
    "lower_thread_priority",
    "own_process_group",
    "pid_alive",
    "raise_fd_limit",
    "trim_heap",
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


def own_process_group() -> None:
    """Move this process, a child its parent stops itself (an engine, an API
    worker), into a process group of its own within its parent's session.

    The terminal's Ctrl-C and Ctrl-Z go to the foreground group, the parent's,
    and never to the child. A session of its own (``setsid``) would do that
    too, but under autogroup scheduling, which most desktop Linux kernels
    enable, the CPU is shared between sessions first and by nice value only
    within one: a grammar check thread the API process runs niced then took
    as much of a busy CPU as the engine's step loop in another session.
    A background group's write to the terminal stops it under ``stty tostop``
    (SIGTTOU), so the child ignores that signal. Call it first thing: until
    then the child is in its parent's group. A process that leads its group
    already (a session leader always does) stays as it is. Nothing where the
    OS has no process groups."""
    if not hasattr(os, "setpgid"):
        return
    if os.getpgid(0) != os.getpid():
        os.setpgid(0, 0)
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)


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


def libc_function(name: str) -> Any:
    """glibc's function ``name`` (ctypes), or None where the C library is another."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):  # not glibc: its own policy stands
        return None


def trim_heap() -> None:
    """Give every arena's free pages back to the kernel (``malloc_trim(0)``):
    what a load freed (a parsed file, a tokenizer's parse) stops being resident.

    Blocks for a few milliseconds; safe from any thread. Call it after a
    load, not per step (a step would fault the pages back in).
    """
    malloc_trim = libc_function("malloc_trim")
    if malloc_trim is not None:
        malloc_trim(0)
