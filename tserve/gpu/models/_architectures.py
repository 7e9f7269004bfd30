"""The decoder architectures tserve's own forward pass runs, as data; no torch.

One forward pass (:mod:`tserve.gpu.forward._llama`) and one C decoder
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

import numpy as np

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "UnknownArchitecture",
    "gguf_architecture",
    "hf_architecture",
    "soft_cap",
]


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What one decoder family's layer does beyond Llama's.

    Every layer: RMSNorm, Q/K/V product, RoPE (rotate-half) on Q and K,
    attention (scaled by ``head_dim ** -0.5``, or by transformers'
    ``query_pre_attn_scalar ** -0.5`` where a config states it), output
    product, add; RMSNorm, gate/up product, ``silu(gate) * up``, down
    product, add. The fields below change that.
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
    activation: str = "silu"
    """The MLP gate's activation: ``silu`` or ``gelu_tanh`` (Gemma's
    ``gelu_pytorch_tanh``)."""
    norm_offset: float = 0.0
    """transformers stores every RMSNorm weight (Q/K head norms included) less
    this and multiplies by weight + offset (Gemma: 1); llama.cpp's converter
    writes the sum, so a GGUF file's weights are used as they are."""
    post_norms: bool = False
    """RMSNorms of the attention's and the MLP's outputs before each is added to
    the residual (Gemma 2/3): GGUF ``blk.N.post_attention_norm.weight`` and
    ``blk.N.post_ffw_norm.weight``."""
    embed_scale: bool = False
    """The embeddings are multiplied by sqrt(hidden size) (Gemma)."""
    sliding_pattern: int = 0
    """In a GGUF file, every ``sliding_pattern``-th layer attends globally and
    the others within ``{arch}.attention.sliding_window`` (llama.cpp's fixed
    pattern for the family; 0: every layer global). transformers configs say it
    per layer (``layer_types``)."""
    local_rope_base: float = 0.0
    """The RoPE base of sliding-window layers where a GGUF file states none
    (``{arch}.rope.freq_base_swa``); 0: the global one."""
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    """Soft-caps (``cap * tanh(x / cap)``) of the attention scores and of the
    logits where a GGUF file states none (``{arch}.attn_logit_softcapping``,
    ``{arch}.final_logit_softcapping``; llama.cpp's defaults for the family);
    0: none. transformers configs state theirs."""
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
        Architecture(
            "gemma2",
            ("gemma2",),
            activation="gelu_tanh",
            norm_offset=1.0,
            post_norms=True,
            embed_scale=True,
            sliding_pattern=2,
            attn_softcap=50.0,
            final_softcap=30.0,
        ),
        Architecture(
            "gemma3",
            ("gemma3_text",),
            qk_norm=True,
            activation="gelu_tanh",
            norm_offset=1.0,
            post_norms=True,
            embed_scale=True,
            sliding_pattern=6,
            local_rope_base=10000.0,
        ),
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


def soft_cap(logits: np.ndarray, cap: float) -> None:
    """``logits`` (fp32) become ``cap * tanh(logits / cap)`` in place, in
    transformers' order (divide, tanh, multiply): both runners' final soft-cap,
    one function so that they agree bit for bit."""
    c = np.float32(cap)
    np.multiply(np.tanh(logits / c), c, out=logits)
