"""Perplexity of a GGUF file served as it is, by activation path, on a fixed text.

Run: ``python -m benchmarks.perplexity [--gguf PATH] [--text benchmarks/sonnet.txt]
[--window 512] [--threads 2] [--sides dequantized,fp32,int8]``

The text is tokenized by the file's tokenizer (no special tokens) and cut
into windows of ``--window`` tokens; each window is one forward pass of
tserve's own model over the file's weights, with logits at every position;
the perplexity is exp of the mean negative log-likelihood of every token
but each window's first. Sides, each loaded as the engine loads the file:

* ``dequantized``: every product as dequantize-then-``F.linear`` (fp32
  weights and activations: the model converted to fp32);
* ``fp32``: tserve's kernels, fp32 activations against the weights
  dequantized in registers (``--gguf-activations fp32``);
* ``int8``: tserve's kernels, activations rounded to 8 bits per block of 32
  (``--gguf-activations int8``, llama.cpp's scheme).

Every product runs on its side's route whatever the row count (a window's
rows are the rows decode steps would see, one at a time: each row's
products are independent of the others). Prints each side's perplexity and
its difference from ``dequantized``; writes JSON under ``results/``.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks._results import REPO_ROOT, result_stem, write_json
from tserve.gpu._attention import build_step
from tserve.gpu._gguf import load_gguf
from tserve.gpu._model_runner import ModelRunner
from tserve.gpu._models import default_gguf
from tserve.gpu._quant import Activations, QuantizedLinear, quant_kernels
from tserve.gpu._sequence import ScheduledChunk, Sequence
from tserve.protocol import SamplingParams

_SIDES = ("dequantized", "fp32", "int8")
_BLOCK = 16


def _runner(gguf: Path, side: str, window: int, cache: Path) -> tuple[ModelRunner, Path]:
    """A runner over the file loaded for ``side``, and its tokenizer's directory."""
    activations: Activations = "int8" if side == "int8" else "fp32"
    loaded = load_gguf(
        gguf, kernels=quant_kernels(), cache_dir=cache, progress=print, activations=activations
    )
    runner = ModelRunner(loaded.model, num_blocks=window // _BLOCK + 1, block_size=_BLOCK)
    for module in runner.model.modules():
        if isinstance(module, QuantizedLinear):  # this side's route at every row count
            module.kernel_rows = 0 if side == "dequantized" else None
    return runner, loaded.tokenizer_dir


def _window_nll(runner: ModelRunner, tokens: list[int]) -> float:
    """The summed negative log-likelihood of ``tokens[1:]`` given what precedes each."""
    seq = Sequence("ppl", tokens, SamplingParams())
    seq.block_table = list(range(len(tokens) // _BLOCK + 1))
    chunk = ScheduledChunk(seq, 0, tokens, True)
    with torch.inference_mode():
        input_ids, positions, step = build_step([chunk], runner.pool, runner.device)
        rows = torch.arange(len(tokens) - 1)
        logits: Any = runner.model(input_ids[0], positions[0], step, rows)
        targets = torch.tensor(tokens[1:])
        return float(F.cross_entropy(logits.float(), targets, reduction="sum"))


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.perplexity", description=__doc__)
    parser.add_argument("--gguf", type=Path, default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--text", type=Path, default=REPO_ROOT / "benchmarks" / "sonnet.txt")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--sides", default=",".join(_SIDES), help=f"of {', '.join(_SIDES)}")
    args = parser.parse_args()
    sides = [side for side in args.sides.split(",") if side]
    if not sides or any(side not in _SIDES for side in sides):
        parser.error(f"--sides: a comma-separated list of {', '.join(_SIDES)}")
    if args.window < 2:
        parser.error("--window: at least 2 tokens")
    torch.set_num_threads(args.threads)
    gguf = (args.gguf or default_gguf()).resolve()

    from transformers import AutoTokenizer

    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as cache:
        tokens: list[int] = []
        for side in sides:
            runner, tokenizer_dir = _runner(gguf, side, args.window, Path(cache))
            if not tokens:
                tokenizer: Any = AutoTokenizer.from_pretrained(tokenizer_dir)
                text = args.text.read_text()
                tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
                print(f"{args.text.name}: {len(tokens)} tokens, windows of {args.window}")
            start = time.perf_counter()
            nll, count = 0.0, 0
            for first in range(0, len(tokens) - 1, args.window):
                window = tokens[first : first + args.window]
                if len(window) > 1:
                    nll += _window_nll(runner, window)
                    count += len(window) - 1
            ppl = math.exp(nll / count)
            results[side] = {"perplexity": ppl, "tokens": count, "nll": nll}
            print(f"{side:>12}: perplexity {ppl:.4f} ({time.perf_counter() - start:.0f} s)")
            del runner
    reference = results.get("dequantized")
    if reference is not None:
        for side, result in results.items():
            result["vs_dequantized"] = result["perplexity"] / reference["perplexity"] - 1
            print(f"{side:>12}: {100 * result['vs_dequantized']:+.3f} % vs dequantized")
    meta = {
        "gguf": str(gguf),
        "text": str(
            args.text.relative_to(REPO_ROOT) if args.text.is_relative_to(REPO_ROOT) else args.text
        ),
        "window": args.window,
        "threads": args.threads,
    }
    path = write_json(result_stem("perplexity"), {"meta": meta, "results": results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
