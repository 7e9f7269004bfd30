"""One run, in order: server up, baseline, load with sampling, tail, server down.

1. Build the model (``tiny``) and start the server (:mod:`._server`).
2. Sample the idle server for a second (the baseline).
3. Start the load generator (:mod:`._load`, ``--clients`` child
   processes), sample until they exit, and merge their records.
4. Sample ``--tail-seconds`` more, then read the kernel's TCP counters and
   the server's final completion counts.
5. Stop the server (shielded: it happens on every way out).

Bounds: the server gets until the deadline (``--max-seconds`` from the
start) to be ready; the load generator cancels its requests at the
deadline and is abandoned 15 s after it; the whole run ends 30 s after it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from subprocess import PIPE
from typing import Any

import httpx
import trio

from benchmarks._results import REPO_ROOT
from benchmarks.seed_http._census import tcp_counters
from benchmarks.seed_http._load import ClientConfig, merge
from benchmarks.seed_http._sampler import Samples, parse_metrics, sample_for
from benchmarks.seed_http._server import (
    ServerProcs,
    build_model,
    server_command,
    start_server,
    stop_server,
    wait_ready,
)

__all__ = ["LoadRun", "run"]

_CLIENT_GRACE = 15.0  # seconds the load generator gets past the deadline to write its result
_RUN_GRACE = 30.0  # ... and the whole run, to finish sampling
_BASELINE = 1.0  # seconds of sampling the idle server
# The load generator's settings that are command-line options of the same name.
_CLIENT_OPTIONS = ("requests", "rate", "max_tokens", "arrivals", "seed", "clients")
_CLIENT_LEAD = 0.1  # seconds from the load generator's "ready" to request 0
_CLIENT_MODULE = "benchmarks.seed_http._load"


@dataclass
class LoadRun:
    """What happened between starting the load generator and the end of the tail."""

    start: float = math.inf  # time.monotonic() when request 0 was due
    end: float = math.inf  # ... and when it exited
    client: dict[str, Any] | None = None  # the load generator's result
    completions_by_status: dict[str, float] = field(default_factory=dict)  # from /metrics
    tcp_counters: dict[str, int] = field(default_factory=dict)  # kernel counters, deltas
    admission: dict[str, int] | None = None  # the bounds the server logged at start


async def run(args: argparse.Namespace, log_path: Path) -> tuple[LoadRun, Samples, dict[str, Any]]:
    """The whole run; returns what the load and the sampler saw, and how the server ended."""
    deadline = time.monotonic() + args.max_seconds
    with tempfile.TemporaryDirectory(prefix="seed-http-") as scratch:
        model = await trio.to_thread.run_sync(build_model, args.model, Path(scratch))
        command = server_command(args, model)
        process = await start_server(command, log_path)
        procs: ServerProcs | None = None
        samples = Samples()
        load = LoadRun()
        try:
            with trio.move_on_at(_trio_time(deadline + _RUN_GRACE)):
                with trio.fail_at(_trio_time(deadline)):
                    procs = await wait_ready(process, log_path)
                load = await _run_load(args, procs, deadline, samples)
        finally:
            with trio.CancelScope(shield=True):
                server = await stop_server(process, procs)
    server |= {"command": command[1:], "log": str(log_path)}
    return load, samples, server


def _trio_time(monotonic: float) -> float:
    """``trio.current_time()`` at the moment ``time.monotonic()`` reads ``monotonic``."""
    return trio.current_time() + monotonic - time.monotonic()


async def _run_load(
    args: argparse.Namespace, procs: ServerProcs, deadline: float, samples: Samples
) -> LoadRun:
    """Baseline, then the load generator with the samplers, then a short tail."""
    load = LoadRun(admission=procs.admission)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{procs.port}") as client:
        await sample_for(procs, client, samples, _BASELINE, args.interval)
        counters = tcp_counters()
        with tempfile.TemporaryDirectory(prefix="seed-http-client-") as out:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sample_for, procs, client, samples, math.inf, args.interval)
                with trio.move_on_at(_trio_time(deadline + _CLIENT_GRACE)):
                    await _load_generator(args, procs.port, deadline, out, load)
                nursery.cancel_scope.cancel()
        load.end = time.monotonic()
        await sample_for(procs, client, samples, args.tail_seconds, args.interval)
        after = tcp_counters()
        load.tcp_counters = {k: after[k] - counters[k] for k in after if k in counters}
        with contextlib.suppress(httpx.HTTPError):
            final = parse_metrics((await client.get("/metrics", timeout=10.0)).content)
            load.completions_by_status = final["completions_by_status"]
    return load


async def _load_generator(
    args: argparse.Namespace, port: int, deadline: float, scratch: str, load: LoadRun
) -> None:
    """Run :mod:`._load` in ``--clients`` child processes until they exit: once all
    have built their requests, request 0 is due in :data:`_CLIENT_LEAD` s
    (``load.start``). Their results are merged into ``load.client``
    (:func:`._load.merge`; a child that wrote none leaves its requests never started).

    Cancellation kills the children that are left.
    """
    options = {name: getattr(args, name) for name in _CLIENT_OPTIONS}
    out = str(Path(scratch, "client"))
    base = ClientConfig(port=port, deadline=deadline, out=out, **options)
    children: list[trio.Process] = []
    try:
        for part in range(args.clients):
            argv = [
                sys.executable,
                "-m",
                _CLIENT_MODULE,
                json.dumps(asdict(replace(base, part=part))),
            ]
            children.append(
                await trio.lowlevel.open_process(argv, cwd=REPO_ROOT, stdin=PIPE, stdout=PIPE)
            )
        for child in children:
            assert child.stdout is not None
            await child.stdout.receive_some()  # "ready\n", or b"" from a child that failed
        load.start = time.monotonic() + _CLIENT_LEAD
        for child in children:
            assert child.stdin is not None
            with contextlib.suppress(trio.BrokenResourceError):
                await child.stdin.send_all(f"{load.start!r}\n".encode())
        for child in children:
            await child.wait()
    finally:
        for child in children:
            if child.returncode is None:
                child.kill()
            with trio.CancelScope(shield=True):
                await child.wait()
                for pipe in (child.stdin, child.stdout):
                    if pipe is not None:
                        await pipe.aclose()
    parts: list[dict[str, Any] | None] = []
    for part in range(args.clients):
        path = trio.Path(f"{out}.{part}")
        parts.append(json.loads(await path.read_text()) if await path.exists() else None)
    load.client = merge(parts, args.requests, args.interval)
