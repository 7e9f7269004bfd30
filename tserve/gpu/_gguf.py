"""A GGUF file served as it is: its weights in their own formats, no fp32 copy.

:func:`load_gguf` maps the file (``gguf.GGUFReader``, copy-on-write, so
nothing is written back) and builds a :class:`~tserve.gpu._llama.PagedLlama`
over its tensors:

* weights in a format :mod:`tserve.gpu._quant` multiplies by (``Q8_0``,
  ``Q4_0``, ``Q4_1``, ``Q4_K``, ``Q5_K``, ``Q6_K``, ``F16``, ``BF16``) stay
  in it; ``F32`` ones become plain
  fp32 layers. Q, K and V are joined into one weight, and gate and up, by
  copying their rows once (llama.cpp's converter stores Q and K rows in
  interleaved-pair RoPE order; the copy puts them back in the rotate-half
  order tserve's RoPE uses). Every other weight is read from the mapping
  where it lies (unless :mod:`tserve.gpu._quant` packs it), so the file's
  pages are the weights' memory; the pages of the tensors that are used
  only as a copy leave the process's resident set once the model is built
  (``madvise`` ``MADV_DONTNEED``: the file keeps them, nothing reads them);
* any other format is a :class:`~tserve.gpu._models.ModelLoadError` naming
  the tensor and its format (``--dequantize`` serves the file through the
  fp32 conversion instead);
* the architecture comes from the file's metadata (``llama``: Llama,
  SmolLM, Mistral-style files), read into a :class:`GgufConfig`, and the
  RoPE table is computed from it: serving a file imports no transformers
  (about 120 MB of the engine's memory); the tokenizer from files beside it
  (``tokenizer.json`` in the same directory) or else from its metadata,
  converted once by transformers into a small cache directory, which the API
  process reads as it reads any model directory's.

Blocks (file IO; the first load of a file's tokenizer takes a few seconds).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import mmap
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch

from tserve.gpu._llama import LayerWeights, PagedLlama
from tserve.gpu._models import ModelLoadError, ProgressCallback, publish_dir, staging_dir
from tserve.gpu._quant import (
    FORMATS,
    Activations,
    PackedWeight,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedWeight,
    QuantKernels,
)
from tserve.gpu._sampling_defaults import GGUF_SAMPLING_PREFIX

__all__ = ["GgufConfig", "GgufModel", "load_gguf", "rope", "sampling_metadata", "tokenizer_dir"]

_ARCHITECTURE: Final = "llama"
_F32: Final = 0
_TOKENIZER_COMPLETE: Final = ".tserve-tokenizer"


@dataclasses.dataclass(frozen=True)
class GgufConfig:
    """What a file's metadata says of its model, under the names of a
    transformers ``LlamaConfig`` (the engine reads either alike)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_linear_factor: float  # positions are divided by it (linear scaling); 1.0: none
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None


@dataclasses.dataclass
class GgufModel:
    """A loaded GGUF: ``config`` is what its metadata describes;
    ``tokenizer_dir`` holds its tokenizer files; ``sampling`` its
    ``general.sampling.*`` metadata (full key -> value)."""

    path: Path
    config: GgufConfig
    tokenizer_dir: Path
    model: PagedLlama
    formats: dict[str, int]  # GGUF format name -> tensors in it
    sampling: dict[str, Any] = dataclasses.field(default_factory=dict)


