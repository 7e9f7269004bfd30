"""Greedy completions of a fixed prompt set: how often tserve and llama-server agree,
beside how often two other engines on the same weights agree.

Run: ``python -m benchmarks.greedy_agreement --llama-server PATH [--gguf PATH]
[--tokens 32] [--threads 1] [--engines tserve,tserve-fp32,llama-server,transformers]
[--llama-server-b PATH] [--tserve-options "..."] [--prompts 24]``

Every engine gets the same prompt ids: llama-server's ``/tokenize`` of each
of :func:`prompt_set`'s ``--prompts`` texts (:data:`PROMPTS`, then the
openings of lines of ``benchmarks/sonnet.txt``), with the BOS token first
where the file asks for one (tserve's ``/tokenize`` must give the same
ids). Each engine completes each prompt greedily for up to ``--tokens``
tokens, stopping at an end-of-generation token as it would when serving.
Engines:

* ``tserve``: ``python -m tserve serve FILE --threads T`` as a user runs it
  (``/v1/completions``, ``temperature`` 0);
* ``tserve-fp32``: the same with ``--gguf-activations fp32`` (the weights
  dequantized in registers, no 8-bit rounding of activations);
* ``llama-server``: ``llama-server -m FILE -t T -np 1`` (``/completion``,
  ``temperature`` 0: its greedy argmax); its activations are rounded to
  8 bits per block, as tserve's default;
* ``llama-server-b`` (with ``--llama-server-b``): a second llama.cpp build
  (for example one without AVX-512, whose dot products sum in another order),
  the same way: two quantized engines on the same file and the same 8-bit
  activations, whose agreement is the bar for tserve's with llama-server;
* ``transformers``: transformers' own model class for the architecture
  over the file dequantized to fp32 (its GGUF loader; eager attention), an
  argmax loop with its KV cache: no quantized activations at all.

A completion is compared as the list of its tokens' texts (each token
decoded alone by the file's tokenizer, as tserve's completion logprobs give
them). For each pair of engines: the share of prompts whose completions are
identical, and the mean number of leading tokens the two completions share.
Greedy decoding amplifies the smallest difference in logits once two
candidates are near-tied, so even two exact implementations of the same
weights part on some prompts; the pairs without tserve say how often.
With ``--llama-server-b``, each tserve engine's agreement with llama-server
is set beside the two builds' own, prompt by prompt: the prompts where only
one of the two pairs agrees, and the two-sided sign test's p-value over them
(how likely a split at least as uneven is if both pairs agree equally often).
Prints the tables; writes JSON (every completion too) under ``results/``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks._results import result_stem, write_json
from benchmarks._serve import serve
from tserve.gpu.gguf._file import tokenizer_dir
from tserve.gpu.models._directory import default_gguf

__all__ = ["PROMPTS", "main"]

_ENGINES = ("tserve", "tserve-fp32", "llama-server", "transformers")
_END_OF_GENERATION = frozenset({"<eos>", "<end_of_turn>", "</s>", "<|endoftext|>", "<|im_end|>"})

PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "Water boils at a temperature of",
    "The three primary colors are",
    "Once upon a time, in a small village by the sea,",
    "The best way to learn a new language is",
    "Photosynthesis is the process by which",
    "def fibonacci(n):\n    ",
    "SELECT name, age FROM users WHERE",
    "import numpy as np\n\nx = np.",
    "<html>\n<head>\n<title>",
    "1, 2, 3, 4, 5,",
    "The square root of 144 is",
    "Q: What is the largest planet in the solar system?\nA:",
    "Here is a list of fruits:\n1. Apple\n2.",
    "Shall I compare thee to a summer's day?",
    "Dear Sir or Madam,\n\nI am writing to",
    "La capitale de l'Allemagne est",
    "Il était une fois un petit chat qui",
    "Der schnellste Weg nach Berlin ist",
    "El agua es importante porque",
    "日本の首都は",
    "中国的长城是",
    "Москва — столица",
    "The meaning of the word 'ephemeral' is",
)
"""English facts, stories, code, lists, arithmetic and a question; French,
German, Spanish, Japanese, Chinese and Russian."""

_SONNET = Path(__file__).with_name("sonnet.txt")


def prompt_set(count: int) -> list[str]:
    """:data:`PROMPTS`, then (past their 24) the first 4 to 8 words of lines of
    the sonnets, spread evenly over the file: always the same ``count`` texts."""
    prompts = list(PROMPTS[:count])
    lines = [line.split() for line in _SONNET.read_text().splitlines() if len(line.split()) >= 8]
    more = count - len(prompts)
    if more > len(lines):
        raise SystemExit(f"--prompts: at most {len(PROMPTS) + len(lines)}")
    for i in range(more):
        words = lines[i * len(lines) // more]
        prompts.append(" ".join(words[: 4 + i % 5]))
    return prompts


def sign_test(only_a: int, only_b: int) -> float:
    """The two-sided exact sign test's p-value for ``only_a`` against ``only_b``
    discordant prompts (1.0 when there are none)."""
    n, low = only_a + only_b, min(only_a, only_b)
    tail = sum(math.comb(n, i) for i in range(low + 1)) / 2**n
    return float(min(1.0, 2 * tail))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _tserve(
    gguf: Path,
    threads: int,
    fp32: bool,
    prompts: list[str],
    ids: list[list[int]],
    n: int,
    extra: list[str],
) -> list[Any]:
    """Each prompt's completion by ``python -m tserve serve`` (with ``extra`` options):
    its tokens' texts. SystemExit if its ``/tokenize`` of a prompt differs from ``ids``."""
    options = ["--threads", str(threads)] + (["--gguf-activations", "fp32"] if fp32 else [])
    options += extra
    with tempfile.TemporaryDirectory() as tmp:
        process, url = serve(str(gguf), Path(tmp) / "tserve.log", *options)
        try:
            out = []
            with httpx.Client(base_url=url, timeout=600) as client:
                for text, prompt in zip(prompts, ids, strict=True):
                    own = client.post("/tokenize", json={"prompt": text}).raise_for_status()
                    if own.json()["tokens"] != prompt:
                        raise SystemExit(f"tserve tokenizes {text!r} as {own.json()['tokens']}")
                    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 0}
                    answer = client.post("/v1/completions", json=body).raise_for_status().json()
                    usage = answer["usage"]["prompt_tokens"]
                    assert usage == len(prompt), f"tserve read {usage} prompt tokens"
                    out.append(answer["choices"][0]["logprobs"]["tokens"])
            return out
        finally:
            process.terminate()
            process.wait()


