"""A small async adapter over one non-blocking pyzmq socket, for trio and asyncio.

pyzmq has no trio support, so this module carries the few rules that make a
zmq socket safe to drive from an event loop:

1. ``zmq.FD`` is *edge*-triggered: it signals that the socket's state may have
   changed, and it is reset by any zmq call that processes the socket's
   internal commands -- a ``send`` included. So after EVERY send and receive,
   ``zmq.EVENTS`` is read again (:meth:`ZmqChannel._update`); otherwise a send
   can swallow the edge a receiver is waiting for and both sides hang.
2. Only one task may wait on an fd (trio raises ``BusyResourceError`` for a
   second), so exactly one watcher task (:meth:`ZmqChannel.watch`) waits on
   ``zmq.FD``; senders and receivers wait on events that it, or the other side's
   ``_update``, sets.
3. While ``POLLIN`` is reported, frames are drained with ``NOBLOCK`` until
   ``zmq.Again`` (no new edge comes for messages that arrive while POLLIN is
   already set).
4. Frames move from the socket into a local deque in synchronous code, which
   cannot be cancelled; a cancelled receive only ever cancels a *wait*, so a
   received frame is never lost and never handed out twice.

Everything here uses anyio primitives, so the one implementation serves trio
and anyio's asyncio backend.
"""

from __future__ import annotations

from collections import deque
from typing import NoReturn, cast

import anyio
import zmq
from anyio.lowlevel import cancel_shielded_checkpoint, checkpoint_if_cancelled

from tserve.mux._errors import MuxError

__all__ = ["ZmqChannel"]

_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_EVENTS = int(zmq.EVENTS)
_NOBLOCK = int(zmq.NOBLOCK)


class ZmqChannel:
    """Single-frame send and receive on one zmq socket, from async code.

    The channel does not own the socket's lifetime: the caller creates it,
    runs :meth:`watch` in a task for as long as the channel is used, cancels
    that task, and only then closes the socket.

    At most one task may be inside :meth:`receive`/:meth:`receive_batch` and at
    most one inside :meth:`send` at a time (the mux has one of each).
    """

    __slots__ = ("_fd", "_max_buffered", "_readable", "_received", "_socket", "_writable")

    def __init__(self, socket: zmq.Socket[bytes], *, max_buffered: int = 256) -> None:
        if max_buffered < 1:
            raise ValueError("max_buffered must be at least 1")
        self._socket = socket
        self._fd = cast(int, socket.getsockopt(zmq.FD))
        self._max_buffered = max_buffered
        # Frames taken off the socket and not yet handed to a receiver.
        # Bound: max_buffered frames. At the bound the channel stops reading the
        # socket; later frames wait in the socket's receive queue (RCVHWM) and
        # then in the peer's send queue, where the peer waits or coalesces.
        # Nothing is dropped. The receiver's next call drains the socket again.
        self._received: deque[bytes] = deque()
        # Set (and cleared to None) when a waiting receiver/sender may proceed.
        self._readable: anyio.Event | None = None
        self._writable: anyio.Event | None = None

    async def watch(self) -> NoReturn:
        """Wait on ``zmq.FD`` forever, waking receivers and senders.

        Run it in its own task; it never returns, cancel it to stop. Raises
        MuxError if the socket fails.
        """
        while True:
            self._update()
            await anyio.wait_readable(self._fd)

    async def receive(self) -> bytes:
        """Return the next frame, waiting until one arrives.

        Always a checkpoint. Cancellation: if cancelled, no frame was taken;
        it stays queued for the next call.
        """
        await self._wait_received()
        frame = self._received.popleft()
        self._update()
        return frame

    async def receive_batch(self) -> deque[bytes]:
        """Return every frame received so far (at least one), oldest first.

        Waits until one arrives. Always a checkpoint. Cancellation: if
        cancelled, no frame was taken.
        """
        await self._wait_received()
        frames = self._received
        self._received = deque()
        self._update()
        return frames

    async def send(self, frame: bytes | bytearray | memoryview) -> None:
        """Queue one frame on the socket.

        Waits while the socket is at its send high-water mark (never drops).
        Always a checkpoint. Cancellation: if cancelled, the frame was not sent.
        """
        await checkpoint_if_cancelled()
        socket = self._socket
        while True:
            try:
                socket.send(frame, _NOBLOCK)
            except zmq.Again:
                # Arm the event before re-reading EVENTS, so a POLLOUT seen
                # now or signalled later through the FD both wake us.
                writable = self._writable = anyio.Event()
                self._update()
                await writable.wait()
                continue
            except zmq.ZMQError as exc:
                raise MuxError(f"zmq send failed: {exc}") from exc
            break
        self._update()
        await cancel_shielded_checkpoint()

    def poll(self) -> bool:
        """Drain what the socket holds into the buffer; True if a frame waits unread.

        Synchronous, never blocks (rule 1 holds: it re-reads ``zmq.EVENTS``
        and wakes a waiting receiver). For a watcher that must tell frames
        the event loop has not read yet from frames that never came.
        """
        self._update()
        return bool(self._received)

    async def _wait_received(self) -> None:
        """Return when a frame is buffered; a checkpoint that takes nothing."""
        await checkpoint_if_cancelled()
        if self._received:
            await cancel_shielded_checkpoint()
            return
        while not self._received:
            readable = self._readable = anyio.Event()
            await readable.wait()

    def _update(self) -> None:
        """Re-read ``zmq.EVENTS``, drain readable frames, wake whoever can proceed.

        Synchronous, so it cannot be cancelled half-way: a frame is either
        still in the socket or already in ``_received``.
        """
        socket = self._socket
        received = self._received
        limit = self._max_buffered
        try:
            while True:
                events = cast(int, socket.getsockopt(_EVENTS))
                if not events & _POLLIN or len(received) >= limit:
                    break
                while len(received) < limit:
                    try:
                        received.append(socket.recv(_NOBLOCK))
                    except zmq.Again:
                        break
        except zmq.ZMQError as exc:
            raise MuxError(f"zmq receive failed: {exc}") from exc
        if received and self._readable is not None:
            self._readable.set()
            self._readable = None
        if events & _POLLOUT and self._writable is not None:
            self._writable.set()
            self._writable = None
