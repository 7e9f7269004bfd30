"""What grammar masks cost an engine step: 32 constrained + 32 plain rows vs 64 plain.

Run: ``python -m benchmarks.grammar_masks [--steps 20] [--rows 64]``

One :class:`EngineCore` on the default model (threads 1) decodes ``--rows``
requests at once, twice: all plain, then half of them constrained by a JSON
schema whose string field keeps every constrained row inside its grammar for
the whole run. After the prompts are in, ``--steps`` decode steps are timed by
the CPU time of the whole process (every thread: the masks are computed in
the mask threads, beside the forward pass) and by the wall clock. Reported per
step: the whole step, the sampler, and the step ratios constrained / plain;
then, on the same rows and fixed logits, the constrained rows' masks computed
one after another in this thread (llguidance's ``compute_bitmask``) and the
sampler with and without the masks (``micro_*``, CPU ms per call). Writes JSON
under ``results/``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from benchmarks._results import result_stem, write_json
from tserve.gpu.engine._engine_core import EngineCore
from tserve.protocol import AddRequest, EngineConfig, JsonSchema, SamplingParams

_PEER = b"bench"
SCHEMA = {
    "type": "object",
    "properties": {"note": {"type": "string", "minLength": 2000}, "n": {"type": "integer"}},
    "required": ["note", "n"],
    "additionalProperties": False,
}
T = TypeVar("T")


class _Timer:
    """CPU seconds of the whole process (every thread: llguidance's and torch's
    too) spent in one method of an object."""

    def __init__(self) -> None:
        self.total = 0.0

    def wrap(self, fn: Callable[..., T]) -> Callable[..., T]:
        def timed(*args: Any, **kwargs: Any) -> T:
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.process_time() - start

        return timed


def _run(core: EngineCore, rows: int, constrained: int, steps: int) -> dict[str, float]:
    sampler = _Timer()
    core.sampler.sample = sampler.wrap(core.sampler.sample)  # type: ignore[method-assign]
    tag = f"c{constrained}-"
    for i in range(rows):
        params = SamplingParams(
            max_tokens=steps + 40,
            temperature=0.8,
            seed=i,
            ignore_eos=True,
            constraint=JsonSchema(SCHEMA) if i < constrained else None,
        )
        core.add(AddRequest(f"{tag}{i}", [1, 2 + i % 50, 3, 4 + i], params), _PEER)
    while core.stats().running < rows or any(
        s.num_uncomputed_tokens > 1 for s in core.scheduler.running
    ):
        core.step()  # compiles and prefills
    sampler.total = 0.0
    times, walls = [], []
    for _ in range(steps):
        start, wall = time.process_time(), time.perf_counter()
        core.step()
        times.append(time.process_time() - start)
        walls.append(time.perf_counter() - wall)
    micro = _micro(core, repeats=steps)
    assert core.stats().running == rows, "every row decodes through the timed steps"
    core.abort([f"{tag}{i}" for i in range(rows)])
    core.step()
    return {
        "step_ms_median": 1e3 * statistics.median(times),
        "step_ms_mean": 1e3 * statistics.fmean(times),
        "step_wall_ms_median": 1e3 * statistics.median(walls),
        "sampler_ms_per_step": 1e3 * sampler.total / steps,
        **micro,
    }


def _micro(core: EngineCore, repeats: int) -> dict[str, float]:
    """The mask fill alone, and the sampler with and without the masks, on the
    running rows and fixed random logits: CPU ms per call (all threads)."""
    seqs = core.scheduler.running
    shape = (len(seqs), core.vocab_size)
    logits = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    constraints = core.constraints
    masks: dict[int, Any] = {}
    for i, seq in enumerate(seqs):
        mask = (
            constraints.wait_mask(seq.request_id)
            if constraints.constrained(seq.request_id)
            else None
        )
        if mask is not None and mask.allowed is not None:
            masks[i] = mask.allowed
    matchers = [
        constraints.matcher(s.request_id) for s in seqs if constraints.constrained(s.request_id)
    ]
    out: dict[str, float] = {}
    calls: dict[str, Callable[[], object]] = {
        "micro_mask_fill_ms": lambda: [m.compute_bitmask() for m in matchers],
        "micro_sampler_ms": lambda: core.sampler.sample(logits, seqs),
        "micro_sampler_masked_ms": lambda: core.sampler.sample(logits, seqs, masks),
    }
    for name, call in calls.items():
        start = time.process_time()
        for _ in range(repeats):
            call()
        out[name] = 1e3 * (time.process_time() - start) / repeats
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=64)
    args = parser.parse_args()
    config = EngineConfig(max_num_seqs=args.rows, max_num_batched_tokens=512, threads=1)
    core = EngineCore(config, progress=lambda _: None)
    plain = _run(core, args.rows, 0, args.steps)
    mixed = _run(core, args.rows, args.rows // 2, args.steps)
    result = {
        "benchmark": "grammar_masks",
        "machine": platform.processor() or platform.machine(),
        "model": core.model_name,
        "vocab_size": core.vocab_size,
        "rows": args.rows,
        "constrained_rows": args.rows // 2,
        "steps": args.steps,
        "plain": plain,
        "mixed": mixed,
        "step_ratio_mixed_over_plain": mixed["step_ms_median"] / plain["step_ms_median"],
        "wall_ratio_mixed_over_plain": (
            mixed["step_wall_ms_median"] / plain["step_wall_ms_median"]
        ),
    }
    path = write_json(result_stem("grammar_masks"), result)
    for name in ("plain", "mixed"):
        print(name, {k: round(v, 2) for k, v in result[name].items()})
    cpu, wall = result["step_ratio_mixed_over_plain"], result["wall_ratio_mixed_over_plain"]
    print(f"step ratio mixed/plain: cpu {cpu:.3f}, wall {wall:.3f}  ({path})")


if __name__ == "__main__":
    main()
