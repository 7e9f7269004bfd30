"""The HTTP connections: hypercorn's protocol over our own accept loop, every write bounded.

hypercorn writes a response's bytes with ``send_all`` inside a shielded cancel
scope, so a client that stops reading (its receive window shut) would hold
its connection, its request task and everything that task holds for as long
as it keeps the socket open, and no cancel, not even the shutdown's, could
end it. So each accepted socket is wrapped in a :class:`GuardedStream`
before hypercorn sees it, and its writes answer to one :class:`StallGuard`:

* a write that moves no byte into the kernel for ``stall_timeout`` seconds
  closes the socket. hypercorn's reader sees it closed, the app sees the
  client gone (quart-trio cancels the request task: its streams are
  aborted, its admission slots released) and the writer gets
  ``BrokenResourceError`` as for any peer that went away;
* :meth:`StallGuard.hurry` (the shutdown drain, once it has aborted what was
  left) shortens every pending and later write to a few seconds at most.

Closing never waits first (:meth:`GuardedStream.send_eof`): hypercorn closes
from a task that may be cancelled already, and a connection the client asked
to close (``Connection: close``) must not stay open.

:func:`serve_http` runs hypercorn's per-connection ``TCPServer`` and the
app's lifespan the way hypercorn's trio worker does, on plain TCP only (no
TLS, no QUIC: tserve never configures them), over the accept loop of
:mod:`tserve.web._accept` (every ready connection at each wake-up, up to a
bound on those held) instead of ``trio.serve_listeners``.
"""

from __future__ import annotations

import logging
import math
import socket
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.statsd import StatsdLogger
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState, Framework, LifespanState
from hypercorn.utils import repr_socket_addr, wrap_app

from tserve.web._accept import accept_connections

__all__ = ["GuardedStream", "StallGuard", "serve_http"]

log = logging.getLogger("tserve.web")


class StallGuard:
    """The write deadlines of every connection of one server.

    Invariant: each write in progress has its cancel scope in ``_writes``,
    with a deadline no later than its start + ``timeout`` and no later than
    the hurry deadline.
    """

    def __init__(self, timeout: float, on_stall: Callable[[], object] = lambda: None) -> None:
        self.timeout = timeout
        self.on_stall = on_stall  # called once per connection closed for a stall
        self._hurry_at = math.inf
        self._writes: set[trio.CancelScope] = set()

    def hurry(self, grace: float) -> None:
        """Let every write in progress, and every later one, take ``grace`` s at
        most from now. Synchronous; only ever shortens."""
        self._hurry_at = min(self._hurry_at, trio.current_time() + grace)
        for scope in self._writes:
            scope.deadline = min(scope.deadline, self._hurry_at)

    async def write(self, socket: trio.socket.SocketType, data: memoryview) -> int | None:
        """``socket.send(data)``: the bytes sent, or None when it sent none in time.

        A checkpoint; waits until the socket can take a byte, ``timeout``
        seconds at most (less after :meth:`hurry`). Only the deadline ends
        the wait: hypercorn shields its writes from cancellation.
        """
        deadline = min(trio.current_time() + self.timeout, self._hurry_at)
        with trio.CancelScope(deadline=deadline) as scope:
            self._writes.add(scope)
            try:
                return await socket.send(data)
            finally:
                self._writes.discard(scope)
        return None


