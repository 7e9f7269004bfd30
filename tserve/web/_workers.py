"""The extra API processes of ``python -m tserve serve --api-processes N``, seen from the main one.

The main process owns the engine(s) and serves HTTP itself; it starts N-1
workers with :class:`Workers`, each ``python -m tserve.web._worker_main``: an API
process of its own that attaches to the main process's engine with its own
mux (``attach_llm``, and ``attach_embedder`` when there is an embedding
engine) and binds the same port with SO_REUSEPORT. The kernel spreads new
connections over the N listening sockets.

Lifecycle rules:

* A worker reads its :class:`WorkerSpec` as JSON on stdin (not argv, where
  ``ps`` would show the API key) and prints :data:`READY` once it listens.
* Workers run in sessions of their own, so a Ctrl-C or a SIGTERM to the
  main process's group reaches the main process only, and the main process
  forwards each SIGTERM/SIGINT it handles to every worker exactly once per
  signal: a second signal hurries them as it hurries the main process.
* Leaving :meth:`Workers.run`'s block (after the main server returned):
  workers not yet signalled get SIGTERM; all get ``stop_grace`` s to drain
  and exit, then SIGKILL. Only then does the main process stop the engine.
* A worker exits when the main process is gone (it watches its parent), and
  anyway soon after, because the engine exits without its parent and the
  worker sees that through the engine's pidfd (a ``tserve engine`` that the
  main process reached by address runs on: the worker just drains and exits).
* A worker that exits on its own while the server runs makes the whole
  server shut down and exit non-zero, as a dead engine does: a supervisor
  restarts it whole rather than let it serve with part of its capacity.

With ``--metrics-port`` one more child runs under the same rules,
``python -m tserve.web._metrics_main`` with a :class:`MetricsSpec`, except
that forwarded signals skip it: it answers scrapes until the main process's
server has drained, and gets its SIGTERM on the way out with the rest.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import sys
from collections.abc import AsyncIterator

import msgspec
import trio

from tserve.nursery._client import ClientSettings
from tserve.web._server import ServerConfig

__all__ = ["READY", "MetricsSpec", "WorkerSpec", "Workers"]

log = logging.getLogger("tserve")

READY = "tserve-worker: ready"


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What one worker needs: where the engines are and how to serve.

    ``engine_pid`` None: the engine is a ``tserve engine`` reached by address
    alone, with ``keys`` (a directory), ``insecure`` and ``heartbeat_interval``
    as the main process reaches it (``attach_llm``).
    """

    parent_pid: int
    engine_address: str
    engine_pid: int | None
    keys: str | None = None
    insecure: bool = False
    heartbeat_interval: float = 0.5
    embedding_address: str | None = None
    embedding_pid: int | None = None
    server: ServerConfig  # with reuse_port=True and the real port
    client: ClientSettings  # as the main process's clients have them
    log_level: str = "INFO"


class MetricsSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What the metrics process needs: where to listen, and the labels of the engine's numbers.

    ``port`` 0: any free port (it prints the URL). The shared metrics
    directory comes in the environment, as for the workers.
    """

    parent_pid: int
    host: str
    port: int
    allowed_hosts: tuple[str, ...] = ()
    model_name: str
    block_size: int
    num_gpu_blocks: int
    log_level: str = "INFO"


class Workers:
    """The worker processes of one main process. Use :meth:`run`; call from its trio thread."""

    def __init__(self, count: int, *, stop_grace: float) -> None:
        self._count = count
        self._stop_grace = stop_grace
        self._processes: list[trio.Process] = []  # the API workers, then the metrics process
        self._api_count = 0  # of those, the API workers: the ones forward() signals
        self._signalled: set[int] = set()  # pids that got a forwarded signal
        self._stopping = False
        self.failed = trio.Event()  # a worker exited while the server ran

    @property
    def pids(self) -> list[int]:
        """The API workers' pids."""
        return [p.pid for p in self._processes[: self._api_count]]

    @property
    def exit_codes(self) -> list[int | None]:
        return [p.returncode for p in self._processes]

    def forward(self, sig: signal.Signals) -> None:
        """Send ``sig`` to every API worker still running. Synchronous, never raises."""
        for process in self._processes[: self._api_count]:
            if process.returncode is None:
                self._signalled.add(process.pid)
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(sig)

    @contextlib.asynccontextmanager
    async def run(
        self, spec: WorkerSpec, metrics: MetricsSpec | None = None
    ) -> AsyncIterator[Workers]:
        """Start the workers (and the metrics process, given ``metrics``); enter once
        every one listens; stop them all on the way out.

        Raises RuntimeError if a worker exits before it is ready (its reason
        is in the log it shares with us). Leaving the block in any way stops
        every worker (shielded; bound: ``stop_grace`` s + 5 s).
        """
        async with trio.open_nursery() as nursery:
            try:
                for _ in range(self._count):
                    process = await self._start_one("tserve.web._worker_main", spec)
                    self._api_count += 1
                    await nursery.start(self._follow, process, "API worker")
                if metrics is not None:
                    process = await self._start_one("tserve.web._metrics_main", metrics)
                    await nursery.start(self._follow, process, "metrics process")
                yield self
            finally:
                self._stopping = True
                with trio.CancelScope(shield=True):
                    await self._stop_all()
                nursery.cancel_scope.cancel()

    async def _start_one(self, module: str, spec: msgspec.Struct) -> trio.Process:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # A worker moves to a process group of its own (own_process_group), in
            # our session: signals reach workers through forward() only.
        )
        self._processes.append(process)
        assert process.stdin is not None
        async with process.stdin:
            await process.stdin.send_all(msgspec.json.encode(spec))
        return process

    async def _follow(
        self,
        process: trio.Process,
        name: str,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Report ``process`` started once it printed READY, pass its other output
        on to our stdout, and turn an exit of its own into ``failed``."""
        assert process.stdout is not None
        buffer = b""
        ready = False
        async for chunk in process.stdout:
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if not ready and line.decode(errors="replace") == READY:
                    ready = True
                    task_status.started()
                else:
                    sys.stdout.buffer.write(line + b"\n")
                    sys.stdout.flush()
        code = await process.wait()
        if not ready:
            raise RuntimeError(f"{name} {process.pid} exited with {code} before it was ready")
        if not self._stopping and process.pid not in self._signalled:
            log.error("%s %d exited with %d: shutting the server down", name, process.pid, code)
            self.failed.set()

    async def _stop_all(self) -> None:
        for process in self._processes:
            if process.returncode is None and process.pid not in self._signalled:
                self._signalled.add(process.pid)
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
        for sig, wait in ((None, self._stop_grace), (signal.SIGKILL, 5.0)):
            with trio.move_on_after(wait):
                for process in self._processes:
                    if sig is not None and process.returncode is None:
                        with contextlib.suppress(ProcessLookupError):
                            process.send_signal(sig)
                    await process.wait()
