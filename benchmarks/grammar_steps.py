"""What side requests, with and without grammars, cost a plain stream's steps, in CPU time.

Run: ``python -m benchmarks.grammar_steps [--rounds 3] [--tokens 48]`` (Linux)

One :class:`EngineCore` on the default model (threads 1), in this process.
Each round streams one plain request of ``--tokens`` tokens in five ways:
alone; beside one side request added after its 5th token, plain, then
constrained by a new 128-tool schema (``benchmarks.structured``'s, part
(b)); beside eight side requests at once, plain, then each constrained by a
new 128-tool schema (part (c)'s compiles). A side prompt is 16 tokens every
side prompt shares (cached before) and 18 of its own: what the structured
benchmark's side prompts leave to compute.

Every step that gives the stream a token is timed by the step loop's own CPU
time (``/proc/self/task/<tid>/schedstat``), which other work on the machine
does not inflate, so the ratios hold on a loaded machine: the p99 of the
steps beside each kind of side request over the p99 alone is what the
structured benchmark's ITL ratios would be on an idle machine, less the API
process. Also per kind: the most prompt tokens one such step ran (the
scheduler's prefill budget at work), the CPU time of the process's other
threads meanwhile (grammar compiles and masks), and the time the step loop
was neither running nor waiting for a CPU (blocked: waiting for the GIL).

Writes ``results/grammar-steps-<stamp>.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from typing import Any

from benchmarks._results import result_stem, write_json
from benchmarks.grammar_stall import _schedstat
from benchmarks.structured import tools_schema
from tserve.gpu.engine._engine_core import EngineCore
from tserve.gpu.scheduling._sequence import ScheduledChunk
from tserve.protocol import AddRequest, EngineConfig, JsonSchema, SamplingParams

_PEER = b"bench"
_SHARED = list(range(300, 316))  # every side prompt's first block
_KINDS = {  # kind: (side requests, constrained)
    "alone": (0, False),
    "one_plain": (1, False),
    "one_grammar": (1, True),
    "eight_plain": (8, False),
    "eight_grammars": (8, True),
}


def _others_cpu(me: int) -> float:
    """CPU seconds so far of this process's threads other than ``me``."""
    total = 0.0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != me:
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0]) / 1e9
            except OSError:  # the thread ended
                pass
    return total


def _stream(
    core: EngineCore, request_id: str, tokens: int, kind: str, tag: str
) -> list[dict[str, float]]:
    """Step a plain request to its end beside ``kind``'s side requests; its steps."""
    sides, constrained = _KINDS[kind]
    core.add(
        AddRequest(
            request_id,
            [1, 2, 3, 4, 5],
            SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.8),
        ),
        _PEER,
    )
    me = threading.get_native_id()
    execute = core.runner.execute
    prompt_tokens = [0]

    def counted(chunks: list[ScheduledChunk]) -> Any:
        prompt_tokens[0] = sum(len(c.token_ids) for c in chunks if len(c.token_ids) > 1)
        return execute(chunks)

    core.runner.execute = counted  # type: ignore[method-assign]
    steps: list[dict[str, float]] = []
    produced, done, sent = 0, False, sides == 0
    while not done:
        prompt_tokens[0] = 0
        start, (ran, waited), others = time.perf_counter(), _schedstat(), _others_cpu(me)
        outputs = core.step()
        wall = time.perf_counter() - start
        ran2, waited2 = _schedstat()
        got = 0
        for _, out in outputs:
            if out.request_id == request_id:
                got = len(out.token_ids)
                done = out.finish_reason is not None
        produced += got
        if got:
            run, queue = ran2 - ran, waited2 - waited
            steps.append(
                {
                    "run": run,
                    "blocked": max(0.0, wall - run - queue),
                    "others": _others_cpu(me) - others,
                    "prompt_tokens": prompt_tokens[0],
                }
            )
        if not sent and produced >= 5:
            for i in range(sides):
                own = [(hash((tag, i, k)) % 40000) + 500 for k in range(18)]
                constraint = JsonSchema(tools_schema(f"{tag}s{i}")) if constrained else None
                params = SamplingParams(max_tokens=24, temperature=0.8, constraint=constraint)
                core.add(AddRequest(f"{request_id}-side{i}", _SHARED + own, params), _PEER)
            sent = True
    core.runner.execute = execute  # type: ignore[method-assign]
    while core.has_work:
        core.step()
    return steps


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def _summary(steps: list[dict[str, float]], alone_p99: float | None) -> dict[str, Any]:
    runs = [s["run"] for s in steps]
    p99 = _p99(runs)
    return {
        "steps": len(steps),
        "cpu_median_ms": statistics.median(runs) * 1e3,
        "cpu_p99_ms": p99 * 1e3,
        "cpu_max_ms": max(runs) * 1e3,
        "cpu_p99_ratio": p99 / (alone_p99 or p99),
        "most_prompt_tokens_in_a_step": max(int(s["prompt_tokens"]) for s in steps),
        "other_threads_cpu_ms": sum(s["others"] for s in steps) * 1e3,
        "blocked_ms": sum(s["blocked"] for s in steps) * 1e3,
        "blocked_max_ms": max(s["blocked"] for s in steps) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    core = EngineCore(EngineConfig(max_num_seqs=64, threads=1), progress=lambda _: None)
    # The llguidance tokenizer built, one compile done and the shared block cached.
    warm = SamplingParams(max_tokens=2, constraint=JsonSchema(tools_schema("warm")))
    core.add(AddRequest("warm", [1, 2, 3], warm), _PEER)
    core.add(AddRequest("warm2", _SHARED + [9] * 18, SamplingParams(max_tokens=2)), _PEER)
    while core.has_work:
        core.step()
    load_before = os.getloadavg()[0]
    steps: dict[str, list[dict[str, float]]] = {kind: [] for kind in _KINDS}
    stamp = str(int(time.time()))
    for r in range(args.rounds):
        for kind in _KINDS:
            steps[kind] += _stream(core, f"{kind}{r}", args.tokens, kind, f"{stamp}{kind}{r}")
    core.close()
    alone = _p99([s["run"] for s in steps["alone"]])
    result = {
        "rounds": args.rounds,
        "tokens": args.tokens,
        "load_average": {"before": load_before, "after": os.getloadavg()[0]},
        "step_overhead_tokens": core.scheduler.step_overhead_tokens,
        "mask_threads": getattr(core.constraints, "mask_threads", None),
        "kinds": {kind: _summary(s, alone) for kind, s in steps.items()},
    }
    print(write_json(result_stem("grammar-steps"), result))
    for kind, s in result["kinds"].items():
        print(
            f"{kind}: step CPU median {s['cpu_median_ms']:.1f} p99 {s['cpu_p99_ms']:.1f} ms "
            f"(÷ alone {s['cpu_p99_ratio']:.2f}); most prompt tokens in a step "
            f"{s['most_prompt_tokens_in_a_step']}; "
            f"other threads {s['other_threads_cpu_ms']:.0f} ms; "
            f"blocked {s['blocked_ms']:.0f} ms (max {s['blocked_max_ms']:.1f})"
        )


if __name__ == "__main__":
    main()
