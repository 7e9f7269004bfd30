"""``python -m benchmarks.frontend_table``: the options, the runs in order, the files."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import benchmarks.frontend_table as package
from benchmarks._results import REPO_ROOT, result_stem, write_json
from benchmarks.frontend_table._client import ClientSpec
from benchmarks.frontend_table._measure import (
    Row,
    Workload,
    measure_embedded,
    measure_http,
    measure_raw,
    run_client,
)
from benchmarks.frontend_table._server import start_server, stop_server
from benchmarks.frontend_table._table import markdown, plot, ratios
from benchmarks.seed_http._server import build_model

__all__ = ["main"]

_WARMUP_TIMEOUT = 120.0  # seconds per warm-up request


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.frontend_table",
        description=package.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--lengths", type=int, nargs="+", default=[8, 256], help="output tokens per request")
    add("--requests", type=int, nargs="+", default=[10000, 3000], help="requests, per length")
    add("--concurrency", type=int, default=256, help="requests in flight (and engine batch)")
    add("--step-time", type=float, default=0.001, help="echo engine seconds per step")
    add("--api-processes", type=int, nargs="+", default=[1, 2], help="HTTP rows to measure")
    add("--model", default="tiny", help="whose tokenizer: tiny (built now), default, or a dir")
    add("--backend", choices=["trio", "asyncio"], default="trio", help="the embedded rows'")
    add("--repeat", type=int, default=2, help="runs of every row (the fastest is kept)")
    add("--no-plot", action="store_true", help="skip the PNG")
    return parser


def _run_all(args: argparse.Namespace, model: str, works: list[Workload], stem: Path) -> list[Row]:
    """Every row ``--repeat`` times: raw and embedded per length, then each server."""
    runs: list[Row] = []
    for attempt in range(args.repeat):
        for work in works:
            runs.append(measure_raw(model, work))
            _progress(runs[-1])
            runs.append(measure_embedded(model, work, args.backend))
            _progress(runs[-1])
        for n in args.api_processes:
            log = stem.with_name(f"{stem.name}-server-x{n}-{attempt}.log")
            server = start_server(model, n, args.step_time, args.concurrency, log)
            try:
                warm = ClientSpec(server.url, 4 * args.concurrency, 2, args.concurrency, 120.0)
                run_client(warm)
                for work in works:
                    runs.append(measure_http(server, work))
                    _progress(runs[-1])
            finally:
                stop_server(server.process)
    return runs


def _progress(row: Row) -> None:
    print(
        f"  {row.path} x{row.api_processes} {row.max_tokens} tokens: "
        f"{row.ok}/{row.requests} ok, {row.requests_per_s:,.0f} req/s, "
        f"{row.tokens_per_s:,.0f} tok/s (load {row.loadavg[0]}-{row.loadavg[1]})",
        flush=True,
    )


def _fastest(runs: list[Row]) -> list[Row]:
    """Each row's fastest run, in the order rows were first measured."""
    best: dict[tuple[int, str, int], Row] = {}
    for row in runs:
        key = (row.max_tokens, row.path, row.api_processes)
        if key not in best or row.tokens_per_s > best[key].tokens_per_s:
            best[key] = row
    return list(best.values())


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, print the table, write the files; 0 if every request was exact. Blocks."""
    args = _parser().parse_args(argv)
    if len(args.requests) != len(args.lengths):
        raise SystemExit("give one --requests count per --lengths value")
    works = [
        Workload(n, length, args.concurrency, args.step_time)
        for length, n in zip(args.lengths, args.requests, strict=True)
    ]
    stem = result_stem("frontend_table")
    print(
        f"frontend_table: lengths {args.lengths}, requests {args.requests}, "
        f"{args.concurrency} in flight, echo step {args.step_time:g} s, "
        f"load avg {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="frontend-table-") as scratch:
        model = build_model(args.model, Path(scratch))
        runs = _run_all(args, model, works, stem)
    rows = _fastest(runs)
    table = markdown(rows)
    print(table)
    found = ratios(rows)
    result = {
        "benchmark": "frontend_table",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "settings": {k: v for k, v in vars(args).items() if k != "no_plot"},
        "rows": [
            row.to_json() | {"ratios": found[(row.max_tokens, row.path, row.api_processes)]}
            for row in rows
        ],
        "runs": [row.to_json() for row in runs],
        "table": table,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "command": " ".join(["python -m benchmarks.frontend_table", *(argv or sys.argv[1:])]),
    }
    path = write_json(stem, result)
    print(f"wrote {path.relative_to(REPO_ROOT)}")
    title = f"frontend ceiling, echo engine ({args.concurrency} in flight), {os.cpu_count()} CPUs"
    if not args.no_plot and plot(rows, title, path.with_suffix(".png")):
        print(f"wrote {path.with_suffix('.png').relative_to(REPO_ROOT)}")
    return 0 if all(row.ok == row.requests for row in runs) else 1
