"""What a run prints and writes: a text table, a JSON document, PNG plots.

Latencies are stored in seconds and shown in milliseconds. matplotlib is
imported only to plot (the ``bench`` extra), with the non-interactive Agg
backend.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tserve.bench._metrics import LATENCIES, Summary

__all__ = ["format_summary", "plot_run", "plot_sweep", "sweep_table"]

_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E"}


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.2f}"


def format_summary(summary: Summary, title: str) -> str:
    """A vLLM-style result block."""
    s = summary
    rows: list[tuple[str, str]] = [
        ("Successful requests", str(s.completed)),
        ("Failed requests", str(s.failed)),
    ]
    rows += [(f"  errors: {kind}", str(n)) for kind, n in s.errors.items()]
    rows += [
        ("Benchmark duration (s)", f"{s.duration:.2f}"),
        ("Peak concurrency", str(s.peak_concurrency)),
        ("Total input tokens", str(s.input_tokens)),
        ("Total generated tokens", str(s.output_tokens)),
        ("Request throughput (req/s)", f"{s.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{s.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{s.total_throughput:.2f}"),
    ]
    for key in LATENCIES:
        stats = s.latency[key]
        name = _NAMES[key]
        rows += [
            (f"Mean {name} (ms)", _ms(stats.mean)),
            (f"Median {name} (ms)", _ms(stats.median)),
            (f"P99 {name} (ms)", _ms(stats.p99)),
        ]
    width = 50
    lines = [f" {title} ".center(width, "="), *(f"{k:<36}{v:>14}" for k, v in rows)]
    return "\n".join([*lines, "=" * width])


def sweep_table(label: str, points: Sequence[tuple[str, Summary]]) -> str:
    """One line per run of a sweep: throughput and median/p99 TTFT and ITL."""
    w = max(len(label), *(len(x) for x, _ in points))
    head = (
        f"{label:>{w}} {'ok':>5} {'fail':>5} {'req/s':>8} {'out tok/s':>10} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}  (ms)"
    )
    lines = [head]
    for x, s in points:
        ttft, itl = s.latency["ttft"], s.latency["itl"]
        lines.append(
            f"{x:>{w}} {s.completed:>5} {s.failed:>5} {s.request_throughput:>8.2f} "
            f"{s.output_throughput:>10.1f} {_ms(ttft.median):>9} {_ms(ttft.p99):>9} "
            f"{_ms(itl.median):>8} {_ms(itl.p99):>8}"
        )
    return "\n".join(lines)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(summary: Summary, title: str, path: Path) -> None:
    """Latency percentiles (grouped bars) and throughput of one run."""
    plt = _pyplot()
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(11, 4.2), width_ratios=[3, 1.4])
    qs = ["p50", "p90", "p99"]
    width = 0.8 / len(qs)
    for i, q in enumerate(qs):
        values = [summary.latency[k].p[q] * 1000 for k in LATENCIES]
        xs = [j + (i - 1) * width for j in range(len(LATENCIES))]
        lat.bar(xs, values, width, label=q)
    lat.set_xticks(range(len(LATENCIES)), [_NAMES[k] for k in LATENCIES])
    lat.set_ylabel("ms")
    if all(s.p[q] > 0 for s in summary.latency.values() for q in qs):
        lat.set_yscale("log")
    lat.set_title("latency percentiles")
    lat.legend()
    names = ["output", "total"]
    values = [summary.output_throughput, summary.total_throughput]
    bars = thr.bar(names, values, color=["tab:green", "tab:olive"])
    thr.bar_label(bars, fmt="%.0f")
    thr.set_ylabel("tokens/s")
    thr.set_title(f"throughput ({summary.request_throughput:.2f} req/s)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(
    series: Mapping[str, Sequence[tuple[float, Summary]]], xlabel: str, title: str, path: Path
) -> None:
    """Throughput and median/p99 TTFT and ITL against the swept load, one line per series."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for (name, points), color in zip(
        series.items(),
        ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"],
        strict=False,
    ):
        xs = [x for x, _ in points]
        axes[0].plot(xs, [s.output_throughput for _, s in points], "o-", color=color, label=name)
        for ax, key in ((axes[1], "ttft"), (axes[2], "itl")):
            med = [s.latency[key].median * 1000 for _, s in points]
            p99 = [s.latency[key].p99 * 1000 for _, s in points]
            ax.plot(xs, med, "o-", color=color, label=f"{name} p50")
            ax.plot(xs, p99, "s--", color=color, alpha=0.6, label=f"{name} p99")
    axes[0].set_ylabel("output tokens/s")
    axes[0].set_title("throughput")
    axes[1].set_title("TTFT")
    axes[2].set_title("ITL")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[1:]:
        ax.set_ylabel("ms")
        low = min((y for line in ax.get_lines() for y in line.get_ydata()), default=0.0)
        if low > 0:
            ax.set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
