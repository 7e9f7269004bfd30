"""Time to first token of one long prompt: tserve beside llama-server, by threads.

``benchmarks/vs_llamacpp.py --long-prompts 512,2048,7500`` runs it: for
each thread count (``--long-threads``, 1 and 2 by default) tserve with
``--threads T`` and ``llama-server -t T -tb T -np 1 -c CTX``, in alternating
rounds, each started fresh, get one warm-up request and then one streamed
/v1/completions of each length: token ids drawn at random (the same ids for
both servers in a round, new ones in every round and length, so no prefix
cache helps), ``max_tokens`` 1. TTFT is the time from sending the request to
its first streamed event that carries a choice, on the client. Prints and
writes ``results/vs_llamacpp_long-TIME.json`` and ``.md``.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks._results import REPO_ROOT
from benchmarks._sidebyside import Peer, Server, _slug

__all__ = ["long_prompt_rounds"]

# Token ids the prompts are drawn from: past every special token of the
# default model's vocabulary, inside any vocabulary of 40k or more.
_IDS = (1000, 40000)


def ttft(url: str, model: str, prompt: list[int]) -> float:
    """Seconds from sending one streamed completion to its first choice event."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=None) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                return time.perf_counter() - start
    raise RuntimeError(f"{url}: the stream ended without a choice")


def long_prompt_rounds(
    pairs: Sequence[tuple[int, Peer, Peer]],
    model: str,
    lengths: Sequence[int],
    rounds: int,
    setup: dict[str, str],
    result_dir: Path = REPO_ROOT / "results",
) -> Path:
    """``rounds`` alternating rounds of every (threads, tserve, peer) pair.

    Blocks for the whole run (minutes). Writes the JSON and the Markdown
    table, with ``setup`` (which builds and instruction sets ran) in both;
    returns the JSON's path.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = result_dir / f"vs_llamacpp_long-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    found: dict[str, dict[int, list[float]]] = {}
    for r in range(rounds):
        for _, *servers in pairs:
            for peer in servers:
                rng = random.Random(r)
                server = Server(peer, out / f"{_slug(peer.name)}-r{r}.log")
                try:
                    ttft(server.url, model, [rng.randrange(*_IDS) for _ in range(16)])  # warm-up
                    for length in lengths:
                        prompt = [rng.randrange(*_IDS) for _ in range(length)]
                        seconds = ttft(server.url, model, prompt)
                        found.setdefault(peer.name, {}).setdefault(length, []).append(seconds)
                        print(f"{peer.name}: {length} tokens, TTFT {seconds:.2f} s", flush=True)
                finally:
                    server.stop()
    rows = ["| prompt tokens | threads | TTFT s tserve / llama.cpp | ÷ |", "|---|---|---|---|"]
    table: list[dict[str, Any]] = []
    for threads, ours, peer in pairs:
        for length in lengths:
            a = sum(found[ours.name][length]) / rounds
            b = sum(found[peer.name][length]) / rounds
            rows.append(f"| {length} | {threads} | {a:.2f} / {b:.2f} | {a / b:.2f} |")
            table.append({"tokens": length, "threads": threads, "tserve_s": a, "peer_s": b})
    markdown = (
        f"Time to first token of one prompt ({Path(model).name}, random token ids, streamed "
        f"/v1/completions, max_tokens 1, mean of {rounds} alternating round(s); ÷ < 1 "
        "favours tserve):\n\n"
        + "\n".join(rows)
        + "\n\n"
        + "".join(f"* {key}: {value}\n" for key, value in setup.items())
    )
    print("\n" + markdown)
    stem = result_dir / f"vs_llamacpp_long-{stamp}"
    doc = {"date": stamp, "model": model, "rounds": rounds, "setup": setup}
    doc |= {"ttft_s": found, "table": table}
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    stem.with_suffix(".md").write_text(markdown)
    print(f"wrote {stem}.json and .md (logs in {out})")
    return stem.with_suffix(".json")
