"""Taking connections: all the kernel has ready at each wake-up, up to a bound on those held.

trio's own accept loop (``trio.serve_listeners``) takes one connection per
pass of the scheduler. While the event loop is busy, a pass takes
milliseconds, so a burst of connections waits in the kernel's accept queue
(``backlog``, 4,096); once that is full the kernel drops handshakes and,
when their retries run out, resets connections that the clients already
took for open (``python -m benchmarks.seed_http`` saw thousands). This
loop instead takes every ready connection (up to :data:`ACCEPT_BATCH`) at
each wake-up, so connections wait inside the API process, where admission
runs them, queues them or answers 503 at its bounds, never a reset.

Bound: at most :func:`connection_bound` connections are held at once, by
a semaphore whose place each connection's task gives back when it ends.
At the bound the loop stops taking connections; new ones wait in the
kernel's accept queue, and past it the kernel drops them as above.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Callable

import trio

__all__ = ["ACCEPT_BATCH", "CONNECTION_HEADROOM", "accept_connections", "connection_bound"]

log = logging.getLogger("tserve.web")

# Connections taken in one wake-up at most: what the kernel's accept queue
# holds (ServerConfig.backlog). A wake-up can be seconds apart while thousands
# of requests are being read, so it takes the whole queue; then the loop
# yields, so a flood of new connections cannot keep the event loop from the
# ones it holds.
ACCEPT_BATCH = 4096
# Connections held beyond the admission bounds (--max-pending + --max-queued):
# probes, /metrics, idle keep-alive connections, embeddings, requests not yet
# parsed.
CONNECTION_HEADROOM = 1024
# fds left for all that is not a connection: the engine sockets, logs, the
# metrics files, pipes and event fds.
_FD_RESERVE = 128
# accept() errors that mean "no fds or memory now", not a broken socket.
_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
_PAUSE = 0.1  # seconds before the next accept after one of those
# accept() errors of one connection that failed while it waited (Linux passes
# pending network errors on, see accept(2)); the next one may be fine.
_SKIPPED_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "ECONNABORTED",
        "EPROTO",
        "EPERM",
        "ENETDOWN",
        "ENOPROTOOPT",
        "EHOSTDOWN",
        "ENONET",
        "EHOSTUNREACH",
        "EOPNOTSUPP",
        "ENETUNREACH",
    )
    if hasattr(errno, name)
)


def connection_bound(max_pending: int, max_queued: int, fd_limit: int) -> int:
    """Connections one API process holds at most: room for every admitted and
    queued request plus :data:`CONNECTION_HEADROOM`, and fewer than its fds."""
    return max(1, min(max_pending + max_queued + CONNECTION_HEADROOM, fd_limit - _FD_RESERVE))


async def accept_connections(
    listener: socket.socket, room: trio.Semaphore, start: Callable[[socket.socket], None]
) -> None:
    """Take connections from ``listener`` while ``room`` has a place; never returns.

    ``listener`` is a listening, non-blocking socket. Each connection taken
    holds one place in ``room`` and is handed to ``start``, which must not
    block and must see that the place is released when the connection ends.
    A checkpoint at each wake-up; cancelling it stops taking connections
    (the caller closes ``listener``).
    """
    while True:
        await trio.lowlevel.wait_readable(listener)  # 1 a connection may be ready
        await room.acquire()  # 2 a place for it
        holding = True
        try:
            for _ in range(ACCEPT_BATCH):  # 3 take what is ready, a place each
                try:
                    conn, _ = listener.accept()
                except BlockingIOError:
                    break
                except OSError as exc:
                    if exc.errno in _SKIPPED_ERRNOS:
                        continue  # it failed before it was taken; the place stays ours
                    if exc.errno not in _CAPACITY_ERRNOS:
                        raise
                    log.error("cannot accept a connection: %s; retrying in %g s", exc, _PAUSE)
                    await trio.sleep(_PAUSE)
                    break
                start(conn)  # the place is the connection's now
                holding = _try_acquire(room)
                if not holding:
                    break
        finally:
            if holding:
                room.release()


def _try_acquire(room: trio.Semaphore) -> bool:
    try:
        room.acquire_nowait()
    except trio.WouldBlock:
        return False
    return True
