"""tserve and peer servers side by side: one machine, one model, one workload.

Each server runs in turn on a free loopback port; ``python -m tserve bench``
sends it the identical streamed workload at each concurrency level; the
rounds alternate (tserve, peer, [another peer,] tserve, peer, ...), so that a
slow phase of a shared machine hits all of them. The result is one table of
tserve ÷ peer ratios per peer (output throughput, TTFT and ITL median and
p99) from the mean of each server's rounds, a JSON document, the tables as
Markdown and a PNG plot. A server's ``probe`` measures its process (memory,
say) after it starts and after its workload.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks._results import REPO_ROOT
from tserve.bench._metrics import Summary
from tserve.bench._report import plot_sweep

__all__ = ["Peer", "Rounds", "Workload", "run_rounds", "run_side_by_side", "write_results"]


@dataclasses.dataclass(frozen=True)
class Workload:
    """What every server gets: sonnet prompts, streamed /v1/completions, greedy."""

    levels: dict[int, int]  # concurrency -> requests at that level
    input_len: int
    output_len: int
    level_duration: float  # seconds per level at most
    rounds: int = 1


@dataclasses.dataclass(frozen=True)
class Peer:
    """A server to compare: ``command(port)`` starts it (serving the model under
    the name the workload asks for) with ``env`` added to this process's.
    ``probe(pid)``, given the server's pid, returns what it measured there."""

    name: str
    command: Callable[[int], list[str]]
    env: dict[str, str]
    start_timeout: float = 300.0
    probe: Callable[[int], dict[str, Any]] | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A server child process on a free loopback port, stopped by :meth:`stop`.

    The constructor blocks until ``/health`` answers 200 (SystemExit with the
    log's tail if the process exits or ``timeout`` s pass).
    """

    def __init__(self, peer: Peer, log: Path) -> None:
        port = free_port()
        self.name, self.url, self.log = peer.name, f"http://127.0.0.1:{port}", log
        started = time.monotonic()
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                peer.command(port),
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **peer.env},
            )
        deadline = started + peer.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited at start:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        else:
            self.stop()
            raise SystemExit(f"{self.name} did not start:\n{log.read_text()[-3000:]}")
        self.start_s = time.monotonic() - started
        print(f"{self.name}: up at {self.url} after {self.start_s:.0f} s", flush=True)

    def stop(self) -> None:
        """SIGINT, then SIGKILL after 30 s. Blocks until the process is gone."""
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def bench(
    server: Server, model: str, tokenizer: Path, work: Workload, out: Path, tag: str
) -> dict[int, dict[str, Any]]:
    """The workload against one server: one ``python -m tserve bench`` per level."""
    summaries: dict[int, dict[str, Any]] = {}
    for i, (concurrency, n) in enumerate(work.levels.items()):
        stem = f"{tag}-c{concurrency}"
        command = [
            sys.executable, "-m", "tserve", "bench",
            "--base-url", server.url, "--model", model,
            "--tokenizer", str(tokenizer), "--endpoint", "completions",
            "--dataset-name", "sonnet", "--sonnet-input-len", str(work.input_len),
            "--sonnet-prefix-len", str(work.input_len // 2),
            "--sonnet-output-len", str(work.output_len),
            "--num-prompts", str(n), "--max-concurrency", str(concurrency),
            "--num-warmups", "2" if i == 0 else "0", "--seed", str(concurrency),
            "--duration", str(work.level_duration), "--timeout", str(work.level_duration),
            "--result-dir", str(out), "--result-filename", stem, "--label", server.name,
            "--disable-tqdm",
        ]  # fmt: skip
        print(f"{server.name}: {n} requests, {concurrency} at once", flush=True)
        subprocess.run(command, check=False, stdout=subprocess.DEVNULL)
        doc = json.loads((out / f"{stem}.json").read_text())
        summaries[concurrency] = doc["runs"][0]["summary"]
    return summaries


_SUMMED = frozenset({"requests", "completed", "failed", "input_tokens", "output_tokens"})


def _mean_summary(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One level's summaries over rounds: counts summed, errors merged, the rest averaged."""
    out: dict[str, Any] = {}
    for key, value in rounds[0].items():
        values = [r[key] for r in rounds]
        if key == "errors":
            merged: dict[str, int] = {}
            for errors in values:
                for what, count in errors.items():
                    merged[what] = merged.get(what, 0) + count
            out[key] = merged
        elif isinstance(value, dict):
            out[key] = _mean_summary(values)
        elif key in _SUMMED:
            out[key] = sum(values)
        elif key == "peak_concurrency":
            out[key] = max(values)
        elif any(v is None for v in values):
            out[key] = None
        else:
            out[key] = sum(values) / len(values)
    return out


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.2f}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def table(ours: dict[int, dict[str, Any]], peer: dict[int, dict[str, Any]]) -> str:
    """One Markdown table: absolute values and tserve ÷ peer at each concurrency."""
    head = (
        "| streams | out tok/s tserve / peer | ÷ | TTFT p50 ms | ÷ | TTFT p99 ms | ÷ "
        "| ITL p50 ms | ÷ | ITL p99 ms | ÷ | mean out tok | failed |"
    )
    lines = [head, "|" + "---|" * 14]
    for c in ours:
        o, p = ours[c], peer[c]
        cells = [str(c), f"{o['output_throughput']:.1f} / {p['output_throughput']:.1f}"]
        cells.append(_ratio(o["output_throughput"], p["output_throughput"]))
        for key, q in (("ttft", "median"), ("ttft", "p99"), ("itl", "median"), ("itl", "p99")):
            a, b = o["latency"][key][q], p["latency"][key][q]
            cells += [f"{_ms(a)} / {_ms(b)}", _ratio(a, b)]
        per = [s["output_tokens"] / max(1, s["completed"]) for s in (o, p)]
        cells += [f"{per[0]:.1f} / {per[1]:.1f}", f"{o['failed']} / {p['failed']}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@dataclasses.dataclass
class Rounds:
    """What :func:`run_rounds` measured, by server name (tserve's first)."""

    stamp: str
    out: Path  # where each bench run's own JSON and each server's log went
    work: Workload
    model: str
    runs: dict[str, list[dict[int, dict[str, Any]]]]  # one entry per round
    means: dict[str, dict[int, dict[str, Any]]]  # level -> summary, mean of the rounds
    starts: dict[str, list[float]]  # seconds to /health 200, per round
    probes: dict[str, list[dict[str, Any]]]  # per round: {"started": ..., "after": ...}
    load: list[str]  # 1-minute load average before and after each run
    wall_s: float
    pairs: list[tuple[str, str]]  # (ours, peer): the tables to make

    def tables(self) -> dict[str, str]:
        """Each pair's Markdown table, by "OURS ÷ PEER"."""
        return {f"{a} ÷ {b}": table(self.means[a], self.means[b]) for a, b in self.pairs}


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", name).strip("-")


def run_rounds(
    label: str,
    servers: Sequence[Peer],
    model: str,
    tokenizer: Path,
    work: Workload,
    result_dir: Path = REPO_ROOT / "results",
    pairs: Sequence[tuple[str, str]] | None = None,
) -> Rounds:
    """``work.rounds`` rounds of every server in turn.

    Blocks for the whole run (minutes); each bench run's JSON and each
    server's log go under ``result_dir/LABEL-TIME/``. ``model`` is the name
    the requests ask for, ``tokenizer`` the directory the prompts are made with.
    ``pairs`` (server names, ours first) are the tables to make; by default
    the first server against each other.
    """
    names = [s.name for s in servers]
    if len({_slug(name) for name in names}) != len(names):
        raise ValueError(f"servers need distinct names, not {names}")
    chosen = list(pairs) if pairs is not None else [(names[0], name) for name in names[1:]]
    if any(name not in names for pair in chosen for name in pair):
        raise ValueError(f"pairs {chosen} name a server not in {names}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = result_dir / f"{label}-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[int, dict[str, Any]]]] = {s.name: [] for s in servers}
    starts: dict[str, list[float]] = {s.name: [] for s in servers}
    probes: dict[str, list[dict[str, Any]]] = {s.name: [] for s in servers}
    load: list[str] = []
    t0 = time.monotonic()
    for r in range(work.rounds):
        for peer in servers:
            tag = f"{_slug(peer.name)}-r{r}"
            server = Server(peer, out / f"{tag}.log")
            try:
                before = os.getloadavg()[0]
                started = None if peer.probe is None else peer.probe(server.proc.pid)
                runs[peer.name].append(bench(server, model, tokenizer, work, out, tag))
                if peer.probe is not None:
                    probes[peer.name].append(
                        {"started": started, "after": peer.probe(server.proc.pid)}
                    )
                starts[peer.name].append(server.start_s)
                load.append(f"{tag} {before:.1f}/{os.getloadavg()[0]:.1f}")
            finally:
                server.stop()
    means = {
        name: {c: _mean_summary([r[c] for r in by_round]) for c in work.levels}
        for name, by_round in runs.items()
    }
    wall_s = time.monotonic() - t0
    return Rounds(stamp, out, work, model, runs, means, starts, probes, load, wall_s, chosen)


