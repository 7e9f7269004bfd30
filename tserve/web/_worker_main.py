"""Inside one extra API process: ``python -m tserve.web._worker_main``.

Started by :class:`tserve.web._workers.Workers` (see there for the lifecycle
rules). It reads its :class:`WorkerSpec` as JSON on stdin, attaches to the
main process's engine(s) with a mux of its own, serves HTTP on the shared
port and prints :data:`READY` once it listens. It shuts down (draining) when
its parent is gone; its exit status is ``python -m tserve``'s.

Not imported by ``tserve.web`` itself, so that running it as ``-m`` finds it
fresh.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import msgspec
import trio

from tserve._host import configure_logging, own_process_group
from tserve.web._workers import READY, WorkerSpec

__all__ = ["main"]

log = logging.getLogger("tserve")

_PARENT_POLL = 0.2  # s between checks that the main process is still there


async def _parent_gone(parent_pid: int) -> None:
    """Return once the main process is gone (we were reparented). A checkpoint."""
    while os.getppid() == parent_pid:  # noqa: ASYNC110 (no event for a parent's death)
        await trio.sleep(_PARENT_POLL)
    log.warning("the main API process (pid %d) is gone; this worker exits", parent_pid)


async def _serve_worker(spec: WorkerSpec) -> int:
    """Attach, serve until shutdown, detach; the server's exit code. Blocks."""
    from tserve.nursery import attach_embedder, attach_llm
    from tserve.web._server import serve

    async with contextlib.AsyncExitStack() as stack:
        embedder = None
        if spec.embedding_address is not None and spec.embedding_pid is not None:
            embedder = await stack.enter_async_context(
                attach_embedder(spec.embedding_address, spec.embedding_pid, settings=spec.client)
            )
        llm = await stack.enter_async_context(
            attach_llm(
                spec.engine_address,
                spec.engine_pid,
                keys=spec.keys,
                insecure=spec.insecure,
                heartbeat_interval=spec.heartbeat_interval,
                embedder=embedder,
                settings=spec.client,
            )
        )
        codes: list[int] = []

        async def run_server(task_status: trio.TaskStatus[str]) -> None:
            trigger = lambda: _parent_gone(spec.parent_pid)  # noqa: E731
            codes.append(
                await serve(llm, spec.server, shutdown_trigger=trigger, task_status=task_status)
            )

        async with trio.open_nursery() as nursery:
            await nursery.start(run_server)
            print(READY, flush=True)
        return codes[0]
    raise AssertionError("unreachable")


def main() -> int:
    """Entry point of a worker: the spec on stdin; exit status as ``python -m tserve``'s."""
    own_process_group()  # signals reach workers through forward() only
    spec = msgspec.json.decode(sys.stdin.buffer.read(), type=WorkerSpec)
    configure_logging(spec.log_level)
    if os.getppid() != spec.parent_pid:
        return 1  # the main process is gone already
    try:
        return trio.run(_serve_worker, spec)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
