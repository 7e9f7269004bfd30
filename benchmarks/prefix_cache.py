"""Time to first token of a chat whose long system prompt is cached, vs one whose is not.

Run: ``python -m benchmarks.prefix_cache [--tiny] [--system-tokens 1500] [--repeats 5]``

Chats share a system prompt of about ``--system-tokens`` tokens (lines of
``sonnet.txt``) and differ in their last user message; each is rendered with
the model's chat template. Every repeat opens a new session: its system
prompt starts with the session number, so nothing of it is cached yet. In
each session, one request at a time, on an
:class:`~tserve.gpu.engine._engine_core.EngineCore` in this process (the engine's default
settings: one thread, a 512-token step budget):

* cold: the session's first chat (the cache is on, but holds nothing of it);
* warm: ``--warm`` further chats of the session, each with a new user
  message: they share the system prompt's full blocks;
* off: the same warm chats on a second core with ``enable_prefix_caching``
  off (what every chat costs without the cache).

TTFT is the wall time from ``add`` to the step that returns the chat's first
token (``max_tokens=1``), so it is the engine's share of a server's TTFT:
no HTTP, no tokenization. Sessions alternate between the two cores, so noise
from a shared machine hits both sides alike; the medians are reported, with
warm / cold (the claim: at most 1/3). Writes JSON under ``results/``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._results import result_stem, write_json
from tserve.gpu.engine._engine_core import EngineCore
from tserve.gpu.gguf._convert import default_model_dir
from tserve.gpu.models._directory import build_tiny_model
from tserve.protocol import AddRequest, EngineConfig, SamplingParams

_PEER = b"bench"
_SONNETS = Path(__file__).with_name("sonnet.txt")
_QUESTIONS = [
    "Which line of these sonnets do you like best, and why?",
    "Summarize the first sonnet in one sentence.",
    "What rhyme scheme do these poems follow?",
    "Name three images the poet returns to.",
    "Is the speaker hopeful or resigned? Answer briefly.",
    "Which word appears most often, do you think?",
    "Give the poems a title of five words.",
    "What does the poet ask of the young man?",
    "Quote a line about time.",
    "How would you read these aloud?",
]


def system_prompt(tokenizer: Any, num_tokens: int) -> str:
    """Whole lines of the sonnets, about ``num_tokens`` tokens of them."""
    lines = [line for line in _SONNETS.read_text().splitlines() if line.strip()]
    text, count = "You are a helpful reader of poetry. The poems:\n", 0
    for line in lines * 4:
        if count >= num_tokens:
            break
        text += line + "\n"
        count = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return text


def chat_ids(tokenizer: Any, system: str, question: str) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def ttft(core: EngineCore, request_id: str, prompt: list[int]) -> float:
    """Seconds from add to the step that returns the first token (the core is idle)."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    core.add(AddRequest(request_id, prompt, params), _PEER)
    while True:
        outputs = core.step()
        if any(out.request_id == request_id and out.token_ids for _, out in outputs):
            elapsed = time.perf_counter() - start
            break
    while core.has_work:
        core.step()
    return elapsed


def make_core(model_dir: Path, args: argparse.Namespace, *, prefix_caching: bool) -> EngineCore:
    config = EngineConfig(
        model=str(model_dir),
        threads=args.threads,
        device="cpu",
        dtype="float32",
        cpu_gemm=args.cpu_gemm,
        enable_prefix_caching=prefix_caching,
    )
    return EngineCore(config, progress=lambda _: None)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prefix_cache", description=__doc__)
    parser.add_argument("--tiny", action="store_true", help="the tiny random test model")
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=5, help="sessions (cold chats)")
    parser.add_argument("--warm", type=int, default=4, help="warm chats per session")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cpu-gemm", default="auto", choices=("auto", "blas", "onednn"))
    args = parser.parse_args()
    if args.warm > len(_QUESTIONS) - 1:
        parser.error(f"--warm must be at most {len(_QUESTIONS) - 1}")

    if args.tiny:
        model_dir = build_tiny_model(Path(os.environ.get("TMPDIR", "/tmp")) / "tserve-bench-tiny")
    else:
        model_dir = default_model_dir(progress=print)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = system_prompt(tokenizer, args.system_tokens)
    on = make_core(model_dir, args, prefix_caching=True)
    off = make_core(model_dir, args, prefix_caching=False)
    # Warm-up: one short and one long request on each core, then nothing is cached.
    for core in (on, off):
        ttft(core, "warmup-short", chat_ids(tokenizer, "Hi.", "Hi."))
        ttft(core, "warmup-long", chat_ids(tokenizer, "Warm-up. " + base, "Hi."))

    rows: list[dict[str, Any]] = []
    print(f"{'session':>7} {'prompt':>7} {'cold s':>8} {'warm s':>8} {'off s':>8} {'warm/cold':>9}")
    for session in range(args.repeats):
        system = f"Session {session}. {base}"
        chats = [chat_ids(tokenizer, system, q) for q in _QUESTIONS[: args.warm + 1]]
        cold = ttft(on, f"s{session}-cold", chats[0])
        warm: list[float] = []
        uncached: list[float] = []
        for i, prompt in enumerate(chats[1:]):
            pair = [(on, warm), (off, uncached)]
            for core, times in pair if (session + i) % 2 == 0 else reversed(pair):
                times.append(ttft(core, f"s{session}-{i}", prompt))
        row = {
            "session": session,
            "prompt_tokens": [len(c) for c in chats],
            "cold_s": cold,
            "warm_s": warm,
            "off_s": uncached,
        }
        rows.append(row)
        w, o = statistics.median(warm), statistics.median(uncached)
        print(f"{session:>7} {len(chats[0]):>7} {cold:8.3f} {w:8.3f} {o:8.3f} {w / cold:9.3f}")

    summary = _summary(rows, on)
    print(
        f"median TTFT: cold {summary['cold_s']:.3f} s, warm {summary['warm_s']:.3f} s, "
        f"cache off {summary['off_s']:.3f} s; warm/cold {summary['warm_over_cold']:.3f} "
        f"(claim <= 1/3: {'yes' if summary['claim_holds'] else 'NO'}); "
        f"hits {summary['hit_tokens']} of {summary['query_tokens']} prompt tokens"
    )
    stem = result_stem("prefix-cache")
    meta = {
        "model": model_dir.name,
        "system_tokens": args.system_tokens,
        "repeats": args.repeats,
        "warm": args.warm,
        "threads": args.threads,
        "cpu_gemm": args.cpu_gemm,
        "batch_tokens": on.config.max_num_batched_tokens,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    print(f"wrote {write_json(stem, {'meta': meta, 'summary': summary, 'rows': rows})}")
    return 0 if summary["claim_holds"] else 1


def _summary(rows: list[dict[str, Any]], on: EngineCore) -> dict[str, Any]:
    cold = statistics.median(r["cold_s"] for r in rows)
    warm = statistics.median(t for r in rows for t in r["warm_s"])
    off = statistics.median(t for r in rows for t in r["off_s"])
    stats = on.stats()
    return {
        "cold_s": cold,
        "warm_s": warm,
        "off_s": off,
        "warm_over_cold": warm / cold,
        "warm_over_off": warm / off,
        "claim_holds": warm / cold <= 1 / 3,
        "query_tokens": stats.prefix_cache_queries,
        "hit_tokens": stats.prefix_cache_hits,
    }


if __name__ == "__main__":
    raise SystemExit(main())
