"""Benchmark prompts made offline: ``random`` token prompts and ``sonnet`` line picks.

Both need a tokenizer to hit a token length. A :class:`LocalTokenizer` reads a
model directory (``tokenizer.json`` through ``tokenizers``, else
``AutoTokenizer``), which works for any server; a :class:`ServerTokenizer`
asks the server's ``/tokenize`` and ``/detokenize`` (tserve and vLLM have
them) when no directory is at hand.

* ``random`` (like vLLM's): each request draws an input length and an output
  length uniformly from ``[L·(1-r), L·(1+r)]`` (``r`` = range ratio), then that
  many token ids uniformly from the vocabulary less its special tokens (with a
  server tokenizer, from the ids of the sonnet text), and sends their decoded
  text, re-encoded and cut to the length so the prompt's text and count agree.
* ``sonnet`` (like vLLM's): ``"Pick as many lines as you can from these poem
  lines:\\n"`` followed by the first lines of the shipped sonnets (the prefix,
  shared by every request, ``--sonnet-prefix-len`` tokens) and lines drawn at
  random until about ``--sonnet-input-len`` tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

__all__ = [
    "SONNET_PATH",
    "BenchRequest",
    "LocalTokenizer",
    "ServerTokenizer",
    "Tokenizer",
    "random_requests",
    "sonnet_requests",
]

SONNET_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "sonnet.txt"
SONNET_BASE_PROMPT = "Pick as many lines as you can from these poem lines:\n"


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One prompt to send; ``prompt_len`` is its length in tokens by the client's count."""

    prompt: str
    prompt_len: int
    output_len: int


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def sample_ids(self) -> list[int]:
        """The token ids a random prompt draws from."""
        ...


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json")
"""A directory LocalTokenizer can read holds one of these."""


class LocalTokenizer:
    """The tokenizer of a local model directory. Raises OSError or ValueError for a
    path it cannot read one from."""

    def __init__(self, directory: str | Path) -> None:
        path = Path(directory)
        if not path.is_dir():
            raise ValueError(
                "not a tokenizer or model directory (for a GGUF file, leave --tokenizer "
                "out: the server's /tokenize and /detokenize serve its vocabulary)"
            )
        if not any((path / name).is_file() for name in _TOKENIZER_FILES):
            raise ValueError(f"none of {', '.join(_TOKENIZER_FILES)} in it")
        self._fast: Any = None  # a tokenizers.Tokenizer, when tokenizer.json exists
        self._auto: Any = None  # else a transformers tokenizer
        if (path / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as Fast

            self._fast = Fast.from_file(str(path / "tokenizer.json"))
            vocab = int(self._fast.get_vocab_size(with_added_tokens=True))
            decoder = self._fast.get_added_tokens_decoder()
            special = {int(i) for i, t in decoder.items() if t.special}
        else:
            from transformers import AutoTokenizer

            self._auto = AutoTokenizer.from_pretrained(str(path))
            vocab = len(self._auto)
            special = {int(i) for i in self._auto.all_special_ids}
        self._ids = [i for i in range(vocab) if i not in special]

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            return list(self._fast.encode(text, add_special_tokens=False).ids)
        return list(self._auto.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return str(self._fast.decode(ids, skip_special_tokens=False))
        return str(self._auto.decode(ids))

    def sample_ids(self) -> list[int]:
        return self._ids


class ServerTokenizer:
    """``/tokenize`` and ``/detokenize`` of a running server (blocking calls)."""

    def __init__(self, base_url: str, model: str | None, headers: dict[str, str]) -> None:
        self._client = httpx.Client(base_url=base_url, headers=headers, timeout=60)
        self._model = model
        self._ids = sorted(set(self.encode(SONNET_PATH.read_text())))

    def _post(self, path: str, body: dict[str, object]) -> dict[str, object]:
        if self._model is not None:
            body["model"] = self._model
        response = self._client.post(path, json=body)
        response.raise_for_status()
        result: dict[str, object] = response.json()
        return result

    def encode(self, text: str) -> list[int]:
        tokens = self._post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
        assert isinstance(tokens, list)
        return [int(t) for t in tokens]

    def decode(self, ids: list[int]) -> str:
        return str(self._post("/detokenize", {"tokens": ids})["prompt"])

    def sample_ids(self) -> list[int]:
        return self._ids


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    lo, hi = max(1, round(mean * (1 - ratio))), max(1, round(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def random_requests(
    tokenizer: Tokenizer,
    n: int,
    *,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
) -> list[BenchRequest]:
    """``n`` prompts of random tokens (see the module's docstring)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    rng = random.Random(seed)
    pool = tokenizer.sample_ids()
    out: list[BenchRequest] = []
    for _ in range(n):
        want = _length(rng, input_len, range_ratio)
        ids = [rng.choice(pool) for _ in range(want)]
        ids = tokenizer.encode(tokenizer.decode(ids))[:want]  # text and count agree
        text = tokenizer.decode(ids)
        out.append(
            BenchRequest(text, len(tokenizer.encode(text)), _length(rng, output_len, range_ratio))
        )
    return out


def sonnet_requests(
    tokenizer: Tokenizer,
    n: int,
    *,
    input_len: int,
    output_len: int,
    prefix_len: int,
    seed: int,
    path: Path = SONNET_PATH,
) -> list[BenchRequest]:
    """``n`` sonnet prompts of about ``input_len`` tokens sharing a ``prefix_len`` prefix."""
    lines = [line + "\n" for line in path.read_text().splitlines() if line.strip()]
    base = len(tokenizer.encode(SONNET_BASE_PROMPT))
    per_line = sum(len(tokenizer.encode(line)) for line in lines) / len(lines)
    if input_len <= base or prefix_len > input_len:
        raise ValueError(
            f"--sonnet-input-len must exceed the base prompt ({base} tokens) "
            "and be at least --sonnet-prefix-len"
        )
    n_input = max(1, round((input_len - base) / per_line))
    n_prefix = min(n_input, max(0, round((prefix_len - base) / per_line)))
    prefix = lines[:n_prefix]
    rng = random.Random(seed)
    out: list[BenchRequest] = []
    for _ in range(n):
        picked = prefix + rng.choices(lines, k=n_input - n_prefix)
        text = SONNET_BASE_PROMPT + "".join(picked)
        out.append(BenchRequest(text, len(tokenizer.encode(text)), output_len))
    return out
