"""This process and its neighbours on the host: the fd limit, whether a pid
lives, and the log format every tserve process writes to stderr.

A stdlib-only leaf: the engine process, the API processes and the benchmark
client all import it.
"""

from __future__ import annotations

import logging
import os
import resource
import sys

__all__ = ["configure_logging", "pid_alive", "raise_fd_limit"]

log = logging.getLogger("tserve")


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
