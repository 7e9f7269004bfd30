"""Time to first token of one long prompt on a GGUF file, on the native runner.

Run: ``python -m benchmarks.long_prefill [--gguf PATH] [--prompts 512,2048,7500]
[--threads 1,2] [--batch-tokens 512] [--repeats 1] [--isa best|avx2]
[--decoders 0] [--label NAME]``

For each thread count, one engine (prefix caching off, a KV budget for the
longest prompt plus the decoders); for each prompt length, ``--repeats``
times (the best kept): a request of that many random tokens and
``max_tokens=1`` added to an idle engine, stepped until its token comes. The
figure is the prompt's tokens over that time (prefill tok/s) and the time
itself (TTFT, seconds).

``--decoders N`` (N > 0) first starts N greedy streams and lets them decode,
then adds the prompt beside them: it reports the median decode-only step
before the prompt, the median and slowest step while the prompt is
prefilled (the streams' inter-token latency then, in CPU seconds) and the
median's ratio to the first, the slowdown the scheduler's prefill budget
bounds.

``--isa avx2`` caps the kernels at their AVX2 variants (``TSERVE_MAX_ISA``),
as a CPU without AVX-512 runs them. Writes JSON under ``results/``.
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

from benchmarks._results import result_stem, write_json


def _core(gguf: Path, threads: int, batch_tokens: int, kv_tokens: int) -> Any:
    from tserve.gpu.engine._engine_core import EngineCore
    from tserve.protocol import EngineConfig

    config = EngineConfig(
        model=str(gguf),
        device="cpu",
        dtype="float32",
        threads=threads,
        gguf_runner="native",
        max_num_batched_tokens=batch_tokens,
        kv_cache_tokens=kv_tokens,
        enable_prefix_caching=False,
    )
    return EngineCore(config, progress=lambda line: None)


def _add(core: Any, request_id: str, prompt: list[int], max_tokens: int) -> None:
    from tserve.protocol import AddRequest, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    core.add(AddRequest(request_id, prompt, params), b"bench")


def _ttft(core: Any, prompt: list[int], tag: str) -> dict[str, float]:
    """Seconds from adding ``prompt`` to an idle core to its first token: wall
    clock (``ttft``) and the process's CPU time (``cpu``: all its threads; on
    one thread, the time a machine to itself would take)."""
    _add(core, tag, prompt, 1)
    start, cpu = time.perf_counter(), time.process_time()
    while core.has_work:
        core.step()
    return {"ttft": time.perf_counter() - start, "cpu": time.process_time() - cpu}


def _decoder_tokens(prompt: int) -> int:
    """Tokens a decoder asks for: more than the steps a ``prompt``-token prefill takes."""
    return prompt // 16 + 64


def _beside_decoders(
    core: Any, prompt: list[int], decoders: int, vocab: int, rng: random.Random, tag: str
) -> dict[str, float]:
    """Decode-only steps, then the steps that prefill ``prompt`` beside them, each
    timed in the process's CPU time (on one thread, what a machine to itself takes)."""
    for i in range(decoders):  # enough tokens to outlast the prefill (>= 48 prompt tokens a step)
        own = [rng.randrange(vocab) for _ in range(16)]
        _add(core, f"{tag}-d{i}", own, _decoder_tokens(len(prompt)))
    for _ in range(4):  # the decoders' prompts, then a few decodes
        core.step()
    before = []
    for _ in range(16):
        start = time.process_time()
        core.step()
        before.append(time.process_time() - start)
    _add(core, tag, prompt, 1)
    during = []
    start, cpu = time.perf_counter(), time.process_time()
    while True:
        step_start = time.process_time()
        outputs = core.step()
        during.append(time.process_time() - step_start)
        if any(out.request_id == tag and out.token_ids for _, out in outputs):
            break
    ttft, cpu = time.perf_counter() - start, time.process_time() - cpu
    core.abort([f"{tag}-d{i}" for i in range(decoders)])
    while core.has_work:
        core.step()
    decode_step, prefill_step = statistics.median(before), statistics.median(during)
    return {
        "ttft": ttft,
        "cpu": cpu,
        "decode_step": decode_step,
        "step_during_prefill": prefill_step,
        "slowest_step": max(during),
        "slowdown": prefill_step / decode_step,
    }


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.long_prefill", description=__doc__)
    parser.add_argument("--gguf", type=Path, default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--prompts", default="512,2048,7500")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--batch-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--isa", choices=("best", "avx2"), default="best")
    parser.add_argument("--decoders", type=int, default=0, help="streams decoding beside")
    parser.add_argument("--label", default="", help="a name for this build in the JSON")
    args = parser.parse_args()
    if args.isa == "avx2":
        os.environ["TSERVE_MAX_ISA"] = "avx2"  # read once, when the kernels load
    from tserve.gpu.models._directory import default_gguf

    prompts = [int(p) for p in args.prompts.split(",")]
    gguf = (args.gguf or default_gguf()).resolve()
    rng = random.Random(0)
    runs: list[dict[str, Any]] = []
    for threads in [int(t) for t in args.threads.split(",")]:
        decoder_kv = args.decoders * (16 + _decoder_tokens(max(prompts)))
        core = _core(gguf, threads, args.batch_tokens, max(prompts) + decoder_kv + 64)
        vocab = core.vocab_size
        _ttft(core, [rng.randrange(vocab) for _ in range(64)], "warm-up")
        for length in prompts:
            best: dict[str, float] | None = None
            for repeat in range(args.repeats):
                prompt = [rng.randrange(vocab) for _ in range(length)]
                tag = f"p{length}-t{threads}-{repeat}"
                if args.decoders:
                    run = _beside_decoders(core, prompt, args.decoders, vocab, rng, tag)
                else:
                    run = _ttft(core, prompt, tag)
                if best is None or run["ttft"] < best["ttft"]:
                    best = run
            assert best is not None
            record = {"threads": threads, "prompt": length, **best}
            record["prefill_tok_s"] = length / best["ttft"]
            runs.append(record)
            extra = "".join(
                f", {key} {best[key]:.3f}"
                for key in ("cpu", "decode_step", "step_during_prefill", "slowest_step", "slowdown")
                if key in best
            )
            print(
                f"threads {threads} prompt {length}: TTFT {best['ttft']:.2f} s, "
                f"{record['prefill_tok_s']:.1f} tok/s{extra}",
                flush=True,
            )
    meta = {
        "gguf": str(gguf),
        "label": args.label,
        "isa": args.isa,
        "batch_tokens": args.batch_tokens,
        "decoders": args.decoders,
        "repeats": args.repeats,
        "machine": platform.processor() or platform.machine(),
        "load_average": os.getloadavg(),
    }
    path = write_json(result_stem("long_prefill"), {"meta": meta, "runs": runs})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
