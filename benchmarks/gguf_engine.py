"""Prefill and decode tokens per second on a GGUF file: tserve's engine beside llama.cpp's.

Run: ``python -m benchmarks.gguf_engine [--gguf PATH] [--prompt 64] [--gen 32]
[--threads 1] [--repeats 3] [--streams 1] [--llama-bench PATH]
[--sides native,int8,fp32,dequantized] [--versus PATH] [--clock wall|cpu]``

The measurements of ``llama-bench -p P -n G -t T``, on the same file, in
one process per side, alternating sides within each repeat (a shared
machine drifts; alternation shares the drift), the best of ``--repeats``
each:

* prefill: ``--streams`` requests (one by default) of ``--prompt`` random
  tokens each (prefix caching off), added at once: their prompt tokens over
  the time of the engine steps until every one has its first token (one
  step while the prompts fit ``--batch-tokens``);
* decode: the same requests' next ``--gen`` tokens each, from the step after
  the last first token to the end: the tokens of those steps over their time.

Sides (``--sides``): ``native`` and ``native-fp32`` (the file as it is on the
native runner, no torch: ``--gguf-runner native``, ``--gguf-activations int8``
/ ``fp32``), ``int8`` and ``fp32`` (the same on torch's forward pass,
``--gguf-runner torch``),
``dequantized`` (the same file converted once to fp32, ``--dequantize``),
and, with ``--llama-bench``, llama.cpp's ``llama-bench`` (``-r 1 -o json``,
its ``avg_ts``). Prints a table, each side's ratio to llama.cpp and the
weight bytes a decode step reads divided by its time, beside this machine's
one-core read bandwidth (``benchmarks/read_bandwidth.c``, the best of its
measurements between rounds);
writes JSON under ``results/``.

``--versus PATH`` runs every side on a second file too (``SIDE@NAME``), in the
same process and the same rounds, and prints each side's decode bytes per
second on it over the first file's: tokens per second per weight byte (1.0:
the second file's steps read their weights as fast). ``--clock cpu`` times the
steps by this thread's CPU time instead of the wall clock: with ``--threads
1`` every kernel runs on this thread, so what other work on a shared machine
takes does not count.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._bandwidth import read_bandwidth
from benchmarks._results import result_stem, write_json
from tserve.gpu.engine._engine_core import EngineCore
from tserve.gpu.models._directory import default_gguf
from tserve.protocol import AddRequest, EngineConfig, GgufActivations, SamplingParams

_SIDES = ("native", "native-fp32", "int8", "fp32", "dequantized")


def _core(gguf: Path, threads: int, batch_tokens: int, side: str, streams: int) -> EngineCore:
    activations: GgufActivations = "fp32" if side.endswith("fp32") else "int8"
    config = EngineConfig(
        model=str(gguf),
        device="cpu",
        dtype="float32",
        threads=threads,
        max_num_seqs=streams,
        gguf_runner="native" if side.startswith("native") else "torch",
        max_num_batched_tokens=batch_tokens,
        kv_cache_tokens=4096,
        enable_prefix_caching=False,
        dequantize=side == "dequantized",
        gguf_activations=activations,
    )
    return EngineCore(config, progress=lambda line: print(f"  {line}"))


def _measure(
    core: EngineCore,
    prompts: list[list[int]],
    gen: int,
    tag: str,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of ``prompts`` added at once to an idle core."""
    params = SamplingParams(max_tokens=gen + 1, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add(AddRequest(f"{tag}-{i}", prompt, params), b"bench")
    started: set[str] = set()
    tokens = decoded = 0
    start = clock()
    first = end = start
    while core.has_work:
        outputs = core.step()
        now = clock()
        step_tokens = sum(len(out.token_ids) for _, out in outputs)
        tokens += step_tokens
        if len(started) == len(prompts):
            decoded += step_tokens
            end = now
        else:
            started.update(out.request_id for _, out in outputs if out.token_ids)
            first = end = now
    assert tokens == len(prompts) * (gen + 1), f"{tag}: {tokens} tokens"
    return sum(map(len, prompts)) / (first - start), decoded / (end - first)


def _read_bandwidth() -> float:
    """Bytes per second one core reads (``benchmarks/read_bandwidth.c``, the best of 3 passes)."""
    return float(read_bandwidth(mib=256, passes=3)["best_gb_s"]) * 1e9


def _step_bytes(core: EngineCore) -> int:
    """Bytes of weights one decode step reads (each weight once, the embedding's one row aside)."""
    import torch

    from tserve.gpu.forward._native import NativeRunner
    from tserve.gpu.forward._quant import QuantizedLinear
    from tserve.gpu.forward._runner import ModelRunner

    if isinstance(core.runner, NativeRunner):
        return core.runner.model.product_bytes
    assert isinstance(core.runner, ModelRunner)
    total = 0
    for module in core.runner.model.modules():
        if isinstance(module, QuantizedLinear):
            total += module.weight_q.data.numel()
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total


def _llama_bench(
    binary: str, gguf: Path, prompt: int, gen: int, threads: int
) -> tuple[float, float]:
    command = [binary, "-m", str(gguf), "-p", str(prompt), "-n", str(gen)]
    command += ["-t", str(threads), "-r", "1", "-o", "json"]
    result = subprocess.run(command, check=True, capture_output=True, text=True, timeout=600)
    runs = json.loads(result.stdout)
    rates = {("pp" if run["n_prompt"] else "tg"): float(run["avg_ts"]) for run in runs}
    return rates["pp"], rates["tg"]


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gguf_engine", description=__doc__)
    parser.add_argument("--gguf", type=Path, default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--gen", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-tokens", type=int, default=512)
    parser.add_argument("--streams", type=int, default=1, help="requests at once")
    parser.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary")
    parser.add_argument(
        "--sides", default=",".join(_SIDES), help=f"tserve's sides, of {', '.join(_SIDES)}"
    )
    parser.add_argument("--versus", type=Path, default=None, help="a second GGUF, every side")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args()
    sides = [side for side in args.sides.split(",") if side]
    if not sides or any(side not in _SIDES for side in sides):
        parser.error(f"--sides: a comma-separated list of {', '.join(_SIDES)}")

    gguf = (args.gguf or default_gguf()).resolve()
    print(
        f"{gguf.name}, {args.threads} thread(s), {args.streams} stream(s), "
        f"-p {args.prompt} -n {args.gen}"
    )
    cores = {
        side: _core(gguf, args.threads, args.batch_tokens, side, args.streams) for side in sides
    }
    versus = {}
    if args.versus is not None:
        other = args.versus.resolve()
        versus = {f"{side}@{other.stem}": side for side in sides}
        for name, side in versus.items():
            cores[name] = _core(other, args.threads, args.batch_tokens, side, args.streams)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    vocab = min(core.vocab_size for core in cores.values())
    bandwidth = _read_bandwidth()
    rng = random.Random(0)
    best: dict[str, list[float]] = {}
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats + 1):  # the first round warms up
        for side, core in cores.items():
            prompts = [
                [rng.randrange(vocab) for _ in range(args.prompt)] for _ in range(args.streams)
            ]
            rates = _measure(core, prompts, args.gen, f"{side}-{repeat}", clock)
            if repeat:
                runs.append(
                    {"side": side, "repeat": repeat, "prefill": rates[0], "decode": rates[1]}
                )
                old = best.get(side, [0.0, 0.0])
                best[side] = [max(old[0], rates[0]), max(old[1], rates[1])]
        if args.llama_bench and repeat:
            rates = _llama_bench(args.llama_bench, gguf, args.prompt, args.gen, args.threads)
            runs.append(
                {"side": "llama.cpp", "repeat": repeat, "prefill": rates[0], "decode": rates[1]}
            )
            old = best.get("llama.cpp", [0.0, 0.0])
            best["llama.cpp"] = [max(old[0], rates[0]), max(old[1], rates[1])]
        if repeat:
            latest = runs[-len(cores) - bool(args.llama_bench) :]
            latest_rates = ", ".join(f"{r['side']} {r['decode']:.1f}" for r in latest)
            print(f"  round {repeat}: {latest_rates}")
        bandwidth = max(bandwidth, _read_bandwidth())

    step_bytes = {side: _step_bytes(core) for side, core in cores.items()}
    print(f"one-core read bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"{'side':>12} {'prefill tok/s':>14} {'decode tok/s':>13} {'step GB/s':>10}")
    for side, (prefill, decode) in best.items():
        rate = f"{step_bytes[side] * decode / 1e9:>10.2f}" if side in step_bytes else ""
        print(f"{side:>12} {prefill:>14.1f} {decode:>13.1f} {rate}")
    ratios: dict[str, dict[str, float]] = {}
    for side in cores:
        for other in ("int8", "fp32", "dequantized", "llama.cpp"):
            if other in best and other != side:
                ratio = {
                    "prefill": best[side][0] / best[other][0],
                    "decode": best[side][1] / best[other][1],
                }
                ratios[f"{side}/{other}"] = ratio
                print(
                    f"{side} / {other}: prefill {ratio['prefill']:.2f}, "
                    f"decode {ratio['decode']:.2f}"
                )
        fraction = step_bytes[side] * best[side][1] / bandwidth
        print(f"{side}: decode reads weights at {fraction:.2f} x one core's read bandwidth")
    for name, side in versus.items():
        per_byte = step_bytes[name] * best[name][1] / (step_bytes[side] * best[side][1])
        ratios[f"{name}/{side}"] = {"decode_per_weight_byte": per_byte}
        print(f"{name} / {side}: decode tok/s per weight byte {per_byte:.2f}")
    meta = {
        "gguf": str(gguf),
        "versus": str(args.versus) if args.versus else None,
        "clock": args.clock,
        "prompt": args.prompt,
        "gen": args.gen,
        "threads": args.threads,
        "streams": args.streams,
        "repeats": args.repeats,
        "llama_bench": args.llama_bench,
        "machine": platform.processor() or platform.machine(),
        "load_average": os.getloadavg(),
        "read_bandwidth": bandwidth,
        "step_bytes": step_bytes,
    }
    result = {"meta": meta, "best": best, "ratios": ratios, "runs": runs}
    path = write_json(result_stem("gguf_engine"), result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
