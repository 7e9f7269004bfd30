"""The rows as a table: ratios, Markdown text, a bar chart.

Ratios, within one output length: every row's tokens/s ÷ the raw echo
engine's (what share of the engine's pace the frontend keeps), and the
2-API-process HTTP row's ÷ the 1-process row's. Requests/s ratios equal the
tokens/s ones (every request streams the same number of tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.frontend_table._measure import Row

__all__ = ["markdown", "plot", "ratios"]

_NAMES = {"raw": "echo engine alone", "embedded": "embedded (`open_llm`)", "http": "HTTP"}


def _key(row: Row) -> tuple[int, str, int]:
    return row.max_tokens, row.path, row.api_processes


def _order(row: Row) -> tuple[int, int, int]:
    return row.max_tokens, list(_NAMES).index(row.path), row.api_processes


def ratios(rows: list[Row]) -> dict[tuple[int, str, int], dict[str, float]]:
    """Per row (output tokens, path, API processes): ``vs_raw`` and ``vs_one_process``."""
    by_key = {_key(r): r for r in rows}
    out: dict[tuple[int, str, int], dict[str, float]] = {}
    for row in rows:
        found: dict[str, float] = {}
        raw = by_key.get((row.max_tokens, "raw", 0))
        if row.path != "raw" and raw is not None and raw.tokens_per_s:
            found["vs_raw"] = row.tokens_per_s / raw.tokens_per_s
        one = by_key.get((row.max_tokens, "http", 1))
        if row.path == "http" and row.api_processes == 2 and one is not None and one.tokens_per_s:
            found["vs_one_process"] = row.tokens_per_s / one.tokens_per_s
        out[_key(row)] = found
    return out


def _cpu(row: Row) -> str:
    api = [v for k, v in row.cpu_s.items() if k.startswith("api")]
    parts = [" + ".join(f"{v:.1f}" for v in api) if api else "-"]
    parts += [f"{row.cpu_s[k]:.1f}" if k in row.cpu_s else "-" for k in ("engine", "client")]
    return " / ".join(parts)


def _per_request_ms(row: Row) -> str:
    api = sum(v for k, v in row.cpu_s.items() if k.startswith("api"))
    return f"{1000 * api / row.ok:.2f}" if api and row.ok else "-"


def markdown(rows: list[Row]) -> str:
    """The table, one row per run, grouped by output length."""
    found = ratios(rows)
    lines = [
        "| output tokens | path | API processes | requests/s | tokens/s "
        "| per API process: req/s, tok/s | ÷ engine alone | 2 ÷ 1 "
        "| CPU s: API / engine / client | API CPU ms per request | wall s | load avg |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in sorted(rows, key=_order):
        r = found[_key(row)]
        per = "-"
        if row.api_processes:
            n = row.api_processes
            per = f"{row.requests_per_s / n:,.0f}, {row.tokens_per_s / n:,.0f}"
        cells = [
            str(row.max_tokens),
            _NAMES[row.path],
            str(row.api_processes or "-"),
            f"{row.requests_per_s:,.0f}",
            f"{row.tokens_per_s:,.0f}",
            per,
            f"{r['vs_raw']:.3f}" if "vs_raw" in r else "-",
            f"{r['vs_one_process']:.2f}" if "vs_one_process" in r else "-",
            _cpu(row),
            _per_request_ms(row),
            f"{row.wall_s:.1f}",
            f"{row.loadavg[0]:.1f} to {row.loadavg[1]:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[Row], title: str, path: Path) -> bool:
    """Bars of tokens/s per path, one panel per output length; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    found = ratios(rows)
    lengths = sorted({r.max_tokens for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 4.5), squeeze=False)
    for ax, length in zip(axes[0], lengths, strict=True):
        mine = [r for r in rows if r.max_tokens == length]
        labels = [
            _NAMES[r.path].replace("`", "") + (f" x{r.api_processes}" if r.path == "http" else "")
            for r in mine
        ]
        colors = [f"C{i}" for i in range(len(mine))]
        bars = ax.bar(labels, [r.tokens_per_s for r in mine], color=colors)
        for bar, row in zip(bars, mine, strict=True):
            r: dict[str, Any] = found[_key(row)]
            note = f"{r['vs_raw']:.3f} of raw" if "vs_raw" in r else f"{row.tokens_per_s:,.0f}"
            if "vs_one_process" in r:
                note += f"\n{r['vs_one_process']:.2f}x of 1 process"
            ax.annotate(
                note,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_yscale("log")
        ax.set_ylim(bottom=min(r.tokens_per_s for r in mine) / 10)  # every bar's foot shows
        ax.set_ylabel("streamed tokens / s")
        ax.set_title(f"{length} output tokens")
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
