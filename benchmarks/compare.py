"""tserve side by side with ``transformers serve`` on one model directory and one machine.

    .venv/bin/python benchmarks/compare.py [--model-dir DIR] [--threads 1]

Starts each server in turn on 127.0.0.1 (tserve from this venv; the peer
from ``.venv-peer``, which this script creates on first use with the CPU
torch wheel and ``transformers[serving]``, and runs offline with
``HF_HUB_OFFLINE=1``), sends each the identical workload with
``python -m tserve bench`` (streamed /v1/completions, sonnet prompts, greedy,
1, 16 and 64 concurrent streams), stops it, and prints one table of
tserve ÷ peer ratios for output throughput and median/p99 TTFT and ITL.
Writes ``results/compare-TIME.json``, ``.md`` and ``.png`` (``benchmarks/_sidebyside.py``).

Same work for both: the same prompts, ``max_tokens`` and ``temperature 0``;
no ``ignore_eos`` (``transformers serve`` refuses unknown fields), so a
server may stop early at EOS: the table shows the mean output tokens per
request. Same compute: tserve's ``--threads N`` and the peer's
``OMP_NUM_THREADS=N``, fp32 for both (the directory's dtype).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._sidebyside import Peer, Workload, run_side_by_side  # noqa: E402

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


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


def tserve_peer(model_dir: Path, *extra: str) -> Peer:
    """tserve from this venv, serving ``model_dir`` under its path as the model name."""

    def command(port: int) -> list[str]:
        return [
            sys.executable, "-m", "tserve", "serve", str(model_dir),
            "--served-model-name", str(model_dir), "--port", str(port), *extra,
        ]  # fmt: skip

    return Peer("tserve", command, OFFLINE)


def default_model_dir() -> Path:
    from tserve.gpu.gguf._convert import default_model_dir

    return default_model_dir()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--threads", type=int, default=1, help="torch threads for each server")
    p.add_argument("--peer-venv", type=Path, default=ROOT / ".venv-peer")
    p.add_argument("--input-len", type=int, default=96, help="sonnet prompt tokens")
    p.add_argument("--output-len", type=int, default=16, help="max_tokens")
    p.add_argument("--level-duration", type=float, default=150.0, help="seconds per level at most")
    args = p.parse_args()
    model_dir = (args.model_dir or default_model_dir()).resolve()
    peer_exe = ensure_peer_venv(args.peer_venv)
    threads = str(args.threads)

    def command(port: int) -> list[str]:
        return [
            str(peer_exe), "serve", str(model_dir), "--device", "cpu",
            "--continuous-batching", "--port", str(port),
        ]  # fmt: skip

    peer = Peer("transformers serve", command, {**OFFLINE, "OMP_NUM_THREADS": threads})
    work = Workload({1: 8, 16: 32, 64: 64}, args.input_len, args.output_len, args.level_duration)
    return run_side_by_side(
        "compare", tserve_peer(model_dir, "--threads", threads), peer, model_dir, work
    )


if __name__ == "__main__":
    sys.exit(main())
