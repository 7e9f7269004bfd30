"""The accept loop on a real loopback socket: it takes what is ready, within its bound.

No server: :func:`accept_connections` hands each connection to a ``start``
that records it, and the tests give places back by hand. The waits are hang
guards, not timings.
"""

from __future__ import annotations

import errno
import socket
from typing import cast

import pytest
import trio
import trio.testing

from tests.guards import HANG_GUARD
from tserve.web._accept import CONNECTION_HEADROOM, accept_connections, connection_bound


def connect(listener: socket.socket, n: int) -> list[socket.socket]:
    """``n`` clients whose handshakes the kernel completes (they wait in its accept queue)."""
    clients = []
    for _ in range(n):
        client = socket.create_connection(listener.getsockname(), timeout=HANG_GUARD)
        clients.append(client)
    return clients


async def settle() -> None:
    await trio.testing.wait_all_tasks_blocked()


def test_the_bound_leaves_room_for_every_admitted_and_queued_request() -> None:
    assert connection_bound(1024, 32768, 1 << 20) == 1024 + 32768 + CONNECTION_HEADROOM
    assert connection_bound(1024, 32768, 20000) == 20000 - 128  # fewer than the fds
    assert connection_bound(1, 0, 10) == 1


def test_every_ready_connection_is_taken_at_once(listener: socket.socket) -> None:
    clients = connect(listener, 100)
    taken: list[socket.socket] = []

    async def main() -> None:
        room = trio.Semaphore(1000)
        with trio.fail_after(HANG_GUARD):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(accept_connections, listener, room, taken.append)
                await settle()
                assert len(taken) == 100
                assert room.value == 1000 - 100  # one place per connection, none lost
                nursery.cancel_scope.cancel()

    trio.run(main)
    for sock in [*taken, *clients]:
        sock.close()


def test_at_the_bound_connections_wait_in_the_kernel(listener: socket.socket) -> None:
    clients = connect(listener, 5)
    taken: list[socket.socket] = []

    async def main() -> None:
        room = trio.Semaphore(3)
        with trio.fail_after(HANG_GUARD):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(accept_connections, listener, room, taken.append)
                await settle()
                assert len(taken) == 3
                taken[0].close()
                room.release()  # a connection ended: the next one is taken
                await settle()
                assert len(taken) == 4
                room.release()
                await settle()
                assert len(taken) == 5 and room.value == 0
                nursery.cancel_scope.cancel()

    trio.run(main)
    for sock in [*taken, *clients]:
        sock.close()


class ScriptedListener:
    """A listener whose ``accept`` raises the scripted errors, then accepts for real."""

    def __init__(self, real: socket.socket, errors: list[int]) -> None:
        self.real = real
        self.errors = errors

    def fileno(self) -> int:
        return self.real.fileno()

    def accept(self) -> tuple[socket.socket, object]:
        if self.errors:
            code = self.errors.pop(0)
            raise OSError(code, errno.errorcode[code])
        return self.real.accept()


@pytest.mark.parametrize("code", [errno.ECONNABORTED, errno.EMFILE])
def test_a_failed_accept_loses_no_place(listener: socket.socket, code: int) -> None:
    """A connection that failed before it was taken is skipped; running out of fds
    pauses the loop; either way the ready connections are taken and no place leaks."""
    clients = connect(listener, 3)
    taken: list[socket.socket] = []
    scripted = cast(socket.socket, ScriptedListener(listener, [code, code]))

    async def main() -> None:
        room = trio.Semaphore(10)
        with trio.fail_after(HANG_GUARD):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(accept_connections, scripted, room, taken.append)
                await trio.sleep(1.0)  # past every pause (the clock jumps)
                await settle()
                assert len(taken) == 3
                assert room.value == 10 - 3
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0.05))
    for sock in [*taken, *clients]:
        sock.close()
