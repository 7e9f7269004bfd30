"""A GGUF file tserve cannot serve is refused at load in one line naming what is
wrong, before any weight is used: by the engine as it loads, and by
``python -m tserve serve FILE`` (that line on stderr, no traceback, exit 1).

Each bad file is the tiny Llama written by the ``gguf`` package with one
thing wrong: an architecture tserve does not run, a tensor in a format it has
no kernel for, a file cut short, a weight whose shape disagrees with the
metadata, a vocabulary whose size the embedding, the output head, the
metadata or the tokenizer disagree on.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.gpu.cores import generated, small_core
from tests.gpu.gguf_files import write_gguf
from tests.gpu.tiny_vocabs import PIECES, sentencepiece_vocab
from tserve.gpu.forward._runner import ModelRunner
from tserve.gpu.models._directory import ModelLoadError
from tserve.protocol import AddRequest, SamplingParams

_SUPPORTED = "llama, qwen2, qwen3, phi3, gemma2, gemma3"


_FORMATS = "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K"


def _truncated(model_dir: Path, out: Path) -> tuple[Path, str]:
    path = write_gguf(model_dir, out, "Q8_0")
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[: size - 1000])  # the last tensor's data, in part
    return path, (
        f"m.gguf: the file is cut short: it has {size - 1000:,} bytes and its contents "
        f"run to byte {size:,} at least"
    )


def _cut_in_metadata(model_dir: Path, out: Path) -> tuple[Path, str]:
    path = write_gguf(model_dir, out, "Q8_0")
    path.write_bytes(path.read_bytes()[:300])  # inside the metadata's key-value pairs
    return path, "m.gguf: the file is cut short: it has 300 bytes and its contents run to byte 30{}"


def _wrong(**options: Any) -> Callable[[Path, Path], Path]:
    return lambda model_dir, out: write_gguf(model_dir, out, "Q8_0", **options)


# name -> writes the bad file (given the model directory and where), and its one line
# (or a function of both giving the file and its line)
_BAD_FILES: dict[str, Callable[[Path, Path], tuple[Path, str]]] = {
    "architecture": lambda d, out: (
        _wrong(architecture="mamba")(d, out),
        f"m.gguf: architecture 'mamba' is not supported; tserve runs {_SUPPORTED}",
    ),
    "format": lambda d, out: (
        _wrong(formats={"blk.1.attn_k.weight": "IQ4_NL"})(d, out),
        "m.gguf: tensor 'blk.1.attn_k.weight' is IQ4_NL, which tserve has no kernel for "
        f"(it runs {_FORMATS}); --dequantize serves the file as fp32",
    ),
    "truncated": _truncated,
    "truncated-metadata": _cut_in_metadata,
    "shape": lambda d, out: (
        _wrong(extra_tensors={"blk.0.attn_q.weight": np.ones((32, 64), np.float32)})(d, out),
        "m.gguf: tensor 'blk.0.attn_q.weight' has shape [64, 32], not the [64, 64] its "
        "metadata give it",
    ),
    "head-vocabulary": lambda d, out: (
        _wrong(extra_tensors={"output.weight": np.ones((500, 64), np.float32)})(d, out),
        "m.gguf: the vocabulary has 500 tokens by the output head ('output.weight') "
        "but 512 by the embedding ('token_embd.weight')",
    ),
    "tokenizer-vocabulary": lambda d, out: (
        _wrong(vocab=sentencepiece_vocab(PIECES, size=300).write)(d, out),
        "m.gguf: the vocabulary has 300 tokens by its tokenizer but 512 by the "
        "embedding ('token_embd.weight')",
    ),
}


@pytest.fixture(params=sorted(_BAD_FILES))
def bad_file(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path: Path
) -> tuple[Path, str]:
    """A bad file and its line (a ``{}`` in the line stands for what follows it:
    where a cut in the metadata leaves a read depends on the key)."""
    return _BAD_FILES[request.param](tiny_model_dir, tmp_path / "gguf" / "m.gguf")


def _matches(message: str, line: str) -> bool:
    before, cut, _ = line.partition("{}")
    return message.startswith(before) and "\n" not in message if cut else message == line


def test_the_engine_refuses_a_bad_file_at_load_in_one_line(
    bad_file: tuple[Path, str], tmp_path: Path
) -> None:
    path, line = bad_file
    with pytest.raises(ModelLoadError) as refused:
        small_core(path, cache_dir=str(tmp_path / "cache"))
    assert _matches(str(refused.value), line), str(refused.value)


def test_serve_prints_the_one_line_and_exits_1(bad_file: tuple[Path, str], tmp_path: Path) -> None:
    path, line = bad_file
    options = ["--port", "0", "--embedding-model", "none", "--cache-dir", str(tmp_path / "cache")]
    done = subprocess.run(
        [sys.executable, "-m", "tserve", "serve", str(path), *options],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    prefix = f"tserve: cannot serve: the model '{path}' failed to load: engine failed to start: "
    assert last.startswith(prefix), done.stderr
    assert _matches(last.removeprefix(prefix), line), last


def test_dequantize_serves_a_file_whose_format_has_no_kernel(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """As the format's refusal says."""
    formats = {"blk.1.attn_k.weight": "IQ4_NL"}
    path = write_gguf(tiny_model_dir, tmp_path / "gguf" / "m.gguf", "Q8_0", formats=formats)
    core = small_core(path, cache_dir=str(tmp_path / "cache"), dequantize=True)
    assert isinstance(core.runner, ModelRunner)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert len(generated(core, AddRequest("r", [5, 6, 7], params))) == 3
