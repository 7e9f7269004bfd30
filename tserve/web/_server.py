"""Serving the app over hypercorn's HTTP protocol inside our own nursery.

``await nursery.start(serve, llm, config)`` returns the base URL once the
socket listens (``serve(models, config)`` with a ``ModelLookup`` of several
models). ``serve`` itself returns an exit code:

* 0 after a graceful shutdown (SIGTERM/SIGINT, or ``shutdown_trigger``):
  1. draining: new requests get 503, ``/ready`` says 503;
     hypercorn stops accepting connections;
  2. in-flight requests get up to ``shutdown_timeout`` seconds to finish;
  3. then the rest are ended: streams with a final SSE error event,
     non-streaming requests with a 503 error JSON (never a silent cut);
     a client that does not take those bytes within ``_FLUSH_STALL`` seconds
     has its connection closed (:meth:`StallGuard.hurry`);
  4. once those final events are written, the connections are closed (idle
     keep-alive ones too) and ``serve`` returns.
  A second signal skips step 2.
* 1 when the one model's engine (generation or embedding) died: live
  requests have already failed with it (the mux fails every mailbox at
  once), ``/health`` is 503; after ``engine_death_grace`` seconds the server
  shuts down as above. With several models an engine's death fails only its
  own model's requests, and the server serves on.

At any time, a connection whose client accepts no bytes of a response for
``stall_timeout`` seconds is closed, which ends its request
(:mod:`tserve.web._connections`). With ``publish_stats``, the server writes
its live numbers to the shared metrics directory for the metrics process of
``--metrics-port`` (:mod:`tserve.web._stats_files`) until it returns.

Stopping the engines is the caller's part: leaving ``open_llm`` or the registry.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio
from hypercorn.config import Config as HypercornConfig

from tserve._host import raise_fd_limit
from tserve.nursery import LLM, ShuttingDown
from tserve.web._accept import connection_bound
from tserve.web._app import AppConfig, Frontend, create_app
from tserve.web._browser import is_loopback
from tserve.web._connections import StallGuard, serve_http
from tserve.web._metrics import SHARED_DIR_ENV
from tserve.web._model_lookup import ModelLookup, OneModel
from tserve.web._stats_files import publish_stats

__all__ = ["ServerConfig", "bound_socket", "serve"]

log = logging.getLogger("tserve.web")

EXIT_OK = 0
EXIT_ENGINE_DEAD = 1
_FLUSH_GRACE = 5.0  # seconds for aborted responses to be written out
_FLUSH_STALL = 1.0  # seconds a write may wait for its client once the drain aborts


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    shutdown_timeout: float = 30.0
    stall_timeout: float = 30.0  # seconds a response's write may wait for its client
    engine_death_grace: float = 1.0
    backlog: int = 4096  # the kernel's accept queue (capped by net.core.somaxconn)
    # Connections held at once; None: the LLM's max_pending + max_queued +
    # CONNECTION_HEADROOM, within the fd limit (tserve.web._accept).
    max_connections: int | None = None
    keep_alive_timeout: float = 75.0
    handle_signals: bool = True  # False when not in the main thread (tests)
    # Bind with SO_REUSEPORT, so that several API processes (--api-processes)
    # serve one port, each with its own accept queue that the kernel fills.
    reuse_port: bool = False
    # Write this process's LLM.stats and in-flight count to the shared metrics
    # directory (SHARED_DIR_ENV, required) for the metrics process (--metrics-port).
    publish_stats: bool = False
    app: AppConfig = dataclasses.field(default_factory=AppConfig)


def bound_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to ``host:port`` (IPv6 where ``host`` has a colon,
    brackets or not), with SO_REUSEADDR and TCP_NODELAY; raises OSError.

    ``reuse_port``: SO_REUSEPORT too. Any process of this user may then bind
    the same port, and the kernel spreads new connections over all of them
    (by a hash of the addresses).
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host.strip("[]"), port))
    except BaseException:
        sock.close()
        raise
    return sock


def _hypercorn_config(config: ServerConfig) -> HypercornConfig:
    hc = HypercornConfig()
    if config.reuse_port:
        # The fd is hypercorn's from here: it listens on it and closes it.
        sock = bound_socket(config.host, config.port, reuse_port=True)
        hc.bind = [f"fd://{sock.detach()}"]
    else:
        host = f"[{config.host}]" if ":" in config.host else config.host
        hc.bind = [f"{host}:{config.port}"]
    hc.backlog = config.backlog
    hc.keep_alive_timeout = config.keep_alive_timeout
    # After the trigger, hypercorn cancels what is left past this; our own
    # drain ends every request well before it.
    hc.graceful_timeout = config.shutdown_timeout + 5.0
    hc.accesslog = None  # the app logs one line per request itself
    hc.errorlog = logging.getLogger("hypercorn.error")
    logging.getLogger("hypercorn.error").setLevel(logging.WARNING)
    return hc


class _Lifecycle:
    """Runs the shutdown steps once, whichever of signal, trigger or death comes first."""

    def __init__(
        self,
        frontend: Frontend,
        config: ServerConfig,
        on_signal: Callable[[signal.Signals], None] | None,
    ) -> None:
        self.models = frontend.models
        self.frontend = frontend
        self.config = config
        self.on_signal = on_signal
        self.exit_code = EXIT_OK
        self.stop_listening = trio.Event()  # hypercorn's shutdown trigger
        # hypercorn waits for idle keep-alive connections; after our drain has
        # ended every response there is nothing left to wait for.
        self.http_scope = trio.CancelScope()
        self.stall_guard = StallGuard(config.stall_timeout, frontend.metrics.stalled_responses.inc)
        self._draining = False
        self._hurry = trio.Event()

    async def drain(self, grace: float) -> None:
        """Steps 1-3 of the module docstring. A checkpoint; idempotent."""
        if self._draining:
            self._hurry.set()
            return
        self._draining = True
        self.models.start_draining()
        self.stop_listening.set()
        with trio.move_on_after(grace):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_after, self._hurry.wait, nursery.cancel_scope)
                await self.frontend.in_flight.wait_idle()
                nursery.cancel_scope.cancel()
        self.frontend.in_flight.abort_all(
            ShuttingDown("the server shut down before this request finished")
        )
        self.stall_guard.hurry(_FLUSH_STALL)
        with trio.move_on_after(_FLUSH_GRACE):  # aborted streams write their last event
            await self.frontend.in_flight.wait_idle()
        self.http_scope.cancel()

    async def watch_signals(self, nursery: trio.Nursery) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("%s: shutting down", signal.Signals(signum).name)
                if self.on_signal is not None:
                    self.on_signal(signal.Signals(signum))
                nursery.start_soon(self.drain, self.config.shutdown_timeout)

    async def watch_trigger(self, trigger: Callable[[], Awaitable[None]]) -> None:
        await trigger()
        await self.drain(self.config.shutdown_timeout)

    async def watch_engine(self) -> None:
        reason = await self.models.wait_fatal()  # one model: either engine's death
        log.error("the engine died (%s): failing live requests and exiting", reason)
        self.exit_code = EXIT_ENGINE_DEAD
        await trio.sleep(self.config.engine_death_grace)
        await self.drain(0.0)


def _warn_if_open(config: ServerConfig) -> None:
    """Say loudly when anyone who can reach the address can use the server."""
    if config.app.api_key is None and not is_loopback(config.host):
        log.warning(
            "SERVING %s WITHOUT AN API KEY: anyone who can reach this address can use "
            "the server; set --api-key (or TSERVE_API_KEY) or bind 127.0.0.1",
            config.host,
        )


async def _cancel_after(event: Callable[[], Awaitable[object]], scope: trio.CancelScope) -> None:
    await event()
    scope.cancel()


async def serve(
    models: LLM | ModelLookup,
    config: ServerConfig | None = None,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    on_signal: Callable[[signal.Signals], None] | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> int:
    """Serve ``models`` (one LLM, or a ModelLookup of several) over HTTP until
    shutdown; return the process exit code.

    Blocks for the life of the server. ``task_status.started`` gets the base
    URL (``http://host:port``, with the real port when ``port`` is 0).
    Cancelling it stops at once (no drain). ``on_signal`` is called
    (synchronously) with each SIGTERM/SIGINT this server handles, before it
    acts on it: ``--api-processes`` forwards them to its other processes.
    """
    config = config or ServerConfig()
    shared_dir = os.environ.get(SHARED_DIR_ENV)
    if config.publish_stats and not shared_dir:
        raise ValueError(f"publish_stats needs {SHARED_DIR_ENV} (tserve._metrics_dir)")
    if not isinstance(models, ModelLookup):
        models = OneModel(models, config.app.served_model_names, config.app.reasoning_parser)
    fd_limit = raise_fd_limit()
    max_pending, max_queued = models.admission
    max_connections = config.max_connections or connection_bound(max_pending, max_queued, fd_limit)
    log.info(
        "admission: %d requests run at once; up to %d more may wait (over %d models); "
        "at most %d connections are held",
        max_pending,
        max_queued,
        len(models.names),
        max_connections,
    )
    app = create_app(models, config.app, bind_host=config.host)
    _warn_if_open(config)
    frontend: Frontend = app.extensions["tserve"]
    life = _Lifecycle(frontend, config, on_signal)
    async with trio.open_nursery() as nursery:
        if config.handle_signals:
            nursery.start_soon(life.watch_signals, nursery)
        if shutdown_trigger is not None:
            nursery.start_soon(life.watch_trigger, shutdown_trigger)
        nursery.start_soon(life.watch_engine)
        await nursery.start(frontend.responses.run)  # background responses live this long
        if config.publish_stats and shared_dir:
            if not isinstance(models, OneModel):
                raise ValueError("publish_stats serves one model (--metrics-port)")
            llm = models.llm
            stats, count = (lambda: llm.stats), (lambda: frontend.in_flight.count)
            nursery.start_soon(publish_stats, Path(shared_dir), stats, count)

        async def run_http(task_status: trio.TaskStatus[list[str]]) -> None:
            with life.http_scope:
                await serve_http(
                    app,
                    _hypercorn_config(config),
                    life.stall_guard,
                    max_connections=max_connections,
                    shutdown_trigger=life.stop_listening.wait,
                    task_status=task_status,
                )
            nursery.cancel_scope.cancel()  # the watchers are done too

        binds: list[str] = await nursery.start(run_http)
        frontend.probes.started = True
        task_status.started(binds[0])
    return life.exit_code
