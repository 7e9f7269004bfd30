"""The sampler's per-step cost on one core: a step's sampled rows, compiled and numpy.

Run: ``python -m benchmarks.sampling [--repeats 7] [--rows 16]``
(``TSERVE_MAX_ISA=avx2`` caps the compiled pass at AVX2).

For each vocabulary (SmolLM2's 49,152, Gemma 3's 262,144) and logit spread
(standard normal logits times 3: most tokens within reach of the top one, as
Gemma's soft-capped logits are; times 12: a few), ``--rows`` rows go through
``Sampler.sample`` at temperature 1, at top-p 0.95 and at top-k 40, each row
with its own seed: once with the compiled candidate pass and draw
(``_sampling_kernels.c``) and once on numpy alone, as an install without
the kernels runs. Prints the best of ``--repeats`` steps' milliseconds and
the ratio, and writes JSON under ``results/``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from benchmarks._results import kernel_meta, result_stem, write_json
from tserve.gpu.sampling import _candidates
from tserve.gpu.sampling._sampler import Sampler
from tserve.gpu.scheduling._sequence import Sequence
from tserve.protocol import SamplingParams

VOCABS = {"smollm2": 49152, "gemma3": 262144}
SPREADS = {"near": 3.0, "far": 12.0}
FILTERS: dict[str, dict[str, Any]] = {
    "temperature 1": {"temperature": 1.0},
    "top-p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "top-k 40": {"temperature": 0.7, "top_k": 40},
}


def _step_ms(logits: np.ndarray, params: dict[str, Any], repeats: int) -> float:
    seqs = [Sequence(f"r{i}", [1], SamplingParams(seed=i, **params)) for i in range(len(logits))]
    sampler = Sampler()
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms up
        start = time.perf_counter()
        results = sampler.sample(logits, seqs)
        best = min(best, time.perf_counter() - start)
        assert all(r.error is None for r in results), [r.error for r in results]
    return best * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sampling", description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", type=int, default=16)
    args = parser.parse_args()
    compiled = _candidates._candidate_kernel
    if compiled() is None:
        raise SystemExit("the compiled kernels are not built (pip install -e .)")
    rng = np.random.default_rng(0)
    results: dict[str, dict[str, float]] = {}
    for vocab_name, vocab in VOCABS.items():
        for spread_name, spread in SPREADS.items():
            logits = rng.standard_normal((args.rows, vocab), dtype=np.float32) * spread
            for filter_name, params in FILTERS.items():
                fast = _step_ms(logits, params, args.repeats)
                _candidates._candidate_kernel = lambda: None  # type: ignore[assignment]
                try:
                    slow = _step_ms(logits, params, args.repeats)
                finally:
                    _candidates._candidate_kernel = compiled
                name = f"{vocab_name} {spread_name} {filter_name}"
                ratio = slow / fast
                results[name] = {"compiled_ms": fast, "numpy_ms": slow, "ratio": ratio}
                print(f"{name:32s} compiled {fast:7.2f} ms  numpy {slow:7.2f} ms  {ratio:5.2f}x")
    meta = kernel_meta(rows=args.rows, repeats=args.repeats)
    path = write_json(result_stem("sampling"), {"meta": meta, "cases": results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
