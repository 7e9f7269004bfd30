"""``python -m benchmarks.seed_http``: the options, the run, the table and the files."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

import benchmarks.seed_http as package
from benchmarks._results import REPO_ROOT, result_stem, write_json
from benchmarks.seed_http._report import plot, print_table
from benchmarks.seed_http._run import run
from benchmarks.seed_http._summary import passed, summarize

__all__ = ["main", "measure", "parse_args"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.seed_http",
        description=package.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--requests", type=int, default=10_000, help="streaming completions to send")
    add("--rate", type=float, default=1000.0, help="arrivals per second (open loop)")
    add("--arrivals", choices=["fixed", "poisson"], default="fixed")
    add("--seed", type=int, default=0, help="seed of the Poisson schedule")
    add(
        "--clients",
        type=int,
        default=2,
        help="load generator processes, each sending rate/N (one process's fds cap its streams)",
    )
    add("--max-tokens", type=int, default=8, help="completion tokens per request (ignore_eos)")
    add("--model", default="tiny", help="tiny (built now), default, or a model directory")
    add("--max-pending", type=int, help="server admission bound (default: requests + 1000)")
    add("--max-num-seqs", type=int, default=256, help="engine batch size")
    add("--kv-cache-tokens", type=int, default=65536)
    add("--max-num-batched-tokens", type=int, default=4096)
    add("--engine-kind", default="model", help="model, or echo (no model: the frontend alone)")
    add(
        "--server-defaults",
        action="store_true",
        help="start the server with its own admission and engine defaults (ignores the four above)",
    )
    add("--max-seconds", type=float, default=600.0, help="hard cap on the whole run")
    add("--interval", type=float, default=0.05, help="sampling period in seconds")
    add("--tail-seconds", type=float, default=3.0, help="sampling after the load")
    add("--no-plot", action="store_true", help="skip the PNG timeline")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options, with ``--max-pending`` resolved (``--requests`` + 1000 unless given)."""
    args = _parser().parse_args(argv)
    if args.max_pending is None:
        args.max_pending = args.requests + 1000
    if args.clients < 1:
        _parser().error("--clients must be at least 1")
    return args


def measure(args: argparse.Namespace, log_path: Path) -> dict[str, Any]:
    """One run (:func:`._run.run`), summed up (:func:`._summary.summarize`), with
    how the server ended under ``"server"``; the server's output goes to ``log_path``.

    Blocks for the whole run: at most ``--max-seconds`` plus about a minute
    of grace for the server's start and stop.
    """
    load, samples, server = trio.run(run, args, log_path)
    result = summarize(args, load, samples)
    result["server"] = server
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print and write its result; 0 if it passed (see
    :func:`._summary.passed`), else 1. Blocks for the whole run (:func:`measure`)."""
    args = parse_args(argv)
    admission = (
        "the server's default admission"
        if args.server_defaults
        else f"--max-pending {args.max_pending} (above the request count: admission refuses none)"
    )
    print(
        f"seed_http: {args.requests} streaming requests at {args.rate:g}/s "
        f"from {args.clients} client processes, {args.max_tokens} tokens each, "
        f"model {args.model} ({args.engine_kind}), {admission}",
        flush=True,
    )
    stem = result_stem("seed_http", time.strftime("%Y%m%d-%H%M%S"))
    result = measure(args, stem.with_name(f"{stem.name}-server.log"))
    print_table(result, sys.stdout)
    path = write_json(stem, result, indent=1)
    print(f"wrote {path.relative_to(REPO_ROOT)}")
    png = path.with_suffix(".png")
    if not args.no_plot and plot(result, png):
        print(f"wrote {png.relative_to(REPO_ROOT)}")
    ok = passed(result)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1