class GuardedStream(trio.abc.HalfCloseableStream):
    """A TCP connection whose writes answer to a :class:`StallGuard`.

    hypercorn takes it for a plain ``trio.SocketStream``: it has ``socket``
    and no ``do_handshake`` (so it is not TLS). One writer at a time
    (hypercorn holds a lock around its writes).
    """

    def __init__(self, inner: trio.SocketStream, guard: StallGuard) -> None:
        self._inner = inner
        self._guard = guard
        self.socket = inner.socket

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Write all of ``data``; a write that stalls closes the connection and
        raises BrokenResourceError. A checkpoint."""
        with memoryview(data) as view:
            if not view:
                await trio.lowlevel.checkpoint()
            sent = 0
            while sent < len(view):
                try:
                    moved = await self._guard.write(self.socket, view[sent:])
                except OSError as exc:
                    raise trio.BrokenResourceError(str(exc)) from exc
                if moved is None:
                    await self._close_stalled()
                    raise trio.BrokenResourceError("the client stopped reading")
                sent += moved

    async def _close_stalled(self) -> None:
        self._guard.on_stall()
        try:
            peer = self.socket.getpeername()
        except OSError:
            peer = "?"
        log.warning(
            "closing the connection of %s: it accepted no bytes for %.1f s",
            peer,
            self._guard.timeout,
        )
        await self.aclose()  # its reader wakes up with ClosedResourceError

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        """Shut the write side now, then a checkpoint.

        hypercorn closes a connection (``Connection: close``, errors) from
        the request's task, which quart-trio may have cancelled already: a
        checkpoint before the shutdown would skip it and leave the
        connection open, so the socket call comes first.
        """
        try:
            self.socket.shutdown(trio.socket.SHUT_WR)
        except OSError as exc:
            raise trio.BrokenResourceError(str(exc)) from exc
        finally:
            await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self._inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        """Close the socket now, then a checkpoint (as :meth:`send_eof`, and why)."""
        self.socket.close()
        await trio.lowlevel.checkpoint()


async def serve_http(
    app: Framework,
    config: HypercornConfig,
    guard: StallGuard,
    *,
    max_connections: int,
    shutdown_trigger: Callable[[], Awaitable[object]],
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``config.bind`` until ``shutdown_trigger`` returns.

    Blocks. ``task_status.started`` gets the bound URLs once the sockets
    listen. At most ``max_connections`` connections are held at once
    (:mod:`tserve.web._accept`). After the trigger: no new connections (the
    listening sockets close); idle keep-alive ones are closed; the others get
    ``config.graceful_timeout`` seconds, then are cancelled (a write still
    bounded by ``guard``); then the lifespan's shutdown runs. A cancel from
    outside ends it all at once.
    """
    config.set_statsd_logger_class(StatsdLogger)
    asgi = wrap_app(app, config.wsgi_max_body_size, "asgi")
    state: LifespanState = {}
    lifespan = Lifespan(asgi, config, state)
    context = WorkerContext(None)
    room = trio.Semaphore(max_connections)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as connections:
            listeners, binds = _listen(config)
            task_status.started(binds)
            handler: Callable[[GuardedStream], Any] = partial(
                TCPServer, asgi, config, context, ConnectionState(state.copy())
            )

            def start(conn: socket.socket) -> None:
                connections.start_soon(_run_connection, conn, guard, room, handler)

            async with trio.open_nursery() as accepting:
                for listener in listeners:
                    accepting.start_soon(_accept_until_cancelled, listener, room, start)
                await shutdown_trigger()
                accepting.cancel_scope.cancel()
            await context.terminated.set()  # idle keep-alive connections close
            connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


async def _accept_until_cancelled(
    listener: socket.socket, room: trio.Semaphore, start: Callable[[socket.socket], None]
) -> None:
    """:func:`accept_connections`, closing ``listener`` however it ends."""
    with listener:
        await accept_connections(listener, room, start)


async def _run_connection(
    conn: socket.socket,
    guard: StallGuard,
    room: trio.Semaphore,
    handler: Callable[[GuardedStream], Any],
) -> None:
    """One connection's task: hypercorn's protocol over it; then close it and free its place."""
    try:
        stream = GuardedStream(trio.SocketStream(trio.socket.from_stdlib_socket(conn)), guard)
    except BaseException:
        conn.close()
        room.release()
        raise
    try:
        await handler(stream)
    finally:
        try:
            await trio.aclose_forcefully(stream)
        finally:
            room.release()


def _listen(config: HypercornConfig) -> tuple[list[socket.socket], list[str]]:
    """hypercorn's sockets for ``config.bind``, listening and non-blocking; their URLs."""
    sockets = config.create_sockets()
    listeners, binds = [], []
    for sock in sockets.insecure_sockets:
        sock.listen(config.backlog)
        sock.setblocking(False)
        listeners.append(sock)
        binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
    return listeners, binds
