"""A GGUF file served as it is by the torch forward pass: its weights in their
own formats, no fp32 copy.

:func:`load_gguf` reads the file (:class:`~tserve.gpu.gguf._file.GgufFile`:
its tensors, metadata, tokenizer) and builds a
:class:`~tserve.gpu.forward._llama.PagedLlama` over its tensors:

* weights in a format :mod:`tserve.gpu.forward._quant` multiplies by (``Q8_0``,
  ``Q4_0``, ``Q4_1``, ``Q5_0``, ``Q5_1``, ``Q4_K``, ``Q5_K``, ``Q6_K``,
  ``F16``, ``BF16``) stay in it; ``F32`` ones become plain fp32 layers. Q, K
  and V are joined into one weight, and gate and up, by copying their rows
  once (in the rotate-half order tserve's RoPE uses); where their formats
  differ, each run of one format is a weight of its own, side by side
  (:class:`Concat`). Every other weight is read from the mapping where it
  lies (unless :mod:`tserve.gpu.forward._quant` packs it), so the file's pages are
  the weights' memory; the pages of the tensors that are used only as a copy
  leave the process's resident set once the model is built;
* the RoPE table is :func:`~tserve.gpu.gguf._plan.rope_tables`'s: serving a
  file imports no transformers (about 120 MB of the engine's memory).

Blocks (file IO; the first load of a file's tokenizer builds it, for seconds).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from tserve.gpu.forward._llama import LayerWeights, PagedLlama
from tserve.gpu.forward._quant import (
    Activations,
    PackedWeight,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedWeight,
    QuantKernels,
)
from tserve.gpu.gguf._file import (
    EMBEDDING,
    F32,
    OUTPUT_NORM,
    GgufConfig,
    GgufFile,
    tokenizer_dir,
)
from tserve.gpu.gguf._plan import (
    embed_scale,
    head_name,
    layer_norms,
    layer_products,
    layer_vectors,
    layer_window,
    rope_tables,
)
from tserve.gpu.models._directory import ProgressCallback

__all__ = ["Concat", "GgufModel", "load_gguf"]


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
    file: GgufFile | None = None,
) -> GgufModel:
    """Load ``path`` for tserve's own forward pass on CPU; its quantized products
    treat their activations as ``activations`` says (:mod:`tserve.gpu.forward._quant`).

    ``kernels`` None (the compiled library is absent) is an error for a file
    with any weight not in F32. Raises ModelLoadError naming the file, and
    the tensor where one is the problem. ``file``: ``path`` read already.
    """
    if file is None or kernels is None:
        file = GgufFile(path, has_kernels=kernels is not None)
    config = file.config
    progress(file.describe())
    weights = _Weights(file, kernels, activations)
    layers = []
    for i in range(config.num_hidden_layers):
        p = {name: weights.linear(*spec) for name, spec in layer_products(config, i).items()}
        norms = layer_norms(i)
        attn_norm, mlp_norm = (weights.vector(norms[n]) for n in ("attn_norm", "mlp_norm"))
        extras: dict[str, Any] = {
            name: weights.joined(names) for name, names in layer_vectors(config, i).items()
        }
        layers.append(
            LayerWeights(
                i,
                qkv=p["qkv"],
                o=p["o"],
                gate_up=p["gate_up"],
                down=p["down"],
                attn_norm=attn_norm,
                mlp_norm=mlp_norm,
                window=layer_window(config, i),
                **extras,
            )
        )
    lm_head = weights.linear([head_name(config)])
    packed_head = getattr(lm_head, "weight_q", None)
    embed: torch.nn.Module
    if config.tie_word_embeddings and isinstance(packed_head, PackedWeight) and kernels:
        embed = QuantizedEmbedding(packed_head, kernels)  # one copy of the tied rows, packed
    else:
        embed = weights.embedding(EMBEDDING)
    model = PagedLlama(
        embed=embed,
        layers=layers,
        norm=weights.vector(OUTPUT_NORM),
        lm_head=lm_head,
        rope=_rope(config),
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        eps=config.rms_norm_eps,
        vocab_size=config.vocab_size,
        local_rope=_rope(config, local=True) if config.local_rope_theta else None,
        embed_scale=embed_scale(config),
        activation=config.architecture.activation,
        attn_softcap=config.attn_softcap,
        final_softcap=config.final_softcap,
    )
    file.release_unused((t.data_ptr(), t.data_ptr() + t.nbytes) for t in _held_tensors(model))
    tokenizer = tokenizer_dir(path, cache_dir, progress, file.vocab)
    return GgufModel(path, config, tokenizer, model, file.formats, file.sampling)


def _rope(config: GgufConfig, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rope_tables(config, local)
    return torch.from_numpy(cos), torch.from_numpy(sin)


class _Weights:
    """The file's tensors as tserve modules (rows as GGUF stores them: one per output)."""

    def __init__(
        self, file: GgufFile, kernels: QuantKernels | None, activations: Activations
    ) -> None:
        self._file = file
        self._kernels = kernels
        self._activations = activations

    def linear(
        self, names: Sequence[str], permute_heads: Sequence[int | None] | None = None
    ) -> torch.nn.Module:
        """One layer whose outputs are ``names``' outputs, concatenated: a module per
        run of a format (:meth:`~tserve.gpu.gguf._file.GgufFile.parts`, the native
        runner's parts too), side by side in a :class:`Concat` where several."""
        k = self._file.in_features(names[0])
        parts = self._file.parts(names, permute_heads)
        modules = [self._module(fmt, torch.from_numpy(rows), k) for fmt, rows in parts]
        return modules[0] if len(modules) == 1 else Concat(modules)

    def _module(self, fmt: int, data: torch.Tensor, k: int) -> torch.nn.Module:
        if fmt == F32:
            linear = torch.nn.Linear(k, data.shape[0], bias=False, device="meta")
            dense = data.view(torch.float32).view(data.shape[0], k)
            linear.weight = torch.nn.Parameter(dense, requires_grad=False)
            return linear
        assert self._kernels is not None, "checked by GgufFile"
        weight = QuantizedWeight(fmt, data, data.shape[0], k)
        return QuantizedLinear(weight, self._kernels, self._activations)

    def embedding(self, name: str) -> torch.nn.Module:
        fmt, rows = self._file.rows(name)
        k = self._file.in_features(name)
        data = torch.from_numpy(rows)
        if fmt == F32:
            dense = data.view(torch.float32).view(-1, k)
            return torch.nn.Embedding(dense.shape[0], k, _weight=dense, _freeze=True)
        assert self._kernels is not None, "checked by GgufFile"
        return QuantizedEmbedding(QuantizedWeight(fmt, data, data.shape[0], k), self._kernels)

    def vector(self, name: str) -> torch.Tensor:
        return torch.from_numpy(self._file.vector(name))

    def joined(self, names: list[str]) -> torch.Tensor:
        return torch.from_numpy(self._file.joined(names))


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


class Concat(torch.nn.Module):
    """Layers of different formats side by side: their outputs concatenated."""

    def __init__(self, parts: list[torch.nn.Module]) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)
