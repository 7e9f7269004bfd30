"""GGUF files made from the tiny test models, as llama.cpp's converter lays them out.

:func:`write_gguf` writes a model directory's weights (Llama, Qwen2, Qwen3,
Phi-3, Gemma 2 and 3) with the ``gguf`` package's writer and quantizers: the
architecture's metadata, tensors under GGUF names (biases and Q/K norms
where the model has them; Phi-3's joined Q/K/V and gate/up weights as its
``attn_qkv`` and ``ffn_up``; Gemma's pre- and post-norms and soft-caps, each norm
weight written as 1 + w, as Gemma multiplies by), a Llama's Q and K rows
permuted into interleaved-pair RoPE order (the converter's
``LlamaModel.permute``; the other families keep theirs; Llama 3.1 RoPE
scaling as ``rope_freqs`` factors), 2-D weights in the
format asked for and norms in F32, and the directory's tokenizer files
copied beside the file (or a vocabulary in its metadata).
K-quants, which ``gguf`` cannot quantize, come from :mod:`tests.gpu.kquant_blocks`;
IQ4_NL tensors (which tserve has no kernel for) are Q4_0's blocks read as IQ4_NL's.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tests.gpu import kquant_blocks

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half rows -> interleaved pairs."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _llama3_factors(rope: dict[str, Any], dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``rope_freqs`` of Llama 3.1 RoPE scaling: the factor
    each inverse frequency is divided by."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def write_gguf(
    model_dir: Path,
    out: Path,
    fmt: str,
    *,
    formats: dict[str, str] | None = None,
    architecture: str | None = None,
    sampling: dict[str, float | int] | None = None,
    vocab: Callable[[Any], None] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    rope_dimensions: int | None = None,
) -> Path:
    """``model_dir``'s model as ``out`` (a .gguf in a directory of its own), under
    its own architecture unless ``architecture`` names another, every
    2-D weight in ``fmt`` unless ``formats`` names another for a GGUF tensor name;
    ``sampling``: ``general.sampling.<key>`` metadata (ints as int32, floats as
    float32, as llama.cpp's converter writes them). ``vocab`` writes the
    file's ``tokenizer.*`` metadata (given the ``GGUFWriter``); without it the
    directory's tokenizer files are copied beside the file. ``extra_tensors``
    are written too; ``rope_dimensions`` overrides ``rope.dimension_count``."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    interleave = config.model_type == "llama"
    state = {name: t.detach().numpy() for name, t in model.state_dict().items()}
    tensors: dict[str, np.ndarray] = {
        "token_embd.weight": state["model.embed_tokens.weight"],
        "output_norm.weight": state["model.norm.weight"],
    }
    if not config.tie_word_embeddings:
        tensors["output.weight"] = state["lm_head.weight"]
    parts = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    optional = {
        "attn_q.bias": "self_attn.q_proj.bias",
        "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.bias": "self_attn.v_proj.bias",
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
    }
    gemma = config.model_type in ("gemma2", "gemma3_text")
    if gemma:  # its pre- and post-norms; every norm weight as 1 + w, as the converter writes it
        parts.update(
            ffn_norm="pre_feedforward_layernorm",
            post_attention_norm="post_attention_layernorm",
            post_ffw_norm="post_feedforward_layernorm",
        )
        tensors["output_norm.weight"] = tensors["output_norm.weight"] + 1
    if config.model_type == "phi3":  # llama.cpp's names of its fused weights
        parts = {k: v for k, v in parts.items() if k not in ("attn_q", "attn_k", "attn_v")}
        parts.update(attn_qkv="self_attn.qkv_proj", ffn_up="mlp.gate_up_proj")
        del parts["ffn_gate"]
    for i in range(config.num_hidden_layers):
        for ours, theirs in parts.items():
            weight = state[f"model.layers.{i}.{theirs}.weight"]
            if ours == "attn_q" and interleave:
                weight = _permute(weight, heads)
            elif ours == "attn_k" and interleave:
                weight = _permute(weight, kv_heads)
            tensors[f"blk.{i}.{ours}.weight"] = weight
        for ours, theirs in optional.items():
            if f"model.layers.{i}.{theirs}" in state:
                tensors[f"blk.{i}.{ours}"] = state[f"model.layers.{i}.{theirs}"]
        if gemma:
            for name in [n for n in tensors if n.startswith(f"blk.{i}.") and "norm" in n]:
                tensors[name] = tensors[name] + 1

    out.parent.mkdir(parents=True, exist_ok=True)
    arch = architecture or {"gemma3_text": "gemma3"}.get(config.model_type, config.model_type)
    writer = gguf.GGUFWriter(out, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(rope_dimensions or head_dim)
    rope = config.rope_parameters
    writer.add_rope_freq_base(float(rope.get("full_attention", rope)["rope_theta"]))
    if rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = _llama3_factors(rope, head_dim)
    if gemma:
        writer.add_sliding_window(config.sliding_window)
    if config.model_type == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if vocab is not None:
        vocab(writer)
    elif config.eos_token_id is not None:
        writer.add_eos_token_id(config.eos_token_id)
    for key, value in (sampling or {}).items():
        if isinstance(value, int):
            writer.add_int32(f"general.sampling.{key}", value)
        else:
            writer.add_float32(f"general.sampling.{key}", value)
    tensors.update(extra_tensors or {})
    for name, weight in tensors.items():
        kind = (formats or {}).get(name, fmt) if weight.ndim == 2 else "F32"
        qtype = gguf.GGMLQuantizationType[kind]
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, weight.astype(np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, weight.astype(np.float16))
        elif kind in kquant_blocks.FORMATS:
            writer.add_tensor(name, kquant_blocks.quantize(weight, kind), raw_dtype=qtype)
        elif kind == "IQ4_NL":  # Q4_0's block layout (fp16 scale, 32 4-bit indices): its
            # blocks are valid IQ4_NL blocks, of other values (its table's, not linear ones)
            q4_0 = gguf.GGMLQuantizationType.Q4_0
            writer.add_tensor(name, gguf.quants.quantize(weight, q4_0), raw_dtype=qtype)
        else:
            writer.add_tensor(name, gguf.quants.quantize(weight, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for name in _TOKENIZER_FILES if vocab is None else ():
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out.parent / name)
    return out


def build_wide_model(
    tokenizer_dir: Path, out: Path, *, intermediate: int = 2 * kquant_blocks.SUPER
) -> Path:
    """A tiny random Llama whose hidden rows are whole K-quant super-blocks
    (hidden size 256, untied head; its MLP ``intermediate`` wide, by default 512,
    so the down weight's rows are too), with ``tokenizer_dir``'s tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = json.loads((tokenizer_dir / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=tokenizer["vocab_size"],
        hidden_size=kquant_blocks.SUPER,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
        eos_token_id=tokenizer["eos_token_id"],
        pad_token_id=tokenizer["pad_token_id"],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out
