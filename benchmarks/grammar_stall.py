"""What a grammar compile costs the engine's step loop, told apart from the machine's load.

Run: ``python -m benchmarks.grammar_stall [--rounds 5] [--tokens 48]`` (Linux)

One :class:`EngineCore` on the default model (threads 1), in this process. Each
round streams one plain request of ``--tokens`` tokens alone, then again while
a request constrained by a new 128-tool schema (``benchmarks.structured``'s)
is added after its 5th token and compiles. Every step of the plain request is
timed, and the step loop's time is split by the kernel's own accounting
(``/proc/self/task/<tid>/schedstat``) into running, waiting for a CPU (the
machine's load) and neither: blocked, which in a step that never sleeps is
waiting for the GIL. A compile that holds the GIL, or a low-priority thread
that holds it while the machine keeps it off the CPU, shows as blocked time;
other work on the machine shows as run-queue time. The ``add`` of the
constrained request (the step loop's own work on it) is timed the same way.

Writes ``results/grammar-stall-<stamp>.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from typing import Any

from benchmarks._results import result_stem, write_json
from benchmarks.structured import tools_schema
from tserve.gpu.engine._engine_core import EngineCore
from tserve.protocol import AddRequest, EngineConfig, JsonSchema, SamplingParams

_PEER = b"bench"


def _schedstat() -> tuple[float, float]:
    """This thread's seconds on a CPU and waiting for one, so far."""
    path = f"/proc/self/task/{threading.get_native_id()}/schedstat"
    with open(path) as f:
        ran, waited, _ = f.read().split()
    return int(ran) / 1e9, int(waited) / 1e9


class _Split:
    """Wall, run, run-queue and blocked seconds of timed calls."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, float, float, float]] = []

    def time(self, fn: Any, *args: Any) -> Any:
        start, (ran, waited) = time.perf_counter(), _schedstat()
        out = fn(*args)
        wall = time.perf_counter() - start
        ran2, waited2 = _schedstat()
        run, queue = ran2 - ran, waited2 - waited
        self.rows.append((wall, run, queue, max(0.0, wall - run - queue)))
        return out

    def summary(self) -> dict[str, Any]:
        walls = [r[0] for r in self.rows]
        blocked = [r[3] for r in self.rows]
        return {
            "calls": len(self.rows),
            "wall_median_ms": statistics.median(walls) * 1e3,
            "wall_p99_ms": _p99(walls) * 1e3,
            "wall_max_ms": max(walls) * 1e3,
            "run_ms": sum(r[1] for r in self.rows) * 1e3,
            "run_queue_ms": sum(r[2] for r in self.rows) * 1e3,
            "blocked_ms": sum(blocked) * 1e3,
            "blocked_max_ms": max(blocked) * 1e3,
        }


def _p99(values: list[float]) -> float:
    if len(values) < 2:
        return max(values)
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def _stream(
    core: EngineCore, request_id: str, tokens: int, side: str | None
) -> tuple[_Split, _Split]:
    """Step a plain request to its end; with ``side`` (a tag for new tool names),
    add a 128-tool request after its 5th token. The plain request's steps and
    that add, timed."""
    steps, adds = _Split(), _Split()
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.8)
    core.add(AddRequest(request_id, [1, 2, 3, 4, 5], params), _PEER)
    produced, done = 0, False
    while not done:
        outputs = steps.time(core.step)
        for _, out in outputs:
            if out.request_id == request_id:
                produced += len(out.token_ids)
                done = out.finish_reason is not None
        if side is not None and produced >= 5:
            constraint = JsonSchema(tools_schema(side))
            constrained = SamplingParams(max_tokens=8, temperature=0.8, constraint=constraint)
            adds.time(core.add, AddRequest(f"{request_id}-side", [1, 2, 3], constrained), _PEER)
            side = None
    while core.has_work:
        core.step()
    return steps, adds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    core = EngineCore(EngineConfig(max_num_seqs=8, threads=1), progress=lambda _: None)
    # The llguidance tokenizer is built, and one compile done, before measuring.
    warm = SamplingParams(max_tokens=2, constraint=JsonSchema(tools_schema("warm")))
    core.add(AddRequest("warm", [1, 2, 3], warm), _PEER)
    while core.has_work:
        core.step()
    alone, beside, adds = _Split(), _Split(), _Split()
    stamp = str(int(time.time()))
    for r in range(args.rounds):
        alone.rows += _stream(core, f"a{r}", args.tokens, None)[0].rows
        steps, added = _stream(core, f"c{r}", args.tokens, f"{stamp}r{r}")
        beside.rows += steps.rows
        adds.rows += added.rows
    core.close()
    result = {
        "rounds": args.rounds,
        "tokens": args.tokens,
        "load_average": os.getloadavg()[0],
        "steps_alone": alone.summary(),
        "steps_beside_compile": beside.summary(),
        "add_of_the_constrained_request": adds.summary(),
    }
    print(write_json(result_stem("grammar-stall"), result))
    for name in ("steps_alone", "steps_beside_compile", "add_of_the_constrained_request"):
        s = result[name]
        print(
            f"{name}: wall median {s['wall_median_ms']:.1f} p99 {s['wall_p99_ms']:.1f} "
            f"max {s['wall_max_ms']:.1f} ms; blocked {s['blocked_ms']:.1f} ms "
            f"(max {s['blocked_max_ms']:.1f}), run queue {s['run_queue_ms']:.0f} ms"
        )


if __name__ == "__main__":
    main()