class _LlamaServer:
    """``llama-server`` on a free loopback port; the constructor blocks until it is healthy."""

    def __init__(self, binary: Path, gguf: Path, threads: int, log: Path) -> None:
        self.url = f"http://127.0.0.1:{_free_port()}"
        command = [
            str(binary), "-m", str(gguf), "--port", self.url.rsplit(":", 1)[1],
            "-t", str(threads), "-tb", str(threads), "-np", "1", "-c", "2048", "--temp", "0",
        ]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
        for _ in range(600):
            if self.process.poll() is not None:
                raise SystemExit(f"llama-server exited ({self.process.returncode}): see {log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)  # polling a child's start-up
        self.stop()
        raise SystemExit(f"llama-server did not become healthy: see {log}")

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return httpx.post(f"{self.url}{path}", json=body, timeout=600).raise_for_status().json()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait()


def _llama(server: _LlamaServer, ids: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt's completion by llama-server, as token ids."""
    out = []
    for prompt in ids:
        body = {
            "prompt": prompt, "n_predict": n, "temperature": 0, "return_tokens": True,
            "cache_prompt": False,
        }  # fmt: skip
        answer = server.post("/completion", body)
        read = answer["tokens_evaluated"]
        assert read == len(prompt), f"llama-server read {read} prompt tokens"
        out.append([int(t) for t in answer["tokens"]])
    return out


def _transformers(
    gguf: Path, ids: list[list[int]], n: int, stops: set[int], threads: int
) -> list[list[int]]:
    """Each prompt's greedy completion by transformers over the file dequantized to fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model: Any = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    print(f"transformers: {type(model).__name__}", flush=True)
    out = []
    with torch.inference_mode():
        for prompt in ids:
            tokens: list[int] = []
            step = model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
            while len(tokens) < n:
                token = int(step.logits[0, -1].argmax())
                if token in stops:
                    break
                tokens.append(token)
                cache = step.past_key_values
                step = model(torch.tensor([[token]]), past_key_values=cache, logits_to_keep=1)
            out.append(tokens)
    return out


def _common_prefix(a: list[str], b: list[str]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def agreement(completions: dict[str, list[list[str]]]) -> dict[str, dict[str, float]]:
    """For each pair of engines: the share of identical completions and the mean
    common prefix in tokens."""
    pairs: dict[str, dict[str, float]] = {}
    for a, b in itertools.combinations(completions, 2):
        both = list(zip(completions[a], completions[b], strict=True))
        pairs[f"{a} | {b}"] = {
            "identical": sum(x == y for x, y in both) / len(both),
            "mean_common_prefix": sum(_common_prefix(x, y) for x, y in both) / len(both),
            "mean_tokens": sum(len(x) + len(y) for x, y in both) / (2 * len(both)),
        }
    return pairs


def against_builds(completions: dict[str, list[list[str]]]) -> dict[str, dict[str, float]]:
    """Each tserve engine's identical completions with llama-server beside the
    two llama.cpp builds' (``llama-server-b`` present): counts, the prompts where
    only one pair agrees, and the sign test over those."""
    if "llama-server-b" not in completions:
        return {}
    llama = completions["llama-server"]
    builds = [x == y for x, y in zip(llama, completions["llama-server-b"], strict=True)]
    out: dict[str, dict[str, float]] = {}
    for engine in (e for e in completions if e.startswith("tserve")):
        ours = [x == y for x, y in zip(completions[engine], llama, strict=True)]
        only_ours = sum(a and not b for a, b in zip(ours, builds, strict=True))
        only_builds = sum(b and not a for a, b in zip(ours, builds, strict=True))
        out[engine] = {
            "prompts": len(ours),
            "identical": sum(ours),
            "builds_identical": sum(builds),
            "only_this_pair": only_ours,
            "only_the_builds": only_builds,
            "sign_test_p": sign_test(only_ours, only_builds),
        }
    return out


def _write(
    stem: Path,
    meta: dict[str, Any],
    prompts: list[str],
    ids: list[list[int]],
    completions: dict[str, list[list[str]]],
) -> dict[str, dict[str, float]]:
    """Write ``<stem>.json`` (the agreement of the engines so far, and every
    completion); return the agreement."""
    pairs = agreement(completions)
    record = {
        "meta": meta,
        "pairs": pairs,
        "against_builds": against_builds(completions),
        "prompts": [{"text": p, "ids": i} for p, i in zip(prompts, ids, strict=True)],
        "completions": completions,
    }
    write_json(stem, record)
    return pairs


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.greedy_agreement")
    parser.add_argument("--gguf", type=Path, default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--llama-server", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=32, help="at most this many per completion")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--engines", default=",".join(_ENGINES), help=f"of {', '.join(_ENGINES)}")
    parser.add_argument(
        "--llama-server-b", type=Path, default=None, help="a second llama.cpp build, compared too"
    )
    parser.add_argument("--tserve-options", default="", help="more options for tserve serve")
    parser.add_argument(
        "--prompts", type=int, default=len(PROMPTS), help="how many of prompt_set's texts"
    )
    args = parser.parse_args()
    prompts = prompt_set(args.prompts)
    engines = [e for e in args.engines.split(",") if e]
    if "llama-server" not in engines or any(e not in _ENGINES for e in engines):
        parser.error(f"--engines: llama-server and others of {', '.join(_ENGINES)}")
    gguf = (args.gguf or default_gguf()).resolve()

    from transformers import AutoTokenizer

    completions: dict[str, list[list[str]]] = {}
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer: Any = AutoTokenizer.from_pretrained(tokenizer_dir(gguf, Path(tmp), print))
        stops = {i for t, i in tokenizer.get_vocab().items() if t in _END_OF_GENERATION}

        def texts(ids: list[list[int]]) -> list[list[str]]:
            # Each token alone, special ones skipped: what tserve's logprobs carry.
            return [[tokenizer.decode([t], skip_special_tokens=True) for t in c] for c in ids]

        ids: list[list[int]] = []
        builds = {"llama-server": args.llama_server, "llama-server-b": args.llama_server_b}
        for name, binary in builds.items():
            if binary is None:
                continue
            start = time.perf_counter()
            server = _LlamaServer(binary, gguf, args.threads, Path(tmp) / f"{name}.log")
            try:
                if not ids:  # the first build's ids serve every engine
                    ids = [server.post("/tokenize", {"content": p, "add_special": True})["tokens"]
                           for p in prompts]  # fmt: skip
                completions[name] = texts(_llama(server, ids, args.tokens))
            finally:
                server.stop()
            seconds[name] = time.perf_counter() - start
        meta = {
            "gguf": str(gguf),
            "tokens": args.tokens,
            "prompts": len(prompts),
            "threads": args.threads,
            "tserve_options": args.tserve_options,
            "llama_server": str(args.llama_server),
            "llama_server_b": str(args.llama_server_b) if args.llama_server_b else None,
            "seconds": seconds,
            "python": sys.version.split()[0],
        }
        stem = result_stem("greedy_agreement")
        extra = shlex.split(args.tserve_options)
        for engine in engines:
            start = time.perf_counter()
            if engine == "transformers":
                done = _transformers(gguf, ids, args.tokens, stops, args.threads)
                completions[engine] = texts(done)
            elif engine.startswith("tserve"):
                fp32 = engine == "tserve-fp32"
                completions[engine] = _tserve(
                    gguf, args.threads, fp32, prompts, ids, args.tokens, extra
                )
            else:
                continue
            seconds[engine] = time.perf_counter() - start
            print(f"{engine}: {len(ids)} completions ({seconds[engine]:.0f} s)", flush=True)
            _write(stem, meta, prompts, ids, completions)  # so far: a later engine may fail
    pairs = _write(stem, meta, prompts, ids, completions)
    width = max(map(len, pairs))
    print(f"{'pair':<{width}}  identical  common prefix (tokens, of {args.tokens})")
    for pair, figures in pairs.items():
        print(
            f"{pair:<{width}}  {figures['identical']:>9.0%}  {figures['mean_common_prefix']:>6.1f}"
        )
    for engine, split in against_builds(completions).items():
        print(
            f"{engine} | llama-server identical on {split['identical']:.0f} of "
            f"{split['prompts']:.0f}, the two builds on {split['builds_identical']:.0f}; "
            f"only {engine}'s pair {split['only_this_pair']:.0f}, only the builds' "
            f"{split['only_the_builds']:.0f}: sign test p = {split['sign_test_p']:.2f}"
        )
    print(f"wrote {stem.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
