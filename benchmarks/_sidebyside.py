"""tserve and a peer server side by side: one machine, one model directory, one workload.

Each server runs in turn on a free loopback port; ``python -m tserve bench``
sends it the identical streamed workload at each concurrency level; the
rounds alternate (tserve, peer, tserve, peer, ...), so that a slow phase of a
shared machine hits both. The result is a table of tserve ÷ peer ratios
(output throughput, TTFT and ITL median and p99) from the mean of each
server's rounds, a JSON document and a PNG plot.
"""

from __future__ import annotations

import dataclasses
import json
import os
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

__all__ = ["Peer", "Workload", "run_side_by_side"]


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
    """A server to compare: ``command(port)`` starts it (serving ``model_dir`` under
    its path as the model name) with ``env`` added to this process's."""

    name: str
    command: Callable[[int], list[str]]
    env: dict[str, str]
    start_timeout: float = 300.0


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
    server: Server, model_dir: Path, work: Workload, out: Path, tag: str
) -> dict[int, dict[str, Any]]:
    """The workload against one server: one ``python -m tserve bench`` per level."""
    summaries: dict[int, dict[str, Any]] = {}
    for i, (concurrency, n) in enumerate(work.levels.items()):
        stem = f"{tag}-c{concurrency}"
        command = [
            sys.executable, "-m", "tserve", "bench",
            "--base-url", server.url, "--model", str(model_dir),
            "--tokenizer", str(model_dir), "--endpoint", "completions",
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


def run_side_by_side(
    label: str,
    ours: Peer,
    peer: Peer,
    model_dir: Path,
    work: Workload,
    result_dir: Path = REPO_ROOT / "results",
) -> int:
    """Alternate ``work.rounds`` rounds of ours and peer; print and write the table.

    Blocks for the whole run (minutes). Writes ``result_dir/LABEL-TIME.json``
    and ``.png``, and each bench run's own JSON under ``result_dir/LABEL-TIME/``.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = result_dir / f"{label}-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    rounds: dict[str, list[dict[int, dict[str, Any]]]] = {ours.name: [], peer.name: []}
    starts: dict[str, list[float]] = {ours.name: [], peer.name: []}
    load: list[str] = []  # 1-minute load average before and after each run
    t0 = time.monotonic()
    for r in range(work.rounds):
        for server_peer in (ours, peer):
            tag = f"{server_peer.name.split()[0]}-r{r}"
            server = Server(server_peer, out / f"{tag}.log")
            try:
                before = os.getloadavg()[0]
                rounds[server_peer.name].append(bench(server, model_dir, work, out, tag))
                starts[server_peer.name].append(server.start_s)
                load.append(f"{tag} {before:.1f}/{os.getloadavg()[0]:.1f}")
            finally:
                server.stop()
    means = {
        name: {c: _mean_summary([r[c] for r in runs]) for c in work.levels}
        for name, runs in rounds.items()
    }
    text = table(means[ours.name], means[peer.name])
    print(
        f"\ntserve ÷ {peer.name} ({model_dir.name}, sonnet {work.input_len} in / "
        f"{work.output_len} out, /v1/completions streamed, mean of {work.rounds} alternating "
        "round(s); throughput ÷ > 1 and latency ÷ < 1 favour tserve):\n"
    )
    print(text)
    print("\n1-min load average before/after each run (2 cores): " + ", ".join(load))
    doc = {
        "date": stamp,
        "model_dir": str(model_dir),
        "workload": dataclasses.asdict(work),
        "startup_s": starts,
        "load_average": load,
        "wall_s": time.monotonic() - t0,
        "rounds": {k: [{str(c): s for c, s in r.items()} for r in v] for k, v in rounds.items()},
        "table": text,
    }
    json_path = result_dir / f"{label}-{stamp}.json"
    json_path.write_text(json.dumps(doc, indent=1))
    series = {
        name: [(float(c), Summary.from_json(s)) for c, s in by_level.items()]
        for name, by_level in means.items()
    }
    png_path = result_dir / f"{label}-{stamp}.png"
    plot_sweep(series, "concurrent streams", f"tserve vs {peer.name}: {model_dir.name}", png_path)
    print(f"\nwrote {json_path} and {png_path} (runs in {out})")
    return 0
