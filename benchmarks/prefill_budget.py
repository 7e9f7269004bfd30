"""Inter-token latency and throughput of the engine under a sonnet-like load, in CPU time.

Run: ``python -m benchmarks.prefill_budget [--concurrency 16 64] [--setups old new]``

The engine's share of what ``python -m tserve bench --dataset-name sonnet``
measures, without HTTP, and on a clock that a shared machine does not bend:
each step is timed by the CPU time of the engine's thread (torch runs on it
with one thread), and every request's tokens are stamped with the sum of the
step times so far. ITL is the gap between consecutive tokens of one request on
that clock, TTFT the gap from its arrival to its first token, and output
throughput the tokens over the CPU seconds of all steps. Wall-clock figures
are reported next to them.

Workload, as the serving benchmark's sonnet dataset: every prompt is a shared
instruction plus the first sonnet lines (about ``--prefix-len`` tokens, the
same for all) and lines drawn at random up to about ``--input-len`` tokens;
each request generates ``--output-len`` tokens (``ignore_eos``, greedy).
``--num-prompts`` requests, at most ``--concurrency`` in flight (one joins as
one ends). Setups (each an :class:`EngineConfig` over the default model,
threads 1, the same ``--cpu-gemm`` for all):

* ``old``: no prefix cache, no prefill bound (``max_decode_slowdown=0``):
  the engine before either;
* ``bound``: no prefix cache, the prefill bound (the default 2.5);
* ``new``: the defaults (prefix cache and prefill bound).

Setups run in the order given, alternating per ``--rounds``. Writes JSON
under ``results/``.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._results import result_stem, write_json
from tserve.gpu.engine._engine_core import EngineCore
from tserve.gpu.gguf._convert import default_model_dir
from tserve.protocol import AddRequest, EngineConfig, SamplingParams

_PEER = b"bench"
_SONNETS = Path(__file__).with_name("sonnet.txt")
SETUPS: dict[str, dict[str, Any]] = {
    "old": {"enable_prefix_caching": False, "max_decode_slowdown": 0.0},
    "bound": {"enable_prefix_caching": False},
    "new": {},
}


def sonnet_prompts(tokenizer: Any, args: argparse.Namespace) -> list[list[int]]:
    lines = [line for line in _SONNETS.read_text().splitlines() if line.strip()]
    ids = [tokenizer(line + "\n", add_special_tokens=False)["input_ids"] for line in lines]
    head = tokenizer("Pick as many lines as you can from these poem lines:\n")["input_ids"]
    prefix = list(head)
    for line in ids:
        if len(prefix) >= args.prefix_len:
            break
        prefix += line
    rng = random.Random(args.seed)
    prompts = []
    for _ in range(args.num_prompts):
        prompt = list(prefix)
        while len(prompt) < args.input_len:
            prompt += rng.choice(ids)
        prompts.append(prompt[: args.input_len])
    return prompts


def run(
    core: EngineCore, prompts: list[list[int]], output_len: int, concurrency: int
) -> dict[str, Any]:
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    queue = list(reversed(range(len(prompts))))
    arrived: dict[str, float] = {}
    stamps: dict[str, list[float]] = {}
    cpu_clock = wall_clock = 0.0
    in_flight = 0
    steps = 0
    while queue or in_flight:
        while queue and in_flight < concurrency:
            i = queue.pop()
            core.add(AddRequest(f"q{i}", prompts[i], params), _PEER)
            arrived[f"q{i}"] = cpu_clock
            stamps[f"q{i}"] = []
            in_flight += 1
        cpu, wall = time.thread_time(), time.perf_counter()
        outputs = core.step()
        cpu_clock += time.thread_time() - cpu
        wall_clock += time.perf_counter() - wall
        steps += 1
        for _, out in outputs:
            stamps[out.request_id] += [cpu_clock] * len(out.token_ids)
            in_flight -= out.finish_reason is not None
    itl = [b - a for times in stamps.values() for a, b in itertools.pairwise(times)]
    ttft = [times[0] - arrived[rid] for rid, times in stamps.items()]
    tokens = sum(len(times) for times in stamps.values())
    q = statistics.quantiles(itl, n=100)
    return {
        "steps": steps,
        "tokens": tokens,
        "cpu_s": cpu_clock,
        "wall_s": wall_clock,
        "tok_per_cpu_s": tokens / cpu_clock,
        "tok_per_wall_s": tokens / wall_clock,
        "itl_p50_ms": statistics.median(itl) * 1000,
        "itl_p99_ms": q[98] * 1000,
        "itl_p99_over_p50": q[98] / statistics.median(itl),
        "ttft_p50_ms": statistics.median(ttft) * 1000,
        "ttft_p99_ms": statistics.quantiles(ttft, n=100)[98] * 1000,
        "prefix_hit_tokens": core.stats().prefix_cache_hits,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.prefill_budget", description=__doc__
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--setups", nargs="+", choices=list(SETUPS), default=["old", "new"])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=550)
    parser.add_argument("--output-len", type=int, default=150)
    parser.add_argument("--prefix-len", type=int, default=200)
    parser.add_argument("--cpu-gemm", default="onednn", choices=("auto", "blas", "onednn"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    model_dir = default_model_dir(progress=print)
    prompts = sonnet_prompts(AutoTokenizer.from_pretrained(model_dir), args)
    rows: list[dict[str, Any]] = []
    print(
        f"{'setup':>6} {'conc':>5} {'tok/cpu-s':>10} {'tok/s':>7} {'ITL p50':>8} {'ITL p99':>8} "
        f"{'p99/p50':>7} {'TTFT p50':>9}  (CPU-time ms)",
        flush=True,
    )
    for rnd in range(args.rounds):
        for concurrency in args.concurrency:
            for name in args.setups:
                config = EngineConfig(
                    model=str(model_dir),
                    device="cpu",
                    dtype="float32",
                    threads=1,
                    cpu_gemm=args.cpu_gemm,
                    **SETUPS[name],
                )
                core = EngineCore(config, progress=lambda _: None)
                run(core, [list(range(100, 400))] * 2, 4, 2)  # warm-up, shares no prefix
                row = {"round": rnd, "setup": name, "concurrency": concurrency}
                row |= run(core, prompts, args.output_len, concurrency)
                rows.append(row)
                print(
                    f"{name:>6} {concurrency:>5} {row['tok_per_cpu_s']:>10.1f} "
                    f"{row['tok_per_wall_s']:>7.1f} {row['itl_p50_ms']:>8.1f} "
                    f"{row['itl_p99_ms']:>8.1f} {row['itl_p99_over_p50']:>7.2f} "
                    f"{row['ttft_p50_ms']:>9.0f}",
                    flush=True,
                )
    meta = {key: value for key, value in vars(args).items()}
    meta |= {
        "model": model_dir.name,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    print(f"wrote {write_json(result_stem('prefill-budget'), {'meta': meta, 'rows': rows})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
