"""Decode at a long context with each KV cache dtype: inter-token latency and KV memory.

Run: ``python -m benchmarks.kv_dtype [--gguf PATH] [--context 1500]
[--streams 1 16] [--steps 4] [--rounds 3] [--dtypes fp32 fp16 bf16]
[--check-tokens 16] [--threads 1]``

One model runner per ``--kv-cache-dtype`` on the bundled SmolLM2 GGUF as it
is (quantized weights, tserve's kernels). A decode step of S streams at a
context of C tokens reads the weights once and each stream's C keys and
values; the step time is the inter-token latency (ITL). To measure it
without prefilling S x C tokens per dtype, each stream's C positions sit in
blocks of its own filled with random K/V (the values do not change the
work). In each round every runner in turn (the order rotating from round to
round, so that a shared machine's drift falls on all alike) runs
``--steps`` decode steps of every stream count. Reports the median ITL of
each, its ratio to fp32's, and the KV bytes a token and the streams hold.

``--check-tokens N``: one real prompt of ``--context`` random tokens,
prefilled and decoded greedily for N tokens by each runner; says whether
each dtype's tokens equal fp32's. Writes JSON under ``results/``.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._results import result_stem, write_json
from tserve.gpu.forward._gguf import load_gguf
from tserve.gpu.forward._quant import quant_kernels
from tserve.gpu.forward._runner import KV_CACHE_DTYPES, ModelRunner
from tserve.gpu.models._directory import default_cache_root, default_gguf
from tserve.gpu.scheduling._sequence import ScheduledChunk, Sequence
from tserve.protocol import SamplingParams

BLOCK = 16


def _runner(gguf: Path, kv: str, num_blocks: int) -> ModelRunner:
    cache = default_cache_root()
    loaded = load_gguf(gguf, kernels=quant_kernels(), cache_dir=cache, progress=print)
    runner = ModelRunner(
        loaded.model, num_blocks=num_blocks, block_size=BLOCK, kv_dtype=KV_CACHE_DTYPES[kv]
    )
    with torch.inference_mode():
        gen = torch.Generator().manual_seed(0)
        for pool in (runner.pool.k, runner.pool.v):
            pool.copy_(torch.randn(pool.shape, generator=gen))
    return runner


def _decode_steps(
    runner: ModelRunner, streams: int, context: int, steps: int, rng: random.Random
) -> list[float]:
    """Times of ``steps`` decode steps of ``streams`` sequences at ``context`` keys."""
    per_seq = -(-(context + steps) // BLOCK)
    seqs = []
    for i in range(streams):
        seq = Sequence(f"s{i}", [0] * context, SamplingParams())
        seq.block_table = list(range(i * per_seq, (i + 1) * per_seq))
        seqs.append(seq)
    times = []
    for step in range(steps):
        chunks = [
            ScheduledChunk(s, context + step, [rng.randrange(runner.vocab_size)], True)
            for s in seqs
        ]
        began = time.perf_counter()
        runner.execute(chunks)
        times.append(time.perf_counter() - began)
    return times


def _greedy(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt``, prefilled in chunks of 512 (blocks from 0)."""
    seq = Sequence("check", prompt, SamplingParams())
    seq.block_table = list(range(-(-(len(prompt) + n) // BLOCK)))
    for start in range(0, len(prompt), 512):
        last = runner.execute([ScheduledChunk(seq, start, prompt[start : start + 512], True)])
    tokens = [int(last[-1].argmax())]
    for i in range(n - 1):
        last = runner.execute([ScheduledChunk(seq, len(prompt) + i, tokens[-1:], True)])
        tokens.append(int(last[-1].argmax()))
    return tokens


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kv_dtype", description=__doc__)
    parser.add_argument("--gguf", type=Path, default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "fp16", "bf16"])
    parser.add_argument("--check-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.dtypes[0] != "fp32":
        parser.error("--dtypes starts with fp32, the reference")
    torch.set_num_threads(args.threads)

    gguf = (args.gguf or default_gguf()).resolve()
    print(f"{gguf.name} as it is, {args.threads} thread(s), context {args.context}")
    num_blocks = max(args.streams) * -(-(args.context + args.steps) // BLOCK)
    runners = {kv: _runner(gguf, kv, num_blocks) for kv in args.dtypes}
    first = runners[args.dtypes[0]]
    layers, kv_heads, _, head_dim = first.pool.k.shape
    token_bytes = {
        kv: 2 * layers * kv_heads * head_dim * r.pool.k.element_size() for kv, r in runners.items()
    }

    itl: dict[str, list[float]] = {f"{s}/{kv}": [] for s in args.streams for kv in args.dtypes}
    rng = random.Random(0)
    for round_ in range(args.rounds + 1):  # round 0 warms up
        shift = round_ % len(args.dtypes)
        for kv in args.dtypes[shift:] + args.dtypes[:shift]:
            for streams in args.streams:
                times = _decode_steps(runners[kv], streams, args.context, args.steps, rng)
                if round_:
                    itl[f"{streams}/{kv}"] += [t * 1e3 for t in times]
        print(f"  round {round_} done")

    summary: dict[str, Any] = {}
    print(f"{'streams':>7} {'kv dtype':>8} {'ITL p50 ms':>10} {'÷ fp32':>7} {'KV MiB':>7}")
    for streams in args.streams:
        reference = statistics.median(itl[f"{streams}/fp32"])
        for kv in args.dtypes:
            p50 = statistics.median(itl[f"{streams}/{kv}"])
            mib = streams * args.context * token_bytes[kv] / 2**20
            summary[f"{streams}/{kv}"] = {
                "itl_p50_ms": p50,
                "itl_vs_fp32": p50 / reference,
                "kv_mib": mib,
                "kv_bytes_per_token": token_bytes[kv],
            }
            print(f"{streams:>7} {kv:>8} {p50:>10.1f} {p50 / reference:>7.2f} {mib:>7.0f}")

    checks: dict[str, bool] = {}
    if args.check_tokens:
        vocab = first.vocab_size
        prompt = [random.Random(1).randrange(vocab) for _ in range(args.context)]
        expected = _greedy(first, prompt, args.check_tokens)
        for kv, runner in runners.items():
            checks[kv] = _greedy(runner, prompt, args.check_tokens) == expected
            print(f"  {kv}: {args.check_tokens} greedy tokens equal fp32's: {checks[kv]}")
    meta = {
        "gguf": str(gguf),
        "context": args.context,
        "steps": args.steps,
        "rounds": args.rounds,
        "threads": args.threads,
        "machine": platform.processor() or platform.machine(),
        "load_average": os.getloadavg(),
    }
    result = {"meta": meta, "summary": summary, "itl_ms": itl, "tokens_equal_fp32": checks}
    print(f"wrote {write_json(result_stem('kv_dtype'), result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
