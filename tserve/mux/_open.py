"""``open_mux``: a :class:`~tserve.mux._mux.Mux` run for the duration of a block."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import zmq

from tserve.mux._errors import EngineDeadError
from tserve.mux._link import Link
from tserve.mux._mux import Mux

__all__ = ["open_mux"]


@asynccontextmanager
async def open_mux(
    address: str,
    *,
    heartbeat_timeout: float = 10.0,
    ready_timeout: float = 600.0,
    hwm: int = 1000,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
    link: Link | None = None,
) -> AsyncIterator[Mux]:
    """Run a :class:`Mux` for the duration of the ``async with`` block.

    Enters once the engine is ready (raises EngineDeadError if it is not);
    on exit the mux is cancelled and what it had queued is flushed. As with
    any task group, an exception from the block arrives inside an
    ExceptionGroup.
    """
    mux = Mux(
        heartbeat_timeout=heartbeat_timeout,
        ready_timeout=ready_timeout,
        hwm=hwm,
        context=context,
        link=link,
    )
    failure: EngineDeadError | None = None
    async with anyio.create_task_group() as tg:
        try:
            await tg.start(mux.run, address)
        except EngineDeadError as exc:
            failure = exc
        if failure is None:
            try:
                yield mux
            finally:
                tg.cancel_scope.cancel()
    if failure is not None:
        raise failure