def write_results(
    label: str,
    rounds: Rounds,
    *,
    notes: Sequence[str] = (),
    extra: dict[str, Any] | None = None,
    result_dir: Path = REPO_ROOT / "results",
) -> Path:
    """Print the tables and write ``result_dir/LABEL-TIME.json``, ``.md`` and ``.png``.

    ``notes`` are Markdown paragraphs after the tables; ``extra`` joins the JSON.
    Returns the JSON's path.
    """
    work = rounds.work
    parts = []
    for name, text in rounds.tables().items():
        parts.append(
            f"{name} ({Path(rounds.model).name}, sonnet {work.input_len} in / "
            f"{work.output_len} out, /v1/completions streamed, mean of {work.rounds} "
            "alternating round(s); throughput ÷ > 1 and latency ÷ < 1 favour tserve):\n\n" + text
        )
    parts.append("1-min load average before/after each run: " + ", ".join(rounds.load))
    parts += notes
    markdown = "\n\n".join(parts) + "\n"
    print("\n" + markdown)
    doc = {
        "date": rounds.stamp,
        "model": rounds.model,
        "workload": dataclasses.asdict(work),
        "startup_s": rounds.starts,
        "probes": {name: found for name, found in rounds.probes.items() if found},
        "load_average": rounds.load,
        "wall_s": rounds.wall_s,
        "rounds": {
            name: [{str(c): s for c, s in r.items()} for r in by_round]
            for name, by_round in rounds.runs.items()
        },
        "tables": rounds.tables(),
        **(extra or {}),
    }
    stem = result_dir / f"{label}-{rounds.stamp}"
    json_path = stem.with_suffix(".json")
    json_path.write_text(json.dumps(doc, indent=1))
    stem.with_suffix(".md").write_text(markdown)
    series = {
        name: [(float(c), Summary.from_json(s)) for c, s in by_level.items()]
        for name, by_level in rounds.means.items()
    }
    png_path = stem.with_suffix(".png")
    title = f"{' vs '.join(rounds.means)}: {Path(rounds.model).name}"
    plot_sweep(series, "concurrent streams", title, png_path)
    print(f"wrote {json_path}, .md and .png (runs in {rounds.out})")
    return json_path


def run_side_by_side(
    label: str,
    ours: Peer,
    peer: Peer,
    model_dir: Path,
    work: Workload,
    result_dir: Path = REPO_ROOT / "results",
    *,
    notes: Sequence[str] = (),
    extra: dict[str, Any] | None = None,
) -> int:
    """Alternate ``work.rounds`` rounds of ours and peer on ``model_dir`` (its path
    the model's name, its tokenizer the prompts'); print and write the table
    (:func:`write_results`, with ``notes`` and ``extra``). Blocks for the whole
    run (minutes)."""
    rounds = run_rounds(label, [ours, peer], str(model_dir), model_dir, work, result_dir)
    write_results(label, rounds, notes=notes, extra=extra, result_dir=result_dir)
    return 0
