"""Every quantized format's product speed beside the Q4_1 kernel's, on the same weight shape.

Run: ``python -m benchmarks.kquant_kernels [--n 1536] [--k 1536] [--formats ...] [--rows 1 4 16 64]
[--repeats 9]``

One thread, timed by its CPU time (``time.thread_time``: what other work on a
shared machine takes does not count). For each row count, one product per format and activation
treatment (fp32; ``int8``, 8 bits per block of 32, the K-quants per super-block
of 256) in turn, ``--repeats``
rounds (alternating within a round, so a shared machine's drift falls on all
of them), the best time of each; prints each one's time, the weight bytes it
read per second (GB/s) and its ratio to Q4_1's time with the same
activations (below 1: faster), writes JSON under ``results/``. The
instructions are the CPU's best (``TSERVE_MAX_ISA=avx2`` caps them at AVX2).
Weights: the 32-weight block formats from ``gguf``'s quantizers, K-quants
random super-blocks in ggml's layout (``tests/gpu/kquant_blocks.py``).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from benchmarks._results import result_stem, write_json
from tests.gpu import kquant_blocks
from tserve.gpu.forward._quant import FORMATS, QuantizedLinear, QuantizedWeight, quant_kernels

_MODES = ("fp32", "int8")
_BLOCK_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def _weights(n: int, k: int, formats: list[str]) -> dict[str, QuantizedWeight]:
    import gguf

    rng = np.random.default_rng(0)
    values = rng.standard_normal((n, k), dtype=np.float32)
    weights = {}
    for fmt in (f for f in _BLOCK_FORMATS if f in formats):
        data = gguf.quants.quantize(values, gguf.GGMLQuantizationType[fmt])
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(n, -1)
        weights[fmt] = QuantizedWeight(FORMATS[fmt], torch.from_numpy(raw), n, k)
    for fmt in (f for f in kquant_blocks.FORMATS if f in formats):
        raw = kquant_blocks.random_rows(fmt, n, k, rng)
        weights[fmt] = QuantizedWeight(FORMATS[fmt], torch.from_numpy(raw), n, k)
    return weights


def _bytes(weights: dict[str, QuantizedWeight], name: str) -> int:
    """The weight bytes a product named ``name`` ("FMT mode") reads."""
    return weights[name.split()[0]].data.numel()


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.kquant_kernels", description=__doc__
    )
    parser.add_argument("--n", type=int, default=1536, help="output features")
    parser.add_argument(
        "--k", type=int, default=1536, help="input features (a multiple of 256; 32: block formats)"
    )
    every = [*_BLOCK_FORMATS, *kquant_blocks.FORMATS]
    parser.add_argument(
        "--formats", nargs="+", choices=every, default=every, help="Q4_1 (the base) always runs"
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    kernels = quant_kernels()
    if kernels is None:
        raise SystemExit("the compiled kernels are not built (pip install -e .)")
    torch.set_num_threads(1)
    weights = _weights(args.n, args.k, ["Q4_1", *args.formats])
    # each treatment as the engine runs it (int8: on the packed weight)
    layers = {
        (fmt, mode): QuantizedLinear(weight, kernels, mode)  # type: ignore[arg-type]
        for fmt, weight in weights.items()
        for mode in _MODES
    }
    table: dict[int, dict[str, float]] = {}
    for rows in args.rows:
        x = torch.randn(rows, args.k)
        best = {f"{fmt} {mode}": float("inf") for mode in _MODES for fmt in weights}
        for _ in range(args.repeats + 1):  # the first round warms up
            for mode in _MODES:
                for fmt in weights:
                    start = time.thread_time()
                    layers[fmt, mode](x)
                    seconds = time.thread_time() - start
                    best[f"{fmt} {mode}"] = min(best[f"{fmt} {mode}"], seconds)
        table[rows] = best
        for mode in _MODES:
            base = best[f"Q4_1 {mode}"]
            cells = (
                f"{name.split()[0]} {s * 1e3:.3f} ms {_bytes(weights, name) / s / 1e9:.1f} GB/s "
                f"({s / base:.2f})"
                for name, s in best.items()
                if name.endswith(mode)
            )
            print(f"rows {rows:>3} {mode}: " + ", ".join(cells))
    meta = {"n": args.n, "k": args.k, "repeats": args.repeats, "load_average": os.getloadavg()}
    meta["isa"] = kernels.best_isa
    path = write_json(result_stem("kquant_kernels"), {"meta": meta, "seconds": table})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
