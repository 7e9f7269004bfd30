"""The GGUF weight plan: the model a file's metadata describe
(:class:`GgufConfig`), which tensors of a file make each part of a layer,
per architecture, and the tables derived from its config (RoPE, embedding
scale, sliding windows). The torch builder (:mod:`tserve.gpu.forward._gguf`) and the
native one (:mod:`tserve.gpu.forward._native`) both read it, so the two runners hold
the same parts. No torch, no file IO.
"""

from __future__ import annotations

import dataclasses
from typing import Final

import numpy as np

from tserve.gpu.models._architectures import Architecture

__all__ = [
    "EMBEDDING",
    "OUTPUT_NORM",
    "GgufConfig",
    "embed_scale",
    "head_name",
    "layer_norms",
    "layer_products",
    "layer_vectors",
    "layer_window",
    "rope_tables",
    "tensor_shapes",
]


EMBEDDING: Final = "token_embd.weight"
OUTPUT_NORM: Final = "output_norm.weight"


@dataclasses.dataclass(frozen=True)
class GgufConfig:
    """What a file's metadata says of its model, under the names of a
    transformers ``LlamaConfig`` (the engine reads either alike), and its
    architecture."""

    architecture: Architecture
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
    # Every id that ends a generation (EOS, EOT, end-of-turn markers), by the
    # file's vocabulary as llama.cpp reads it.
    end_of_generation_ids: tuple[int, ...] = ()
    sliding_window: int = 0  # the keys of a sliding-window layer (0: none is)
    attn_softcap: float = 0.0  # attention scores soft-capped to it (0: not)
    final_softcap: float = 0.0  # logits soft-capped to it (0: not)
    # Each inverse frequency is divided by its factor (``rope_freqs.weight``: Llama 3.1's
    # "llama3" scaling as llama.cpp's converter writes it); empty: none.
    rope_freq_factors: tuple[float, ...] = ()
    local_rope_theta: float = 0.0  # the RoPE base of sliding-window layers (0: rope_theta)


def head_name(config: GgufConfig) -> str:
    """The output head's tensor: the embedding's where they are tied."""
    return EMBEDDING if config.tie_word_embeddings else "output.weight"


def layer_products(config: GgufConfig, i: int) -> dict[str, tuple[list[str], list[int | None]]]:
    """Layer ``i``'s four products (``qkv``, ``o``, ``gate_up``, ``down``): the
    tensors each joins, in order, and the heads to permute each by (Q and K
    where the file interleaves them)."""
    heads: int | None = config.num_attention_heads
    kv_heads: int | None = config.num_key_value_heads
    if not config.architecture.gguf_interleaved_qk:
        heads = kv_heads = None
    block = f"blk.{i}"
    products: dict[str, tuple[list[str], list[int | None]]] = {
        "qkv": (
            [f"{block}.attn_q.weight", f"{block}.attn_k.weight", f"{block}.attn_v.weight"],
            [heads, kv_heads, None],
        ),
        "o": ([f"{block}.attn_output.weight"], [None]),
        "gate_up": ([f"{block}.ffn_gate.weight", f"{block}.ffn_up.weight"], [None, None]),
        "down": ([f"{block}.ffn_down.weight"], [None]),
    }
    if config.architecture.fused_products:
        products["qkv"] = ([f"{block}.attn_qkv.weight"], [None])
        products["gate_up"] = ([f"{block}.ffn_up.weight"], [None])
    return products


def layer_norms(i: int) -> dict[str, str]:
    """Layer ``i``'s two RMSNorm weights (``attn_norm``, ``mlp_norm``)."""
    return {"attn_norm": f"blk.{i}.attn_norm.weight", "mlp_norm": f"blk.{i}.ffn_norm.weight"}


