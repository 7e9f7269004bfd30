"""The decoder architectures tserve's own forward pass runs, as data; no torch.

One forward pass (:mod:`tserve.gpu._llama`) and one C decoder
(``_decoder_kernels.c``) run every architecture here: each is an
:class:`Architecture`, a row of what sets it apart from Llama's layer. A
GGUF file names its architecture in ``general.architecture``, a transformers
directory in its config's ``model_type``; :func:`gguf_architecture` and
:func:`hf_architecture` look them up. Adding a family that differs only in
what the fields below already say is a row in :data:`ARCHITECTURES`.
"""

from __future__ import annotations

import dataclasses
from typing import Final

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "UnknownArchitecture",
    "gguf_architecture",
    "hf_architecture",
]


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What one decoder family's layer does beyond Llama's.

    Every layer: RMSNorm, Q/K/V product, RoPE (rotate-half) on Q and K,
    attention, output product, add; RMSNorm, gate/up product,
    ``silu(gate) * up``, down product, add. The fields below change that.
    """

    name: str
    """The GGUF ``general.architecture`` value."""
    model_types: tuple[str, ...]
    """transformers ``model_type`` values of the same layer."""
    qkv_bias: bool = False
    """Q, K and V have biases (Qwen2): GGUF ``blk.N.attn_{q,k,v}.bias``."""
    qk_norm: bool = False
    """Each Q and K head goes through an RMSNorm of its own weight (``head_dim``
    wide, shared by the heads) before RoPE (Qwen3): GGUF
    ``blk.N.attn_{q,k}_norm.weight``."""
    fused_products: bool = False
    """Q, K and V are one weight, and gate and up another (Phi-3): transformers'
    ``qkv_proj`` and ``gate_up_proj``, GGUF ``blk.N.attn_qkv.weight`` and
    ``blk.N.ffn_up.weight`` (gate rows first). The forward pass joins them
    anyway, so they are used as they are."""
    gguf_interleaved_qk: bool = False
    """llama.cpp's converter stores Q and K rows (and biases) in interleaved-pair
    order (its ``LlamaModel.permute``, for llama.cpp's non-NeoX RoPE); tserve puts
    them back in rotate-half order. The other families keep transformers' order."""


ARCHITECTURES: Final[dict[str, Architecture]] = {
    arch.name: arch
    for arch in (
        Architecture("llama", ("llama", "mistral"), gguf_interleaved_qk=True),
        Architecture("qwen2", ("qwen2",), qkv_bias=True),
        Architecture("qwen3", ("qwen3",), qk_norm=True),
        Architecture("phi3", ("phi3",), fused_products=True),
    )
}
"""Every architecture tserve's own forward pass runs, by GGUF name."""

_BY_MODEL_TYPE: Final = {t: arch for arch in ARCHITECTURES.values() for t in arch.model_types}


class UnknownArchitecture(ValueError):
    """An architecture tserve's own forward pass does not run; its message is one
    line naming it and listing those it runs."""


def gguf_architecture(name: object) -> Architecture:
    """The architecture a GGUF file's ``general.architecture`` names; raises
    :class:`UnknownArchitecture` for any other."""
    arch = ARCHITECTURES.get(name) if isinstance(name, str) else None
    if arch is None:
        raise UnknownArchitecture(
            f"architecture {name!r} is not supported; tserve runs {', '.join(ARCHITECTURES)}"
        )
    return arch


def hf_architecture(model_type: object) -> Architecture | None:
    """The architecture of a transformers config's ``model_type``, or None."""
    return _BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
