"""The embedded frontend's ceiling: very many concurrent ``generate`` calls on one ``open_llm``.

Run: ``python -m benchmarks.frontend_ceiling [--requests 100000] [--max-tokens 8]
[--max-pending 1024] [--step-time 0.001] [--backend trio|asyncio]``

No model runs: the engine is the echo engine (``engine_kind="echo"``), which
emits ``--max-tokens`` tokens per request at ``--step-time`` s a step, so
what is measured is the API process alone. ``--requests`` tasks each call
``generate`` on one ``open_llm`` with its default admission (``--max-pending``
slots; the rest wait for one) and hold their stream until every call has
been made; then all read their streams to the end. It reports:

* whether every request got exactly ``--max-tokens`` tokens (the exit
  status is 0 only then, and with the fd count flat);
* resident memory (``/proc/self/statm``) before, with every request
  admitted, and after, and the growth per admitted request;
* the fd count at the same three points;
* the wall time of the run, requests/s and streamed tokens/s, and the CPU
  time (user + system) this process and the engine process used.

A JSON result goes under ``results/``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from benchmarks._results import result_stem, write_json
from tserve import LLM, SamplingParams, open_llm

_PAGE = os.sysconf("SC_PAGE_SIZE")
_TICK = os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int | str = "self") -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU time of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


async def run_ceiling(llm: LLM, requests: int, max_tokens: int) -> dict[str, Any]:
    """``requests`` concurrent generate calls on ``llm``; the numbers above. A checkpoint."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    counts: list[int] = []
    admitted = 0
    all_admitted = anyio.Event()
    at_peak: dict[str, int] = {}

    async def one(i: int) -> None:
        nonlocal admitted
        stream = llm.generate([3 + i % 300, 4 + i % 7], params)
        admitted += 1
        if admitted == requests:
            at_peak.update(rss=rss_bytes(), fds=fd_count(), queued=llm.stats.queued_requests)
            all_admitted.set()
        await all_admitted.wait()
        tokens = 0
        async for delta in stream:
            tokens += len(delta.token_ids)
        counts.append(tokens)

    base_rss, base_fds = rss_bytes(), fd_count()
    cpu0, engine_cpu0 = cpu_seconds(), cpu_seconds(llm.engine_pid)
    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(requests):
            tg.start_soon(one, i)
    wall = time.perf_counter() - start
    exact = counts == [max_tokens] * requests
    return {
        "requests": requests,
        "max_tokens": max_tokens,
        "max_pending": llm.max_pending,
        "exact_token_counts": exact,
        "peak_queued": at_peak["queued"],
        "rss_before_mb": base_rss / 2**20,
        "rss_all_admitted_mb": at_peak["rss"] / 2**20,
        "rss_after_mb": rss_bytes() / 2**20,
        "bytes_per_admitted_request": (at_peak["rss"] - base_rss) / requests,
        "fds": [base_fds, at_peak["fds"], fd_count()],
        "wall_s": wall,
        "requests_per_s": requests / wall,
        "tokens_per_s": requests * max_tokens / wall,
        "api_cpu_s": cpu_seconds() - cpu0,
        "engine_cpu_s": cpu_seconds(llm.engine_pid) - engine_cpu0,
    }


async def _main(args: argparse.Namespace, model: str) -> dict[str, Any]:
    async with open_llm(
        model,
        max_pending=args.max_pending,
        engine_kind="echo",
        echo_step_time=args.step_time,
        log_level="WARNING",
        # Scheduling 100,000 tasks can keep the event loop from reading the
        # socket for longer than the default 30 s on a loaded machine.
        heartbeat_timeout=600.0,
    ) as llm:
        await llm.complete([5, 6], SamplingParams(max_tokens=2))  # warm: tokenizer, mux
        return await run_ceiling(llm, args.requests, args.max_tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.frontend_ceiling")
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-pending", type=int, default=1024, help="open_llm's default")
    parser.add_argument("--step-time", type=float, default=0.001, help="echo engine step (s)")
    parser.add_argument("--backend", choices=["trio", "asyncio"], default="trio")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        from tserve.gpu.models._directory import build_tiny_model  # the tokenizer only

        model = str(build_tiny_model(Path(scratch) / "tiny"))
        result = anyio.run(_main, args, model, backend=args.backend)
    result["backend"] = args.backend
    for key, value in result.items():
        print(f"{key:28} {value:.4g}" if isinstance(value, float) else f"{key:28} {value}")
    path = write_json(result_stem("frontend_ceiling"), result)
    print(f"wrote {path}")
    fds = result["fds"]
    return 0 if result["exact_token_counts"] and fds[0] == fds[1] == fds[2] else 1


if __name__ == "__main__":
    sys.exit(main())
