"""What the frontend costs: the same workload through ``open_llm`` and straight into the engine.

Run: ``python -m benchmarks.frontend [--model default] [--requests 256] [--output-len 64]``

The workload: ``--requests`` requests at once, prompts of random token ids
with lengths drawn uniformly from ``--prompt-len MIN MAX``, exactly
``--output-len`` output tokens each (EOS ignored), seeded sampling. It runs
two ways in this one process, alternately, ``--repeat`` times each:

* api: through :func:`tserve.open_llm` — the request tasks, admission, the
  mux and its socket, the engine process, and back through the mailboxes,
  RequestStream and the incremental detokenizer; one task per request
  reading its deltas (``async for``), as the HTTP layer does;
* direct: an in-process :class:`tserve.gpu.engine._engine_core.EngineCore` with the same
  engine options, adding every request and calling ``step()`` until all
  have finished: no mux, no process boundary, no text.

Each run's clock goes from the first request handed over to the last token
received. tokens/s = output tokens / that time; the ratio is api / direct
(best run of each). The engine options are the same for both (``--threads``
torch threads each; the direct run executes in a worker thread so the API
side's event loop stays responsive). A JSON result goes under ``results/``.

With the tiny test model an engine step is so cheap that the API process's
per-token Python work decides the ratio; with the default model (SmolLM2-135M)
the engine's forward pass dominates, as it does for any real model.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from benchmarks._results import REPO_ROOT, result_stem, write_json
from tserve import LLM, SamplingParams, open_llm
from tserve.protocol import AddRequest, EngineConfig


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    params: list[SamplingParams]

    @property
    def output_tokens(self) -> int:
        return sum(p.max_tokens for p in self.params)


def make_workload(
    requests: int, prompt_len: tuple[int, int], output_len: int, vocab: int, seed: int
) -> Workload:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(requests)
    ]
    params = [
        SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=1.0, seed=i)
        for i in range(requests)
    ]
    return Workload(prompts, params)


# -- the two ways ----------------------------------------------------------------


async def run_api(llm: LLM, work: Workload) -> float:
    """Output tokens per second through open_llm's LLM."""
    tokens = 0

    async def one(prompt: list[int], params: SamplingParams) -> None:
        nonlocal tokens
        async for delta in llm.generate(prompt, params):
            tokens += len(delta.token_ids)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for prompt, params in zip(work.prompts, work.params, strict=True):
            tg.start_soon(one, prompt, params)
    elapsed = time.perf_counter() - start
    assert tokens == work.output_tokens, (tokens, work.output_tokens)
    return tokens / elapsed


def run_direct(core: Any, work: Workload, run: int) -> float:
    """Output tokens per second straight through EngineCore.step(). Blocking."""
    tokens = finished = 0
    start = time.perf_counter()
    for i, (prompt, params) in enumerate(zip(work.prompts, work.params, strict=True)):
        core.add(AddRequest(f"direct-{run}-{i}", prompt, params), b"bench")
    while finished < len(work.prompts):
        for _, output in core.step():
            tokens += len(output.token_ids)
            finished += output.finish_reason is not None
    elapsed = time.perf_counter() - start
    assert tokens == work.output_tokens, (tokens, work.output_tokens)
    return tokens / elapsed


# -- main ----------------------------------------------------------------------


async def measure(args: argparse.Namespace, model: str) -> dict[str, Any]:
    engine_options: dict[str, Any] = {
        "max_num_seqs": args.requests,
        "kv_cache_tokens": args.requests * (args.prompt_len[1] + args.output_len + 16),
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "threads": args.threads,
    }
    api_runs: list[float] = []
    direct_runs: list[float] = []
    async with open_llm(
        model, max_pending=args.requests, log_level="WARNING", **engine_options
    ) as llm:
        work = make_workload(
            args.requests, args.prompt_len, args.output_len, llm.ready.vocab_size, args.seed
        )
        from tserve.gpu.engine._engine_core import EngineCore  # torch: the direct run only

        config = EngineConfig(model=llm.ready.model_path, **engine_options)
        core = await anyio.to_thread.run_sync(lambda: EngineCore(config, progress=lambda _: None))
        warm = make_workload(8, args.prompt_len, 4, llm.ready.vocab_size, args.seed + 1)
        await run_api(llm, warm)
        await anyio.to_thread.run_sync(run_direct, core, warm, -1)
        for run in range(args.repeat):
            direct_runs.append(await anyio.to_thread.run_sync(run_direct, core, work, run))
            api_runs.append(await run_api(llm, work))
            print(
                f"  run {run + 1}: direct {direct_runs[-1]:,.0f} tok/s, "
                f"api {api_runs[-1]:,.0f} tok/s",
                flush=True,
            )
        ready = llm.ready
    api, direct = max(api_runs), max(direct_runs)
    return {
        "benchmark": "frontend",
        "model": ready.model,
        "device": ready.device,
        "requests": args.requests,
        "prompt_len": list(args.prompt_len),
        "output_len": args.output_len,
        "engine": engine_options,
        "backend": args.backend,
        "repeat": args.repeat,
        "api_runs": api_runs,
        "direct_runs": direct_runs,
        "api_tokens_per_s": api,
        "direct_tokens_per_s": direct,
        "ratio": api / direct,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _tiny_model() -> str:
    from tserve.gpu.models._directory import TINY_MODEL_VERSION, build_tiny_model

    directory = Path(tempfile.gettempdir()) / f"tserve-bench-tiny-v{TINY_MODEL_VERSION}"
    if not (directory / "config.json").is_file():
        build_tiny_model(directory)
    return str(directory)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help='"tiny" (default), "default" or a path')
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument(
        "--prompt-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX")
    )
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each engine")
    parser.add_argument("--repeat", type=int, default=3, help="best of N runs each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=["trio", "asyncio"], default="trio")
    args = parser.parse_args()
    model = _tiny_model() if args.model == "tiny" else args.model
    result = anyio.run(measure, args, model, backend=args.backend)
    print(
        f"{result['model']} on {result['device']}: {args.requests} requests, prompts "
        f"{args.prompt_len[0]}-{args.prompt_len[1]} tokens, {args.output_len} output tokens"
    )
    print(f"direct EngineCore: {result['direct_tokens_per_s']:,.0f} tokens/s")
    print(f"open_llm ({args.backend}):  {result['api_tokens_per_s']:,.0f} tokens/s")
    print(f"api / direct:      {result['ratio']:.2f}")
    path = write_json(result_stem("frontend"), result)
    print(f"wrote {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
