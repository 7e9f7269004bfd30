"""The fp32 panel kernel in each variant beside ``F.linear``, over SmolLM2's linear layers.

Run: ``python -m benchmarks.dense_linear [--layers 30] [--rows 1 4 16 64] [--repeats 5]``

One thread, timed by its CPU time (``time.thread_time``: what other work on a
shared machine takes does not count). A pass runs every linear layer of ``--layers`` SmolLM2-135M
layers (Q/K/V 960 x 576, O 576 x 576, gate/up 3072 x 576, down 576 x 1536;
random fp32 weights, 14 MB a layer) once over ``rows`` rows, so that at 30
layers each weight comes from memory as in a decode step. For each row
count the treatments alternate within each of ``--repeats`` rounds (a
shared machine's drift falls on all of them) and the best pass of each
counts: ``blas`` (``F.linear``), ``panels avx2`` (tserve's kernel, AVX2 +
FMA) and, where the CPU has it, ``panels avx512``. Prints each pass's ms
and its ratio to ``blas`` (above 1: the kernel is faster); writes JSON under
``results/``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks._results import result_stem, write_json
from tserve.gpu.kernels._cpu_kernels import cpu_kernels
from tserve.gpu.kernels._quant_abi import Isa

_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
"""SmolLM2-135M's products per layer: (out, in) features."""


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dense_linear", description=__doc__)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    kernels = cpu_kernels()
    if kernels is None or not kernels.linear_available:
        raise SystemExit("the panel kernel does not run here (no build, or no AVX2)")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    weights = [torch.randn(n, k) for _ in range(args.layers) for n, k in _SHAPES]
    packed = [kernels.pack_linear(w) for w in weights]

    def blas(xs: dict[int, torch.Tensor]) -> None:
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    def panels(isa: Isa) -> Callable[[dict[int, torch.Tensor]], None]:
        def run(xs: dict[int, torch.Tensor]) -> None:
            for w, p in zip(weights, packed, strict=True):
                kernels.linear(xs[w.shape[1]], p, None, w.shape[0], isa=isa)

        return run

    treatments: dict[str, Callable[[dict[int, torch.Tensor]], None]] = {"blas": blas}
    isas: tuple[Isa, ...] = (1, 2)
    for isa in isas[: kernels.linear_isa]:
        treatments[("panels avx2", "panels avx512")[isa - 1]] = panels(isa)
    table: dict[int, dict[str, float]] = {}
    with torch.inference_mode():
        for rows in args.rows:
            xs = {k: torch.randn(rows, k) for k in {k for _, k in _SHAPES}}
            best = dict.fromkeys(treatments, float("inf"))
            for _ in range(args.repeats + 1):  # the first round warms up
                for name, run in treatments.items():
                    start = time.thread_time()
                    run(xs)
                    best[name] = min(best[name], time.thread_time() - start)
            table[rows] = best
            cells = (f"{n} {s * 1e3:.1f} ms ({best['blas'] / s:.2f}x)" for n, s in best.items())
            print(f"rows {rows:>3}: " + ", ".join(cells), flush=True)
    meta = {"layers": args.layers, "repeats": args.repeats, "load_average": os.getloadavg()}
    path = write_json(result_stem("dense_linear"), {"meta": meta, "seconds": table})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
