"""Perplexity of a GGUF file served as it is, by activation path, on a fixed text.

Run: ``python -m benchmarks.perplexity [--gguf PATH] [--text benchmarks/sonnet.txt]
[--window 512] [--threads 2] [--bos]
[--sides dequantized,fp32,int8,native,native-fp32,transformers]``

The text is tokenized by the file's tokenizer (no special tokens) and cut
into windows of ``--window`` tokens; each window is one forward pass of
tserve's own model over the file's weights, with logits at every position;
the perplexity is exp of the mean negative log-likelihood of every token
but each window's first. With ``--bos`` each window is preceded by the
file's BOS token (not scored), as a model trained with one expects; Gemma is
one. Sides, each loaded as the engine loads the file but the last:

* ``dequantized``: every product as dequantize-then-``F.linear`` (fp32
  weights and activations: the model converted to fp32);
* ``fp32``: tserve's kernels, fp32 activations against the weights
  dequantized in registers (``--gguf-activations fp32``);
* ``int8``: tserve's kernels, activations rounded to 8 bits per block of 32
  (``--gguf-activations int8``, llama.cpp's scheme);
* ``native`` and ``native-fp32``: the native runner, which serves a GGUF
  file on CPU (``--gguf-runner auto``), on int8 (the serving default) or
  fp32 activations, as it serves: each window's first token a prefill
  chunk, then every further token a decode step of its own (a served
  completion's path), the logits of each step scored;
* ``transformers``: not tserve at all: transformers' own model class for the
  architecture (``Gemma3ForCausalLM``, ``LlamaForCausalLM``, ...) over the
  file's weights dequantized to fp32 by its GGUF loader, eager attention: the
  reference a port of the architecture must meet.

Every product runs on its side's route whatever the row count (a window's
rows are the rows decode steps would see, one at a time: each row's
products are independent of the others). Prints each side's perplexity and
its difference from ``dequantized`` and from ``transformers`` (those run);
writes JSON under ``results/``.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks._results import REPO_ROOT, result_stem, write_json
from tserve.gpu.forward._attention_step import build_step
from tserve.gpu.forward._gguf import load_gguf
from tserve.gpu.forward._native import NativeModel, NativeRunner
from tserve.gpu.forward._quant import Activations, QuantizedLinear, quant_kernels
from tserve.gpu.forward._runner import ModelRunner
from tserve.gpu.gguf._file import GgufFile, tokenizer_dir
from tserve.gpu.kernels._library import set_threads
from tserve.gpu.models._directory import default_gguf
from tserve.gpu.scheduling._sequence import ScheduledChunk, Sequence
from tserve.protocol import SamplingParams

_SIDES = ("dequantized", "fp32", "int8", "native", "native-fp32", "transformers")
_BLOCK = 16


def _runner(gguf: Path, side: str, window: int, cache: Path) -> ModelRunner:
    """A runner over the file loaded for ``side``, for windows of up to ``window`` tokens."""
    activations: Activations = "int8" if side == "int8" else "fp32"
    loaded = load_gguf(
        gguf, kernels=quant_kernels(), cache_dir=cache, progress=print, activations=activations
    )
    runner = ModelRunner(loaded.model, num_blocks=window // _BLOCK + 1, block_size=_BLOCK)
    for module in runner.model.modules():
        if isinstance(module, QuantizedLinear):  # this side's route at every row count
            module.kernel_rows = 0 if side == "dequantized" else None
    return runner


def _native_runner(gguf: Path, side: str, window: int, cache: Path, threads: int) -> NativeRunner:
    """The native runner over the file, as the engine builds it, for ``window`` tokens."""
    activations: Activations = "fp32" if side == "native-fp32" else "int8"
    model = NativeModel(GgufFile(gguf, has_kernels=True), cache_dir=cache, progress=print,
                        activations=activations)  # fmt: skip
    set_threads(model.quant.library, threads)
    return NativeRunner(model, num_blocks=window // _BLOCK + 1, block_size=_BLOCK)


def _native_nll(runner: NativeRunner, tokens: list[int], scored: int) -> float:
    """:func:`_window_nll` by the native runner: a prefill chunk up to the first
    scored token's predecessor, then a decode step per token."""
    seq = Sequence("ppl", tokens, SamplingParams())
    seq.block_table = list(range(len(tokens) // _BLOCK + 1))
    first = len(tokens) - scored - 1
    rows = [runner.execute([ScheduledChunk(seq, 0, tokens[: first + 1], True)])[0]]
    for i in range(first + 1, len(tokens) - 1):
        rows.append(runner.execute([ScheduledChunk(seq, i, [tokens[i]], True)])[0])
    logits = torch.from_numpy(np.stack(rows))
    return float(F.cross_entropy(logits, torch.tensor(tokens[-scored:]), reduction="sum"))


def _transformers_model(gguf: Path) -> Any:
    """transformers' own causal LM over the file, dequantized to fp32 (its GGUF loader)."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation="eager"
    )
    print(f"transformers: {type(model).__name__} over {gguf.name} dequantized to fp32")
    return model.eval()


def _window_nll(runner: ModelRunner | NativeRunner | Any, tokens: list[int], scored: int) -> float:
    """The summed negative log-likelihood of the last ``scored`` tokens of
    ``tokens``, each given what precedes it, by a tserve runner or a
    transformers model."""
    if isinstance(runner, NativeRunner):
        return _native_nll(runner, tokens, scored)
    targets = torch.tensor(tokens[-scored:])
    with torch.inference_mode():
        if not isinstance(runner, ModelRunner):
            every: Any = runner(torch.tensor([tokens])).logits[0]
            logits = every[-scored - 1 : -1]
        else:
            seq = Sequence("ppl", tokens, SamplingParams())
            seq.block_table = list(range(len(tokens) // _BLOCK + 1))
            chunk = ScheduledChunk(seq, 0, tokens, True)
            input_ids, positions, step = build_step([chunk], runner.pool, runner.device)
            rows = torch.arange(len(tokens) - scored - 1, len(tokens) - 1)
            logits = runner.model(input_ids[0], positions[0], step, rows)
        return float(F.cross_entropy(logits.float(), targets, reduction="sum"))


def _compare(results: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """``results`` with each side's relative difference from ``dequantized`` and
    from ``transformers`` where those ran (``vs_dequantized``, ``vs_transformers``)."""
    for name in ("dequantized", "transformers"):
        reference = results.get(name)
        if reference is not None:
            for side, result in results.items():
                if side != name:
                    result[f"vs_{name}"] = result["perplexity"] / reference["perplexity"] - 1
    return results


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.perplexity", description=__doc__)
    parser.add_argument("--gguf", type=Path, default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--text", type=Path, default=REPO_ROOT / "benchmarks" / "sonnet.txt")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--sides", default=",".join(_SIDES[:3]), help=f"of {', '.join(_SIDES)}")
    parser.add_argument(
        "--bos", action="store_true", help="precede each window by the BOS token (not scored)"
    )
    args = parser.parse_args()
    sides = [side for side in args.sides.split(",") if side]
    if not sides or any(side not in _SIDES for side in sides):
        parser.error(f"--sides: a comma-separated list of {', '.join(_SIDES)}")
    if args.window < 2:
        parser.error("--window: at least 2 tokens")
    torch.set_num_threads(args.threads)
    gguf = (args.gguf or default_gguf()).resolve()

    from transformers import AutoTokenizer

    meta = {
        "gguf": str(gguf),
        "text": str(
            args.text.relative_to(REPO_ROOT) if args.text.is_relative_to(REPO_ROOT) else args.text
        ),
        "window": args.window,
        "bos": args.bos,
        "threads": args.threads,
    }
    stem = result_stem("perplexity")
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as cache:
        # The tokens come from the file's tokenizer as tserve builds it, for every side.
        tokenizer: Any = AutoTokenizer.from_pretrained(tokenizer_dir(gguf, Path(cache), print))
        tokens: list[int] = tokenizer(args.text.read_text(), add_special_tokens=False)["input_ids"]
        bos: list[int] = [tokenizer.bos_token_id] if args.bos else []
        if args.bos and tokenizer.bos_token_id is None:
            parser.error(f"--bos: {gguf.name} has no BOS token")
        after = " after BOS" if args.bos else ""
        print(f"{args.text.name}: {len(tokens)} tokens, windows of {args.window}{after}")
        for side in sides:
            if side == "transformers":
                runner: ModelRunner | NativeRunner | Any = _transformers_model(gguf)
            elif side.startswith("native"):
                runner = _native_runner(gguf, side, args.window + 1, Path(cache), args.threads)
            else:
                runner = _runner(gguf, side, args.window + len(bos), Path(cache))
            start = time.perf_counter()
            nll, count = 0.0, 0
            for first in range(0, len(tokens) - 1, args.window):
                window = tokens[first : first + args.window]
                if len(window) > 1:
                    nll += _window_nll(runner, bos + window, len(window) - 1)
                    count += len(window) - 1
            ppl = math.exp(nll / count)
            results[side] = {"perplexity": ppl, "tokens": count, "nll": nll}
            print(f"{side:>12}: perplexity {ppl:.4f} ({time.perf_counter() - start:.0f} s)")
            del runner
            write_json(stem, {"meta": meta, "results": _compare(results)})  # the sides so far
    for side, result in results.items():
        for name in ("dequantized", "transformers"):
            if f"vs_{name}" in result:
                print(f"{side:>12}: {100 * result[f'vs_{name}']:+.3f} % vs {name}")
    path = write_json(stem, {"meta": meta, "results": results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
