"""Inside the metrics process of ``--metrics-port``: ``python -m tserve.web._metrics_main``.

Started by :class:`tserve.web._workers.Workers` (see there for the lifecycle
rules). It reads its :class:`MetricsSpec` as JSON on stdin, listens, prints
``tserve: metrics at URL`` and then :data:`READY`, and serves ``GET
/metrics`` (:mod:`tserve.web._metrics_http`) with the whole server's
Prometheus text, from the shared metrics directory alone: the engine's
numbers and the live counts from the stats files the API processes write
(:mod:`tserve.web._stats_files`), the request counters and histograms from
their multiprocess files. It never asks an API process anything, so a scrape
waits on no API process's event loop.

It exits 0 on SIGTERM/SIGINT or when the main process is gone, 1 when it
cannot listen.

Not imported by ``tserve.web`` itself, so that running it as ``-m`` finds it
fresh.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from pathlib import Path

import msgspec
import trio
from prometheus_client.exposition import generate_latest

from tserve._host import configure_logging, own_process_group
from tserve.web._browser import BrowserGuard
from tserve.web._metrics import SHARED_DIR_ENV, engine_registry, request_registry
from tserve.web._metrics_http import Rendering, serve_metrics
from tserve.web._server import bound_socket
from tserve.web._stats_files import read_stats
from tserve.web._workers import READY, MetricsSpec

__all__ = ["main"]

log = logging.getLogger("tserve.metrics")

_BACKLOG = 128  # the listener's accept queue (MAX_CONNECTIONS are taken from it)
_PARENT_POLL = 0.2  # s between checks that the main process is still there


def _listen(host: str, port: int) -> socket.socket:
    """A listening, non-blocking socket on ``host:port``; raises OSError."""
    sock = bound_socket(host, port)
    try:
        sock.listen(_BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _rendering(spec: MetricsSpec, shared_dir: str) -> Rendering:
    """The server's text: the stats files read at each scrape, the request metrics cached."""
    directory = Path(shared_dir)
    live = engine_registry(
        lambda: read_stats(directory),
        spec.model_name,
        block_size=spec.block_size,
        num_gpu_blocks=spec.num_gpu_blocks,
    )
    shared = request_registry(shared_dir)
    return Rendering(lambda: generate_latest(live), lambda: generate_latest(shared))


async def _until_stopped(parent_pid: int) -> None:
    """Return on SIGTERM/SIGINT or once the main process is gone. A checkpoint."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        while os.getppid() == parent_pid:
            with trio.move_on_after(_PARENT_POLL):
                async for signum in signals:
                    log.info("%s: exiting", signal.Signals(signum).name)
                    return
    log.warning("the main API process (pid %d) is gone; exiting", parent_pid)


async def _serve(spec: MetricsSpec, shared_dir: str, listener: socket.socket) -> None:
    rendering = _rendering(spec, shared_dir)
    guard = BrowserGuard.for_bind(spec.host, spec.allowed_hosts)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_metrics, listener, rendering, guard)
        print(f"tserve: metrics at {_url(listener)}/metrics", flush=True)
        print(READY, flush=True)
        await _until_stopped(spec.parent_pid)
        nursery.cancel_scope.cancel()


def main() -> int:
    """Entry point: the spec on stdin; the exit status of the module docstring."""
    own_process_group()  # signals reach it through forward() only
    spec = msgspec.json.decode(sys.stdin.buffer.read(), type=MetricsSpec)
    configure_logging(spec.log_level)
    shared_dir = os.environ.get(SHARED_DIR_ENV)
    if os.getppid() != spec.parent_pid or not shared_dir:
        log.error("no main process or no %s: nothing to serve", SHARED_DIR_ENV)
        return 1
    try:
        listener = _listen(spec.host, spec.port)
    except OSError as exc:
        log.error("cannot serve metrics on %s port %d: %s", spec.host, spec.port, exc)
        return 1
    with listener:
        trio.run(_serve, spec, shared_dir, listener)
    return 0


if __name__ == "__main__":
    sys.exit(main())
