"""tserve side by side with ``transformers serve`` on one model directory and one machine.

    .venv/bin/python benchmarks/compare.py [--model-dir DIR] [--threads 1]

Starts each server in turn on 127.0.0.1 (tserve from this venv; the peer
from ``.venv-peer``, which this script creates on first use with the CPU
torch wheel and ``transformers[serving]``, and runs offline with
``HF_HUB_OFFLINE=1``), sends each the identical workload with
``python -m tserve bench`` (streamed /v1/completions, sonnet prompts, greedy,
1, 16 and 64 concurrent streams), stops it, and prints one table of
tserve ÷ peer ratios for output throughput and median/p99 TTFT and ITL.
Writes ``results/compare-TIME.json`` and ``.png``.

Same work for both: the same prompts, ``max_tokens`` and ``temperature 0``;
no ``ignore_eos`` (``transformers serve`` refuses unknown fields), so a
server may stop early at EOS: the table shows the mean output tokens per
request. Same compute: tserve's ``--threads N`` and the peer's
``OMP_NUM_THREADS=N``, fp32 for both (the directory's dtype). The client
runs on the same 2 cores; it needs a few percent of one core at these rates
(see ``tserve.bench``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tserve.bench._metrics import Summary  # noqa: E402
from tserve.bench._report import plot_sweep  # noqa: E402

PEER = "transformers serve"
LEVELS = {1: 8, 16: 32, 64: 64}  # concurrency -> requests at that level


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_peer_venv(venv: Path) -> Path:
    """The peer's ``transformers`` executable, installing its venv if needed."""
    exe = venv / "bin" / "transformers"
    if exe.exists():
        return exe
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # torch first and alone, pinned to the CPU build (a CUDA torch is gigabytes of no use here)
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    check = "import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)"
    if subprocess.run([str(venv / "bin" / "python"), "-c", check]).returncode != 0:
        raise SystemExit(f"{venv}: pip installed a CUDA torch; install torch==2.13.0+cpu there")
    subprocess.run([*pip, "transformers[serving]"], check=True)
    return exe


class Server:
    """A server child process on a free loopback port, stopped by :meth:`stop`."""

    def __init__(
        self, name: str, command: list[str], port: int, env: dict[str, str], log: Path
    ) -> None:
        self.name, self.url, self.log = name, f"http://127.0.0.1:{port}", log
        started = time.monotonic()
        with log.open("wb") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = started + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{name} exited at start:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        else:
            self.stop()
            raise SystemExit(f"{name} did not start in 300 s:\n{log.read_text()[-3000:]}")
        self.start_s = time.monotonic() - started
        print(f"{name}: up at {self.url} after {self.start_s:.0f} s", flush=True)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def bench(server: Server, args: argparse.Namespace, out: Path) -> dict[int, dict[str, Any]]:
    """The workload against one server: one ``python -m tserve bench`` per concurrency."""
    summaries: dict[int, dict[str, Any]] = {}
    for i, (concurrency, n) in enumerate(LEVELS.items()):
        stem = f"{server.name.split()[0]}-c{concurrency}"
        command = [
            sys.executable, "-m", "tserve", "bench",
            "--base-url", server.url, "--model", args.model_name,
            "--tokenizer", str(args.model_dir), "--endpoint", "completions",
            "--dataset-name", "sonnet", "--sonnet-input-len", str(args.input_len),
            "--sonnet-prefix-len", str(args.input_len // 2),
            "--sonnet-output-len", str(args.output_len),
            "--num-prompts", str(n), "--max-concurrency", str(concurrency),
            "--num-warmups", "2" if i == 0 else "0", "--seed", str(concurrency),
            "--duration", str(args.level_duration), "--timeout", str(args.level_duration),
            "--result-dir", str(out), "--result-filename", stem, "--label", server.name,
            "--disable-tqdm",
        ]  # fmt: skip
        print(f"{server.name}: {n} requests, {concurrency} at once", flush=True)
        subprocess.run(command, check=False, stdout=subprocess.DEVNULL)
        doc = json.loads((out / f"{stem}.json").read_text())
        summaries[concurrency] = doc["runs"][0]["summary"]
    return summaries


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
    for c in LEVELS:
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--threads", type=int, default=1, help="torch threads for each server")
    p.add_argument("--peer-venv", type=Path, default=ROOT / ".venv-peer")
    p.add_argument("--input-len", type=int, default=96, help="sonnet prompt tokens")
    p.add_argument("--output-len", type=int, default=16, help="max_tokens")
    p.add_argument("--level-duration", type=float, default=150.0, help="seconds per level at most")
    p.add_argument("--result-dir", type=Path, default=ROOT / "results")
    args = p.parse_args()
    if args.model_dir is None:
        from tserve.gpu._models import default_model_dir

        args.model_dir = default_model_dir()
    args.model_dir = args.model_dir.resolve()
    args.model_name = str(args.model_dir)  # the peer names a model by its path
    peer_exe = ensure_peer_venv(args.peer_venv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.result_dir / f"compare-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    tserve_cmd = [
        sys.executable, "-m", "tserve", "serve", args.model_name,
        "--served-model-name", args.model_name, "--threads", str(args.threads),
    ]  # fmt: skip
    peer_cmd = [str(peer_exe), "serve", args.model_name, "--device", "cpu", "--continuous-batching"]
    peer_env = {**env, "OMP_NUM_THREADS": str(args.threads)}
    results: dict[str, dict[int, dict[str, Any]]] = {}
    starts: dict[str, float] = {}
    load: dict[str, list[float]] = {}  # 1-minute load average before and after each server
    t0 = time.monotonic()
    for name, command, extra in (
        ("tserve", tserve_cmd, env),
        (PEER, peer_cmd, peer_env),
    ):
        port = _free_port()
        server = Server(name, [*command, "--port", str(port)], port, extra, out / f"{name}.log")
        try:
            before = os.getloadavg()[0]
            results[name] = bench(server, args, out)
            starts[name] = server.start_s
            load[name] = [before, os.getloadavg()[0]]
        finally:
            server.stop()
    ours, peer = results["tserve"], results[PEER]
    text = table(ours, peer)
    print(f"\ntserve ÷ {PEER} ({args.model_dir.name}, {args.threads} torch thread(s), "
          f"sonnet {args.input_len} in / {args.output_len} out, /v1/completions streamed; "
          f"throughput ÷ > 1 and latency ÷ < 1 favour tserve):\n")  # fmt: skip
    print(text)
    print("\n1-min load average before/after each server (2 cores): " + ", ".join(
        f"{k} {a:.1f}/{b:.1f}" for k, (a, b) in load.items()))  # fmt: skip
    doc = {
        "date": stamp,
        "model_dir": str(args.model_dir),
        "threads": args.threads,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "levels": LEVELS,
        "startup_s": starts,
        "load_average": load,
        "wall_s": time.monotonic() - t0,
        "summaries": {k: {str(c): s for c, s in v.items()} for k, v in results.items()},
        "table": text,
    }
    json_path = args.result_dir / f"compare-{stamp}.json"
    json_path.write_text(json.dumps(doc, indent=1))
    series = {
        name: [(float(c), Summary.from_json(s)) for c, s in by_level.items()]
        for name, by_level in results.items()
    }
    png_path = args.result_dir / f"compare-{stamp}.png"
    plot_sweep(series, "concurrent streams", f"tserve vs {PEER}: {args.model_dir.name}", png_path)
    print(f"\nwrote {json_path} and {png_path} (runs in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
