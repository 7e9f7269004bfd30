"""Generated tokens per second: the engine's continuous batching vs ``model.generate``.

Run: ``python -m benchmarks.engine [--tiny] [--sizes 1 8 32 128] [--tokens 24] [--prompt-len 16]``

For each size N and each workload, on the same prompts, in this one process:

* engine: an :class:`~tserve.gpu.engine._engine_core.EngineCore` (``max_num_seqs=N``) kept
  at N requests in flight: a request is added as soon as one finishes, until
  every request of the workload is done (``ignore_eos``, greedy);
* static: ``model.generate`` over consecutive batches of N prompts (left
  padding, attention mask, greedy, EOS disabled), each batch running until its
  longest member has its tokens.

Both count only the tokens requests asked for (a static batch's extra tokens
for its shorter members are waste) and divide by wall time, after a warm-up.
The machine may be shared, so the CPU time each side consumed is reported
too: with one thread, "cpu-time ratio" is the ratio the two would show on a
quiet machine. Workloads, with ``max(4, 2N)`` requests per size so that the engine refills:

* uniform: every prompt ``--prompt-len`` tokens, every request ``--tokens``;
* mixed: prompt lengths uniform in [8, 2 * prompt-len], max_tokens uniform in
  [4, 2 * tokens]: static batching pays for the longest member of each batch.

Prompts are random token ids (seeded), which costs the same as text. Both
sides use ``--threads`` torch threads (default 1, the engine's own default:
on a shared machine more threads make both sides erratic); ``--repeats``
alternates runs and keeps each side's best. Prints both rates and
engine/static per size, and writes JSON and a PNG plot under ``results/``.

The engine's linear layers run on the library it measured fastest on this
CPU (``--cpu-gemm``, default auto: the BLAS or prepacked oneDNN), while
``generate`` uses plain ``F.linear`` as users run it. ``--static-gemm same``
gives the static side the engine's linear layers too, so that the ratio
shows batching alone; ``--cpu-gemm blas`` does the same the other way round.
``--model-impl hf`` runs the engine on the transformers modules instead of
tserve's own forward pass (:mod:`tserve.gpu.forward._llama`) for a Llama-family model.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import platform
import random
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._results import result_stem, write_json
from tserve.gpu.engine._engine_core import EngineCore
from tserve.gpu.forward._gemm import tune_linears
from tserve.gpu.gguf._convert import default_model_dir
from tserve.gpu.models._directory import build_tiny_model, load_model
from tserve.protocol import AddRequest, EngineConfig, SamplingParams

_PEER = b"bench"


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


@dataclasses.dataclass(frozen=True)
class Measured:
    tokens: int
    seconds: float  # wall clock
    cpu_seconds: float  # this process's CPU time: what the work cost, whoever else ran

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    @property
    def cpu_rate(self) -> float:
        return self.tokens / self.cpu_seconds


class _Clock:
    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def measured(self, tokens: int) -> Measured:
        return Measured(tokens, time.perf_counter() - self.wall, time.process_time() - self.cpu)


def workload(
    kind: str, n: int, *, vocab: int, prompt_len: int, tokens: int, seed: int
) -> list[Request]:
    rng = random.Random(f"{kind}-{n}-{seed}")
    out = []
    for _ in range(n):
        if kind == "uniform":
            length, new = prompt_len, tokens
        else:
            length, new = rng.randint(8, 2 * prompt_len), rng.randint(4, 2 * tokens)
        out.append(Request([rng.randrange(vocab) for _ in range(length)], new))
    return out


# -- the two systems -------------------------------------------------------------


def run_engine(core: EngineCore, requests: list[Request], concurrency: int) -> Measured:
    """Keep ``concurrency`` requests in flight until all are done."""
    queue = collections.deque(enumerate(requests))
    live = tokens = 0
    clock = _Clock()
    while queue or live:
        while queue and live < concurrency:
            i, request = queue.popleft()
            params = SamplingParams(max_tokens=request.max_tokens, temperature=0, ignore_eos=True)
            core.add(AddRequest(f"r{i}", request.prompt, params), _PEER)
            live += 1
        for _, out in core.step():
            tokens += len(out.token_ids)
            if out.finish_reason is not None:
                assert out.error is None, out.error
                live -= 1
    measured = clock.measured(tokens)
    assert tokens == sum(r.max_tokens for r in requests), "the engine lost tokens"
    return measured


def run_static(model: Any, pad_id: int, requests: list[Request], batch_size: int) -> Measured:
    """``generate`` over consecutive batches; each runs to its longest member."""
    clock = _Clock()
    for b in range(0, len(requests), batch_size):
        batch = requests[b : b + batch_size]
        width = max(len(r.prompt) for r in batch)
        ids = torch.tensor([[pad_id] * (width - len(r.prompt)) + r.prompt for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
        new = max(r.max_tokens for r in batch)
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=pad_id,
            )
        assert out.shape[1] == width + new
    return clock.measured(sum(r.max_tokens for r in requests))


def make_core(
    model_dir: Path,
    requests: list[Request],
    size: int,
    threads: int,
    batch_tokens: int,
    cpu_gemm: str = "auto",
    model_impl: str = "auto",
) -> EngineCore:
    """A core whose KV budget holds ``size`` of the largest requests (no preemption)."""
    peak = max(len(r.prompt) + r.max_tokens for r in requests)
    config = EngineConfig(
        model=str(model_dir),
        max_num_seqs=size,
        max_num_batched_tokens=max(batch_tokens, size),
        kv_cache_tokens=size * (peak + 16),
        threads=threads,
        device="cpu",
        dtype="float32",
        cpu_gemm=cpu_gemm,  # type: ignore[arg-type]
        model_impl=model_impl,  # type: ignore[arg-type]
    )
    return EngineCore(config, progress=lambda _: None)


# -- the run ---------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine", description=__doc__)
    parser.add_argument("--tiny", action="store_true", help="the tiny random test model")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--tokens", type=int, default=24, help="new tokens per request (uniform)")
    parser.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (uniform)")
    parser.add_argument("--workloads", nargs="+", default=["uniform", "mixed"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each; the best counts")
    parser.add_argument("--batch-tokens", type=int, default=512, help="engine tokens per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cpu-gemm", choices=["auto", "blas", "onednn"], default="auto", help="the engine's"
    )
    parser.add_argument(
        "--model-impl",
        choices=["auto", "hf"],
        default="auto",
        help="the engine's forward pass: tserve's own where it covers the model, or transformers'",
    )
    parser.add_argument(
        "--static-gemm",
        choices=["blas", "same"],
        default="blas",
        help="generate's linear layers: plain F.linear, or the same as the engine's",
    )
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    if args.tiny:
        model_dir = build_tiny_model(Path(os.environ.get("TMPDIR", "/tmp")) / "tserve-bench-tiny")
    else:
        model_dir = default_model_dir(progress=print)
    model, tokenizer = load_model(model_dir, device="cpu", dtype=torch.float32)
    vocab = int(model.config.vocab_size)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if args.static_gemm == "same":
        tune_linears(model, args.cpu_gemm)
    print(
        f"model {model_dir.name}, {args.threads} threads, sizes {args.sizes}, "
        f"engine gemm {args.cpu_gemm}, static gemm {args.static_gemm}, "
        f"engine model {args.model_impl}"
    )

    rows: list[dict[str, Any]] = []
    print(
        f"{'workload':>8} {'N':>4} {'requests':>8} {'engine tok/s':>13}{'static tok/s':>13}"
        "  ratio  cpu-time ratio"
    )
    for kind in args.workloads:
        for size in args.sizes:
            n = max(4, 2 * size)
            requests = workload(
                kind, n, vocab=vocab, prompt_len=args.prompt_len, tokens=args.tokens, seed=args.seed
            )
            core = make_core(
                model_dir,
                requests,
                size,
                args.threads,
                args.batch_tokens,
                args.cpu_gemm,
                args.model_impl,
            )
            warm = requests[: min(size, 4)]
            run_engine(core, [Request(r.prompt, 2) for r in warm], size)
            run_static(model, pad_id, [Request(r.prompt, 2) for r in warm], size)
            # Alternate the two and keep each one's best: the machine is shared.
            engine = static = Measured(1, float("inf"), float("inf"))
            for _ in range(args.repeats):
                engine = min(engine, run_engine(core, requests, size), key=lambda m: m.seconds)
                static = min(
                    static, run_static(model, pad_id, requests, size), key=lambda m: m.seconds
                )
            del core
            ratio = engine.rate / static.rate
            cpu_ratio = engine.cpu_rate / static.cpu_rate
            rows.append(
                {
                    "workload": kind,
                    "size": size,
                    "requests": n,
                    "tokens": engine.tokens,
                    "engine_seconds": engine.seconds,
                    "static_seconds": static.seconds,
                    "engine_tokens_per_s": engine.rate,
                    "static_tokens_per_s": static.rate,
                    "ratio": ratio,
                    "engine_cpu_seconds": engine.cpu_seconds,
                    "static_cpu_seconds": static.cpu_seconds,
                    "cpu_ratio": cpu_ratio,
                }
            )
            rates = f"{engine.rate:>13.1f}{static.rate:>13.1f}"
            ratios = f"{ratio:6.2f} {cpu_ratio:15.2f}"
            print(f"{kind:>8} {size:>4} {n:>8} {rates} {ratios}", flush=True)
    _write(args, model_dir, rows)
    return 0


def _write(args: argparse.Namespace, model_dir: Path, rows: list[dict[str, Any]]) -> None:
    stem = result_stem("engine")
    meta = {
        "model": model_dir.name,
        "threads": args.threads,
        "tokens": args.tokens,
        "prompt_len": args.prompt_len,
        "batch_tokens": args.batch_tokens,
        "cpu_gemm": args.cpu_gemm,
        "model_impl": args.model_impl,
        "static_gemm": args.static_gemm,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    write_json(stem, {"meta": meta, "rows": rows})
    _plot(stem.with_suffix(".png"), meta, rows)
    print(f"wrote {stem}.json and {stem}.png")


def _plot(path: Path, meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({r["workload"] for r in rows}, key=["uniform", "mixed"].index)
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds, strict=True):
        mine = [r for r in rows if r["workload"] == kind]
        sizes = [r["size"] for r in mine]
        ax.plot(sizes, [r["engine_tokens_per_s"] for r in mine], "o-", label="engine (continuous)")
        ax.plot(sizes, [r["static_tokens_per_s"] for r in mine], "s--", label="generate (static)")
        for i, r in enumerate(mine):
            ax.annotate(
                f"x{r['ratio']:.2f} (cpu x{r['cpu_ratio']:.2f})",
                (r["size"], r["engine_tokens_per_s"]),
                textcoords="offset points",
                xytext=(4 if i == 0 else 0, 8),
                ha="left" if i == 0 else "center",  # the first clear of the y axis
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("concurrent requests / batch size")
        ax.set_ylabel("generated tokens / s")
        ax.set_title(f"{kind} lengths")
        ax.grid(alpha=0.3)
        ax.legend()
    threads = f"{meta['threads']} thread{'s' if meta['threads'] != 1 else ''}"
    gemm = f"engine gemm {meta['cpu_gemm']}, generate gemm {meta['static_gemm']}"
    fig.suptitle(f"{meta['model']} on CPU, {threads} (fp32); {gemm}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
