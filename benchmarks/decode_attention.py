"""Decode attention (``tserve_paged_decode``) on one core at the served models' shapes.

Run: ``python -m benchmarks.decode_attention [--repeats 30] [--cold]``
(``TSERVE_MAX_ISA=avx2`` caps the instructions at AVX2).

Each case is one layer's call for a batch of decoding sequences over a paged
pool whose blocks are shuffled, as a long-running engine's are: SmolLM2's 9
query heads on 3 KV heads of 64 dims and Gemma 3's 4 on 1 of 256, at 64
sequences of 64 to 96 keys (``benchmarks/vs_llamacpp.py``'s 64 streams), 16
of 500 to 700 keys, 4 of about 2,000 keys in Gemma's 512-key window, and
Gemma's one stream at 600 to 700 keys. ``--cold`` reads 256 MiB between
calls, untimed, so that each call finds its K/V in memory rather than in the
caches, as in a decode step, whose weights have just streamed through them
(on a 2-core Zen 4, fp32: 4 to 5 times the warm call's time). For
each KV dtype it prints the best of ``--repeats`` calls' thread CPU time, the
time per (query head, key) pair and the K/V bytes read per second, and writes
JSON under ``results/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from benchmarks._results import kernel_meta, result_stem, write_json
from tserve.gpu.kernels._cpu_kernels import cpu_kernels


@dataclasses.dataclass(frozen=True)
class Case:
    heads: int
    kv_heads: int
    head_dim: int
    batch: int
    shortest: int
    longest: int
    window: int = 0
    block_size: int = 16


CASES = {
    "smollm2 64 x 64-96": Case(9, 3, 64, 64, 64, 96),
    "gemma3 64 x 64-96": Case(4, 1, 256, 64, 64, 96),
    "smollm2 16 x 500-700": Case(9, 3, 64, 16, 500, 700),
    "gemma3 4 x 1900-2100, window 512": Case(4, 1, 256, 4, 1900, 2100, window=512),
    "gemma3 1 x 600-700": Case(4, 1, 256, 1, 600, 700),
}
EVICT_BYTES = 256 << 20
"""What ``--cold`` reads between calls: more than this machine's caches hold."""
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _time(
    case: Case, dtype: torch.dtype, repeats: int, evict: torch.Tensor | None
) -> dict[str, float]:
    kernels = cpu_kernels()
    assert kernels is not None
    generator = torch.Generator().manual_seed(0)
    width = -(-case.longest // case.block_size)
    blocks = case.batch * width + 5
    order = torch.randperm(blocks, generator=generator)
    tables = order[: case.batch * width].reshape(case.batch, width).to(torch.int64)
    shape = (case.kv_heads, blocks * case.block_size, case.head_dim)
    k_pool = torch.randn(shape, generator=generator).to(dtype)
    v_pool = torch.randn(shape, generator=generator).to(dtype)
    lens = torch.randint(case.shortest, case.longest + 1, (case.batch,), generator=generator)
    q = torch.randn(case.batch, case.heads * case.head_dim, generator=generator)
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms up
        if evict is not None:
            evict.sum()  # untimed: the call then reads its K/V from memory, as in a step
        start = time.thread_time()
        kernels.paged_decode(
            q, case.heads, k_pool, v_pool, tables, lens, case.longest, case.block_size,
            case.head_dim**-0.5, case.window,
        )  # fmt: skip
        best = min(best, time.thread_time() - start)
    keys = lens.clamp(max=case.window) if case.window else lens
    pairs = int(keys.sum()) * case.heads
    kv_bytes = 2 * int(keys.sum()) * case.kv_heads * case.head_dim * k_pool.element_size()
    return {"seconds": best, "ns_per_pair": best * 1e9 / pairs, "gb_per_s": kv_bytes / best / 1e9}


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.decode_attention", description=__doc__
    )
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument(
        "--cold",
        action="store_true",
        help="read 256 MiB between calls (a decode step's weights evict its K/V from cache)",
    )
    args = parser.parse_args()
    evict = torch.ones(EVICT_BYTES // 4) if args.cold else None
    if cpu_kernels() is None:
        raise SystemExit("the compiled kernels are not built (pip install -e .)")
    results: dict[str, dict[str, dict[str, float]]] = {}
    for name, case in CASES.items():
        results[name] = {}
        for label, dtype in DTYPES.items():
            r = _time(case, dtype, args.repeats, evict)
            results[name][label] = r
            print(
                f"{name:34s} {label}: {r['seconds'] * 1e3:7.3f} ms "
                f"{r['ns_per_pair']:6.2f} ns/pair {r['gb_per_s']:5.1f} GB/s of K/V"
            )
    meta = kernel_meta(repeats=args.repeats, cold=args.cold)
    path = write_json(result_stem("decode_attention"), {"meta": meta, "cases": results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