def layer_vectors(config: GgufConfig, i: int) -> dict[str, list[str]]:
    """Layer ``i``'s optional fp32 vectors that its architecture has, each the
    tensors it joins: ``qkv_bias`` (Q, K and V's biases), ``q_norm`` and
    ``k_norm`` (every Q and K head's RMSNorm weight), ``post_attn_norm`` and
    ``post_mlp_norm`` (the attention's and the MLP's output norms); the names
    of :class:`~tserve.gpu.kernels._decoder_abi.LayerPointers`."""
    arch, block = config.architecture, f"blk.{i}"
    vectors = {}
    if arch.qkv_bias:
        vectors["qkv_bias"] = [f"{block}.attn_{x}.bias" for x in "qkv"]
    if arch.qk_norm:
        vectors["q_norm"] = [f"{block}.attn_q_norm.weight"]
        vectors["k_norm"] = [f"{block}.attn_k_norm.weight"]
    if arch.post_norms:
        vectors["post_attn_norm"] = [f"{block}.post_attention_norm.weight"]
        vectors["post_mlp_norm"] = [f"{block}.post_ffw_norm.weight"]
    return vectors


def tensor_shapes(config: GgufConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the plan reads, by name, with the shape ``config`` gives it in
    GGUF's order (a row's length first: ``[in, out]``; a vector ``[n]``)."""
    hidden, dim, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * dim, config.num_key_value_heads * dim
    shapes: dict[str, tuple[int, ...]] = {
        EMBEDDING: (hidden, config.vocab_size),
        OUTPUT_NORM: (hidden,),
        head_name(config): (hidden, config.vocab_size),
    }
    inputs = {"qkv": hidden, "o": q, "gate_up": hidden, "down": inter}
    outputs = {"qkv": [q, kv, kv], "o": [hidden], "gate_up": [inter, inter], "down": [hidden]}
    vectors = {
        "qkv_bias": [q, kv, kv],
        "q_norm": [dim],
        "k_norm": [dim],
        "post_attn_norm": [hidden],
        "post_mlp_norm": [hidden],
    }
    for i in range(config.num_hidden_layers):
        for part, (names, _) in layer_products(config, i).items():
            widths = outputs[part] if len(names) > 1 else [sum(outputs[part])]
            for name, width in zip(names, widths, strict=True):
                shapes[name] = (inputs[part], width)
        shapes.update((name, (hidden,)) for name in layer_norms(i).values())
        for part, names in layer_vectors(config, i).items():
            shapes.update((name, (n,)) for name, n in zip(names, vectors[part], strict=True))
    return shapes


def layer_window(config: GgufConfig, i: int) -> int:
    """The keys layer ``i`` attends to when it is a sliding-window layer (its
    architecture's pattern), else 0: every key."""
    pattern = config.architecture.sliding_pattern
    if not pattern or not config.sliding_window or (i + 1) % pattern == 0:
        return 0
    return config.sliding_window


def embed_scale(config: GgufConfig) -> float:
    """What the embedding's rows are multiplied by (Gemma: sqrt(hidden), in fp32)."""
    if not config.architecture.embed_scale:
        return 1.0
    return float(np.float32(config.hidden_size**0.5))


def rope_tables(config: GgufConfig, local: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``(cos, sin)``, each fp32 ``[max_position_embeddings, head_dim / 2]``: the
    global layers' (``local``: the sliding-window layers', on their own base
    where they have one, unscaled).

    The angles are transformers' (default, linear and llama3 RoPE, the last
    through the file's per-frequency factors): the same fp32
    operations, though torch's vectorized ``pow`` may round an inverse
    frequency a unit or two differently (its AVX-512 path does); their cosines
    and sines are rounded from float64 (torch's fp32 ``cos`` and ``sin`` are
    not correctly rounded)."""
    dim = config.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    own = local and config.local_rope_theta > 0
    theta = config.local_rope_theta if own else config.rope_theta
    inv_freq = np.float32(1.0) / np.power(np.float32(theta), exponents)
    inv_freq = inv_freq / np.float32(1.0 if own else config.rope_linear_factor)
    if config.rope_freq_factors and not own:
        inv_freq = inv_freq / np.asarray(config.rope_freq_factors, dtype=np.float32)
    positions = np.arange(config.max_position_embeddings, dtype=np.float32)
    angles = (positions[:, None] * inv_freq[None, :]).astype(np.float64)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