def load_gguf(
    path: Path,
    *,
    kernels: QuantKernels | None,
    cache_dir: Path,
    progress: ProgressCallback,
    activations: Activations = "fp32",
) -> GgufModel:
    """Load ``path`` for tserve's own forward pass on CPU; its quantized products
    treat their activations as ``activations`` says (:mod:`tserve.gpu._quant`).

    ``kernels`` None (the compiled library is absent) is an error for a file
    with any weight not in F32. Raises ModelLoadError naming the file, and
    the tensor where one is the problem.
    """
    try:
        reader = _reader(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {str(path)!r} as GGUF: {exc}") from exc
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    meta = _Metadata(reader, path)
    arch = meta.get("general.architecture")
    if arch != _ARCHITECTURE:
        raise ModelLoadError(
            f"{path.name}: architecture {arch!r}: tserve runs GGUF files of {_ARCHITECTURE!r} "
            "as they are; --dequantize serves others through transformers"
        )
    formats = _check_formats(path, tensors.values(), kernels)
    config = _config(meta, tensors)
    progress(f"{path.name}: {', '.join(f'{n} {k}' for k, n in sorted(formats.items()))} tensors")
    weights = _Weights(tensors, path, kernels, activations)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    layers = [
        LayerWeights(
            i,
            qkv=weights.linear(
                [f"blk.{i}.attn_q.weight", f"blk.{i}.attn_k.weight", f"blk.{i}.attn_v.weight"],
                permute_heads=(heads, kv_heads, None),
            ),
            o=weights.linear([f"blk.{i}.attn_output.weight"]),
            gate_up=weights.linear([f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight"]),
            down=weights.linear([f"blk.{i}.ffn_down.weight"]),
            attn_norm=weights.vector(f"blk.{i}.attn_norm.weight"),
            mlp_norm=weights.vector(f"blk.{i}.ffn_norm.weight"),
        )
        for i in range(config.num_hidden_layers)
    ]
    head_name = "token_embd.weight" if config.tie_word_embeddings else "output.weight"
    lm_head = weights.linear([head_name])
    packed_head = getattr(lm_head, "weight_q", None)
    embed: torch.nn.Module
    if config.tie_word_embeddings and isinstance(packed_head, PackedWeight) and kernels:
        embed = QuantizedEmbedding(packed_head, kernels)  # one copy of the tied rows, packed
    else:
        embed = weights.embedding("token_embd.weight")
    model = PagedLlama(
        embed=embed,
        layers=layers,
        norm=weights.vector("output_norm.weight"),
        lm_head=lm_head,
        rope=rope(config),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=config.head_dim,
        eps=config.rms_norm_eps,
        vocab_size=config.vocab_size,
    )
    _release_unused(tensors.values(), model)
    tokenizer = tokenizer_dir(path, cache_dir, progress)
    sampling = meta.with_prefix(GGUF_SAMPLING_PREFIX)
    return GgufModel(path, config, tokenizer, model, formats, sampling)


def sampling_metadata(path: Path) -> dict[str, Any]:
    """``path``'s ``general.sampling.*`` metadata (full key -> value), for a file
    served through its fp32 conversion, which keeps none of it. Blocking: the
    whole metadata is read (seconds for a large vocabulary)."""
    try:
        reader = _reader(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {str(path)!r} as GGUF: {exc}") from exc
    return _Metadata(reader, path).with_prefix(GGUF_SAMPLING_PREFIX)


def rope(config: GgufConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each fp32 ``[max_position_embeddings, head_dim / 2]``:
    the same fp32 operations as transformers' default and linear RoPE, so the
    same values as :func:`~tserve.gpu._llama.rope_table` makes from them."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents) / config.rope_linear_factor
    positions = torch.arange(config.max_position_embeddings).float()
    angles = torch.outer(positions, inv_freq)
    return angles.cos(), angles.sin()


def _reader(path: Path) -> Any:
    """A ``gguf.GGUFReader`` of ``path`` (copy-on-write mapping) over a plain
    ndarray view of its mapping: slicing the ``np.memmap`` it makes costs a
    memmap object per metadata item (30 s for SmolLM2's 49k-token vocabulary
    on a busy machine, 5 s this way). Tensors' data stay views of the mapping."""
    from gguf import GGUFReader

    class Reader(GGUFReader):
        _plain: np.ndarray

        @property  # type: ignore[override]
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapping: np.ndarray) -> None:
            self._plain = np.asarray(mapping)

    return Reader(path, "c")


class _Metadata:
    def __init__(self, reader: Any, path: Path) -> None:
        self._fields = reader.fields
        self._path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def with_prefix(self, prefix: str) -> dict[str, Any]:
        return {
            key: field.contents() for key, field in self._fields.items() if key.startswith(prefix)
        }

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self._path.name}: no {key!r} in its metadata")
        return value


def _check_formats(path: Path, tensors: Any, kernels: QuantKernels | None) -> dict[str, int]:
    counts: dict[str, int] = {}
    for tensor in tensors:
        name = tensor.tensor_type.name
        if name != "F32" and name not in FORMATS:
            raise ModelLoadError(
                f"{path.name}: tensor {tensor.name!r} is {name}, which tserve has no kernel "
                f"for (it runs F32, {', '.join(FORMATS)}); --dequantize serves the file as fp32"
            )
        if name != "F32" and kernels is None:
            raise ModelLoadError(
                f"{path.name}: tensor {tensor.name!r} is {name}, and tserve's compiled kernels "
                "are not built (pip install -e . builds them); --dequantize serves it as fp32"
            )
        counts[name] = counts.get(name, 0) + 1
    return counts


def _config(meta: _Metadata, tensors: dict[str, Any]) -> GgufConfig:
    """The model that the metadata describes."""
    arch = _ARCHITECTURE
    if "rope_freqs.weight" in tensors or meta.get(f"{arch}.rope.scaling.type") not in (
        None,
        "none",
        "linear",
    ):
        raise ModelLoadError(
            f"{meta._path.name}: its RoPE scaling is not one tserve reads from GGUF; "
            "--dequantize serves it through transformers"
        )
    heads = int(meta.need(f"{arch}.attention.head_count"))
    hidden = int(meta.need(f"{arch}.embedding_length"))
    linear = meta.get(f"{arch}.rope.scaling.type") == "linear"
    embed = tensors["token_embd.weight"]
    return GgufConfig(
        vocab_size=int(embed.shape[1]),
        hidden_size=hidden,
        intermediate_size=int(meta.need(f"{arch}.feed_forward_length")),
        num_hidden_layers=int(meta.need(f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_linear_factor=float(meta.need(f"{arch}.rope.scaling.factor")) if linear else 1.0,
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )


class _Weights:
    """The file's tensors as tserve modules (rows as GGUF stores them: one per output)."""

    def __init__(
        self,
        tensors: dict[str, Any],
        path: Path,
        kernels: QuantKernels | None,
        activations: Activations,
    ) -> None:
        self._tensors = tensors
        self._path = path
        self._kernels = kernels
        self._activations = activations

    def _tensor(self, name: str) -> Any:
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{self._path.name}: no tensor {name!r}")
        return tensor

    def _rows(self, name: str, permute_heads: int | None) -> tuple[int, np.ndarray]:
        """``(format, raw rows [out, bytes])``, Q/K rows back in rotate-half order."""
        tensor = self._tensor(name)
        out = int(tensor.shape[1]) if len(tensor.shape) > 1 else 1
        rows = tensor.data.view(np.uint8).reshape(out, -1)
        if permute_heads is not None:
            # GGUF rows of a head: pairs (i, i + D/2) interleaved; back to halves.
            rows = rows.reshape(permute_heads, -1, 2, rows.shape[1]).swapaxes(1, 2)
            rows = rows.reshape(out, -1)
        return int(tensor.tensor_type), rows

    def linear(
        self, names: Sequence[str], permute_heads: Sequence[int | None] | None = None
    ) -> torch.nn.Module:
        """One layer whose outputs are ``names``' outputs, concatenated."""
        heads = permute_heads or [None] * len(names)
        parts = [self._rows(name, h) for name, h in zip(names, heads, strict=True)]
        k = int(self._tensor(names[0]).shape[0])
        if len({fmt for fmt, _ in parts}) > 1:
            return _Concat([self.linear([name], [h]) for name, h in zip(names, heads, strict=True)])
        fmt = parts[0][0]
        rows = parts[0][1] if len(parts) == 1 else np.concatenate([r for _, r in parts])
        data = torch.from_numpy(rows)
        if fmt == _F32:
            linear = torch.nn.Linear(k, data.shape[0], bias=False, device="meta")
            dense = data.view(torch.float32).view(data.shape[0], k)
            linear.weight = torch.nn.Parameter(dense, requires_grad=False)
            return linear
        assert self._kernels is not None, "checked by _check_formats"
        weight = QuantizedWeight(fmt, data, data.shape[0], k)
        return QuantizedLinear(weight, self._kernels, self._activations)

    def embedding(self, name: str) -> torch.nn.Module:
        fmt, rows = self._rows(name, None)
        k = int(self._tensor(name).shape[0])
        data = torch.from_numpy(rows)
        if fmt == _F32:
            dense = data.view(torch.float32).view(-1, k)
            return torch.nn.Embedding(dense.shape[0], k, _weight=dense, _freeze=True)
        assert self._kernels is not None, "checked by _check_formats"
        return QuantizedEmbedding(QuantizedWeight(fmt, data, data.shape[0], k), self._kernels)

    def vector(self, name: str) -> torch.Tensor:
        tensor = self._tensor(name)
        if int(tensor.tensor_type) != _F32:
            return torch.from_numpy(np.asarray(tensor.data, dtype=np.float32).reshape(-1))
        return torch.from_numpy(tensor.data.reshape(-1))


_MADV_DONTNEED: Final = getattr(mmap, "MADV_DONTNEED", None)


@functools.cache
def _madvise() -> Any:
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes, madvise.restype = (
        [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int],
        ctypes.c_int,
    )
    return madvise


def _release_unused(tensors: Iterable[Any], model: torch.nn.Module) -> None:
    """Let go of the pages of every tensor of the file whose bytes the model
    does not hold in place (it holds a copy: joined, reordered or packed), by
    :func:`_release_pages`. Blocks for a moment (one pass over the modules)."""
    held = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in _held_tensors(model)]
    for tensor in tensors:
        low = tensor.data.ctypes.data
        high = low + tensor.data.nbytes
        if not any(start < high and low < end for start, end in held):
            _release_pages(tensor.data)


def _held_tensors(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    """Every tensor a module of ``model`` holds: parameters, buffers, and the
    tensors of its attributes (a quantized weight's bytes among them)."""
    for module in model.modules():
        yield from module.parameters(recurse=False)
        yield from module.buffers(recurse=False)
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                yield value
            elif dataclasses.is_dataclass(value):
                for field in dataclasses.fields(value):
                    item = getattr(value, field.name)
                    if isinstance(item, torch.Tensor):
                        yield item


def _release_pages(data: np.ndarray) -> None:
    """Drop the whole pages inside ``data``, a part of the file's private
    mapping that nothing wrote, from this process's resident set (``madvise``
    ``MADV_DONTNEED``): the page cache keeps them, and a later read faults them
    in again from the file, unchanged. Where there is no ``MADV_DONTNEED``, or
    the call fails, they stay resident; nothing else changes."""
    if _MADV_DONTNEED is None:
        return
    page = mmap.PAGESIZE
    start = -(-data.ctypes.data // page) * page
    end = (data.ctypes.data + data.nbytes) // page * page
    if end > start:
        _madvise()(start, end - start, _MADV_DONTNEED)


class _Concat(torch.nn.Module):
    """Layers of different formats side by side: their outputs concatenated."""

    def __init__(self, parts: list[torch.nn.Module]) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def tokenizer_dir(path: Path, cache_dir: Path, progress: ProgressCallback) -> Path:
    """The directory of the file's tokenizer files: beside it, or converted once."""
    if (path.parent / "tokenizer.json").is_file():
        return path.parent
    stat = path.stat()
    key = hashlib.blake2b(
        f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode(), digest_size=8
    ).hexdigest()
    target = cache_dir / "gguf-tokenizers" / f"{path.stem}-{key}"
    if (target / _TOKENIZER_COMPLETE).is_file():
        return target
    progress(f"converting {path.name}'s tokenizer into {target} (once)")
    from transformers import AutoTokenizer, GenerationConfig

    target.parent.mkdir(parents=True, exist_ok=True)
    with staging_dir(target.parent) as staging:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        tokenizer.save_pretrained(staging)
        eos = tokenizer.eos_token_id
        if eos is not None:
            GenerationConfig(eos_token_id=eos).save_pretrained(staging)  # type: ignore[no-untyped-call]
        publish_dir(staging, target, _TOKENIZER_COMPLETE, f"{path}\n")
    return target
