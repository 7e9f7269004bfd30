"""The table's rows, each measured one way: raw engine, embedded, HTTP.

Every way runs the same workload, a :class:`Workload`: ``requests``
requests of exactly ``max_tokens`` tokens (``ignore_eos``), at most
``concurrency`` in flight, a new one started whenever one ends. A
:class:`Row` holds what one run measured; its clock runs from the first
request to the end of the last. CPU seconds are read from ``/proc`` (other
processes) or ``time.process_time`` (this one) around the run.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import anyio

from benchmarks.frontend_table._client import ClientSpec, client_argv, prompt
from benchmarks.frontend_table._server import EchoServer, cpu_seconds
from tserve import LLM, SamplingParams, open_llm
from tserve.gpu.engine._echo_core import EchoCore
from tserve.protocol import AddRequest, EngineConfig
from tserve.protocol import SamplingParams as WireParams

__all__ = ["Row", "Workload", "measure_embedded", "measure_http", "measure_raw"]

_REQUEST_TIMEOUT = 600.0  # seconds one HTTP request may take before it counts as failed
_CLIENT_TIMEOUT = 1800.0  # seconds the whole HTTP client may take


@dataclass(frozen=True)
class Workload:
    """What every row of one output length runs."""

    requests: int
    max_tokens: int
    concurrency: int
    step_time: float  # the echo engine's seconds per step


@dataclass
class Row:
    """One run of one way: counts, wall time, CPU seconds by process."""

    path: str  # "raw", "embedded" or "http"
    api_processes: int  # 0 for raw
    max_tokens: int
    requests: int
    ok: int  # requests that ended with exactly max_tokens tokens
    tokens: int  # streamed tokens of those
    wall_s: float
    cpu_s: dict[str, float] = field(default_factory=dict)  # "api", "api 2", "engine", "client"
    loadavg: tuple[float, float] = (0.0, 0.0)  # 1-minute load average before / after

    @property
    def requests_per_s(self) -> float:
        return self.ok / self.wall_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "api_processes": self.api_processes,
            "max_tokens": self.max_tokens,
            "requests": self.requests,
            "ok": self.ok,
            "tokens": self.tokens,
            "wall_s": round(self.wall_s, 3),
            "requests_per_s": round(self.requests_per_s, 1),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "cpu_s": {k: round(v, 2) for k, v in self.cpu_s.items()},
            "loadavg_1m": self.loadavg,
        }


def _load1() -> float:
    return round(os.getloadavg()[0], 2)


def measure_raw(model: str, work: Workload) -> Row:
    """The echo engine alone: an ``EchoCore`` stepped in this process. Blocks."""
    config = EngineConfig(
        model=model,
        engine_kind="echo",
        echo_step_time=work.step_time,
        max_num_seqs=work.concurrency,
    )
    core = EchoCore(config, progress=lambda _: None)
    params = WireParams(max_tokens=work.max_tokens, ignore_eos=True, temperature=0.0)
    todo = collections.deque(range(work.requests))
    counts: dict[str, int] = {}
    live = ok = 0
    load0, cpu0, start = _load1(), time.process_time(), time.perf_counter()
    while todo or live:
        while todo and live < work.concurrency:
            i = todo.popleft()
            core.add(AddRequest(f"r{i}", [3 + i % 300, 4 + i % 7, 5, 6, 7], params), b"peer")
            counts[f"r{i}"] = 0
            live += 1
        for _, out in core.step():
            counts[out.request_id] += len(out.token_ids)
            if out.finish_reason is not None:
                live -= 1
                ok += counts[out.request_id] == work.max_tokens
    wall = time.perf_counter() - start
    cpu = {"engine": time.process_time() - cpu0}
    tokens = ok * work.max_tokens
    return Row("raw", 0, work.max_tokens, work.requests, ok, tokens, wall, cpu, (load0, _load1()))


async def _embedded(llm: LLM, work: Workload) -> tuple[int, float]:
    """``concurrency`` tasks calling ``generate`` one request after another; (ok, wall)."""
    params = SamplingParams(max_tokens=work.max_tokens, ignore_eos=True, temperature=0)
    todo = iter(range(work.requests))
    ok = 0

    async def worker() -> None:
        nonlocal ok
        for i in todo:
            tokens = 0
            async for delta in llm.generate(prompt(i), params):
                tokens += len(delta.token_ids)
            ok += tokens == work.max_tokens

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(work.concurrency):
            tg.start_soon(worker)
    return ok, time.perf_counter() - start


def measure_embedded(model: str, work: Workload, backend: str) -> Row:
    """``open_llm`` (default admission) on the echo engine, in this process. Blocks."""

    async def run() -> Row:
        async with open_llm(
            model,
            engine_kind="echo",
            echo_step_time=work.step_time,
            max_num_seqs=work.concurrency,
            log_level="WARNING",
            heartbeat_timeout=600.0,  # a loaded machine may stall this loop for long
        ) as llm:
            await llm.complete(prompt(0), SamplingParams(max_tokens=2))  # warm: tokenizer, mux
            load0, cpu0, engine0 = _load1(), time.process_time(), cpu_seconds(llm.engine_pid)
            ok, wall = await _embedded(llm, work)
            cpu = {
                "api": time.process_time() - cpu0,
                "engine": cpu_seconds(llm.engine_pid) - engine0,
            }
        tokens = ok * work.max_tokens
        loads = (load0, _load1())
        return Row("embedded", 1, work.max_tokens, work.requests, ok, tokens, wall, cpu, loads)

    return anyio.run(run, backend=backend)


def run_client(spec: ClientSpec) -> dict[str, Any]:
    """Run :mod:`._client` with ``spec``; its JSON result. Blocks for the whole run."""
    done = subprocess.run(
        client_argv(spec), capture_output=True, check=True, timeout=_CLIENT_TIMEOUT
    )
    result: dict[str, Any] = json.loads(done.stdout.decode().splitlines()[-1])
    return result


def measure_http(server: EchoServer, work: Workload) -> Row:
    """``work`` over HTTP against ``server`` from a client child process. Blocks."""
    pids = {"engine": server.engine_pid}
    for n, pid in enumerate(server.api_pids, 1):
        pids["api" if n == 1 else f"api {n}"] = pid
    spec = ClientSpec(
        server.url, work.requests, work.max_tokens, work.concurrency, _REQUEST_TIMEOUT
    )
    load0 = _load1()
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    result = run_client(spec)
    cpu = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    cpu["client"] = result["cpu_s"]
    summary = result["summary"]
    exact = summary["output_tokens"] == summary["completed"] * work.max_tokens
    ok = summary["completed"] if exact else 0
    return Row(
        "http",
        len(server.api_pids),
        work.max_tokens,
        work.requests,
        ok,
        ok * work.max_tokens,
        summary["duration"],
        cpu,
        (load0, _load1()),
    )
