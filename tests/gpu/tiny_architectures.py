"""Tiny random models of every architecture tserve runs, from transformers 5 configs.

:func:`build_tiny_architecture` writes one (seed fixed; its biases and norm
weights random too, so that each part counts) as a model directory; the
tests write it as a GGUF file with :func:`tests.gpu.gguf_files.write_gguf`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
}
# What each family sets beyond the shape: head_dim apart from hidden / heads where it may be.
KINDS: dict[str, dict[str, Any]] = {
    # Llama 3.1's RoPE scaling, its low and high frequencies both within the head.
    "llama3": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
    "qwen2": {},
    "qwen3": {"head_dim": 32},
    "phi3": {},
    # Sliding-window layers (8 keys) alternating with global ones; soft-caps small
    # enough that the random model's scores and logits reach them.
    "gemma2": {
        "num_hidden_layers": 4,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": 8,
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 3.0,
        "tie_word_embeddings": True,
    },
    # Sliding-window layers (8 keys) with their own RoPE base, every 6th global as
    # llama.cpp lays Gemma 3 out; one KV head, query_pre_attn_scalar = head_dim.
    "gemma3": {
        "num_hidden_layers": 6,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": 8,
        "tie_word_embeddings": True,
    },
}


def model_classes(kind: str) -> tuple[Any, Any]:
    """transformers' config and causal LM classes of ``kind`` (a key of :data:`KINDS`)."""
    import transformers

    if kind == "gemma3":
        return transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM
    if kind == "gemma2":
        return transformers.Gemma2Config, transformers.Gemma2ForCausalLM
    names = {"llama3": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi3"}[kind]
    return getattr(transformers, f"{names}Config"), getattr(transformers, f"{names}ForCausalLM")


def build_tiny_architecture(kind: str, out: Path, **config: Any) -> Path:
    """A tiny random model of ``kind`` saved in directory ``out`` (eager
    attention); ``config`` gives the rest of its config (``vocab_size``, token ids)."""
    config_class, model_class = model_classes(kind)
    settings = {**SHAPE, **KINDS[kind], **config}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = model_class(config_class(**settings, attn_implementation="eager")).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.ndim == 1:  # biases (zero) and norm weights (one) as initialized
                    p.add_(torch.randn_like(p) * 0.3)
                    assert "norm" in name or "bias" in name
    model.save_pretrained(out)
    return out
