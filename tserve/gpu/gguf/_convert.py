"""A GGUF file as a plain fp32 transformers directory (``--dequantize``), by
tserve's own weight plan.

:func:`write_fp32_dir` reads the file as the runners do
(:class:`~tserve.gpu.gguf._file.GgufFile`: its architecture, its metadata as
a config, every tensor checked against it), dequantizes every weight with
the ``gguf`` package (any format it reads, those tserve has no kernel for
among them) and writes what transformers loads for the architecture: its
config (the layer pattern, windows, soft-caps and RoPE bases that the plan
reads from the file) and its weights under transformers' names, put back as
transformers holds them (a ``llama`` file's Q and K rows in rotate-half
order, Gemma's norms less the 1 its modules add), with the file's tokenizer
(:mod:`tserve.gpu.gguf._vocab`). tserve then serves the directory as any
other: its architectures on tserve's own forward pass. transformers' own
GGUF loader is not used: it drops Llama 3's RoPE factors, Qwen3's head
size, Phi-3's padding and Gemma's norms and windows.

A file's per-frequency RoPE factors (``rope_freqs``) become the Llama 3
scaling parameters that give them; factors no such parameters give are
refused (a transformers config states no others). Served as it is, any runs.

Blocks (file IO, seconds of CPU per GB of weights); imports no torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Final

import numpy as np

from tserve.gpu.gguf._file import EMBEDDING, OUTPUT_NORM, GgufConfig, GgufFile
from tserve.gpu.gguf._plan import (
    layer_norms,
    layer_products,
    layer_vectors,
    layer_window,
)
from tserve.gpu.gguf._vocab import write_tokenizer_files
from tserve.gpu.models._directory import (
    DEFAULT_MODEL_NAME,
    ModelLoadError,
    ProgressCallback,
    default_cache_root,
    default_gguf,
    publish_dir,
    staging_dir,
)

__all__ = ["converted_gguf_dir", "default_model_dir", "write_fp32_dir"]

log = logging.getLogger(__name__)

# Written last into a converted directory; a directory without it is not a cache hit.
_COMPLETE_MARKER: Final = ".tserve-converted"
# The conversion's version, in a converted file's directory name: one an older
# converter wrote is not reused.
_CONVERSION_VERSION: Final = 2

# Each product of the plan (its tensors, in order) by transformers' names.
_PRODUCTS: Final = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
_FUSED: Final = {"qkv": ("self_attn.qkv_proj",), "gate_up": ("mlp.gate_up_proj",)}
_TOKENIZER_FILES: Final = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_fp32_dir(path: Path, out: Path, progress: ProgressCallback) -> None:
    """GGUF file ``path`` as an fp32 transformers directory in ``out`` (which
    exists). Raises ModelLoadError, one line, for a file it cannot convert."""
    file = GgufFile(path, has_kernels=False, dequantize=True)
    config = file.config
    if config.rope_freq_factors and _llama3_rope(config) is None:
        raise ModelLoadError(
            f"{path.name}: its RoPE frequency factors ('rope_freqs.weight') are not Llama 3's "
            "scaling, which is all a transformers config states; serve it as it is "
            "(without --dequantize)"
        )
    progress(f"dequantizing {file.describe()}")
    state = _state(file, config)
    progress(f"writing {path.name} as an fp32 transformers directory")
    from safetensors.numpy import save_file

    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(_hf_config(config), indent=1))
    if file.vocab is None:  # its tokenizer.json beside it
        for name in _TOKENIZER_FILES:
            if (path.parent / name).is_file():
                shutil.copy(path.parent / name, out / name)
    else:
        write_tokenizer_files(file.vocab, out)


def _state(file: GgufFile, config: GgufConfig) -> dict[str, np.ndarray]:
    """transformers' state dict of the file's weights, in fp32."""
    arch = config.architecture

    def norm(name: str) -> np.ndarray:
        return file.vector(name) - np.float32(arch.norm_offset)

    state = {
        "model.embed_tokens.weight": _weight(file, EMBEDDING),
        "model.norm.weight": norm(OUTPUT_NORM),
    }
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = _weight(file, "output.weight")
    for i in range(config.num_hidden_layers):
        block = f"model.layers.{i}"
        for part, (names, heads) in layer_products(config, i).items():
            ours = _FUSED[part] if arch.fused_products and part in _FUSED else _PRODUCTS[part]
            for name, theirs, h in zip(names, ours, heads, strict=True):
                state[f"{block}.{theirs}.weight"] = _weight(file, name, h)
        norms = layer_norms(i)
        state[f"{block}.input_layernorm.weight"] = norm(norms["attn_norm"])
        # Gemma's names: pre_feedforward_layernorm norms the MLP's input.
        mlp_norm = "pre_feedforward_layernorm" if arch.post_norms else "post_attention_layernorm"
        state[f"{block}.{mlp_norm}.weight"] = norm(norms["mlp_norm"])
        for part, names in layer_vectors(config, i).items():
            if part == "qkv_bias":
                for name, theirs in zip(names, _PRODUCTS["qkv"], strict=True):
                    state[f"{block}.{theirs}.bias"] = file.vector(name)
                continue
            theirs = {
                "q_norm": "self_attn.q_norm",
                "k_norm": "self_attn.k_norm",
                "post_attn_norm": "post_attention_layernorm",
                "post_mlp_norm": "post_feedforward_layernorm",
            }[part]
            state[f"{block}.{theirs}.weight"] = norm(names[0])
    return {name: np.ascontiguousarray(value, dtype=np.float32) for name, value in state.items()}


def _weight(file: GgufFile, name: str, permute_heads: int | None = None) -> np.ndarray:
    """Tensor ``name`` dequantized, ``[out, in]`` fp32 (Q/K rows in rotate-half
    order with ``permute_heads``). Raises ModelLoadError for a format the
    ``gguf`` package does not dequantize."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    fmt, rows = file.rows(name, permute_heads)
    qtype = GGMLQuantizationType(fmt)
    try:
        values = dequantize(np.ascontiguousarray(rows), qtype)
    except NotImplementedError:
        raise ModelLoadError(
            f"{file.path.name}: tensor {name!r} is {qtype.name}, which neither tserve's kernels "
            "nor its fp32 conversion read"
        ) from None
    return values.reshape(rows.shape[0], file.in_features(name))


def _llama3_rope(config: GgufConfig) -> dict[str, Any] | None:
    """transformers' ``llama3`` RoPE parameters that give the file's factors
    (llama.cpp's converter computes them from those parameters), or None
    where none do.

    A factor ``f`` of a frequency in the smooth band is ``1 / ((1 - s) /
    factor + s)`` with ``s = (old / wavelength - low) / (high - low)``, a line
    in ``1 / wavelength``: two of them give it (all of them must lie on
    it), and the parameters follow from the line, ``old`` rounded to the
    integer transformers wants. Without two such frequencies, None."""
    factors = np.asarray(config.rope_freq_factors, dtype=np.float64)
    factor = float(factors.max())
    dim = config.head_dim
    inverse_wavelength = config.rope_theta ** -(np.arange(0, dim, 2) / dim) / (2 * np.pi)
    s = (1 / factors - 1 / factor) / (1 - 1 / factor) if factor > 1 else factors * 0
    band = (s > 1e-4) & (s < 1 - 1e-4)
    if factor <= 1 or band.sum() < 2:
        return None
    slope, intercept = np.polyfit(inverse_wavelength[band], s[band], 1)
    if intercept >= 0 or slope <= 0:
        return None
    old = round(-slope / intercept)  # with low_freq_factor 1
    width = old / slope  # high - low
    low = -intercept * width
    params = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": float(low),
        "high_freq_factor": float(low + width),
        "original_max_position_embeddings": old,
    }
    # The factors these give, as transformers computes them, must be the file's.
    smooth = np.clip((old * inverse_wavelength - low) / width, 0, 1)
    again = 1 / ((1 - smooth) / factor + smooth)
    return params if np.allclose(again, factors, rtol=1e-4, atol=0) else None


def _hf_config(config: GgufConfig) -> dict[str, Any]:
    """The transformers config of the model ``config`` describes."""
    arch = config.architecture
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_linear_factor != 1.0:
        rope = {**rope, "rope_type": "linear", "factor": config.rope_linear_factor}
    if config.rope_freq_factors:
        llama3 = _llama3_rope(config)
        assert llama3 is not None, "checked before the weights"
        rope = {**rope, **llama3}
    out: dict[str, Any] = {
        "model_type": arch.model_types[0],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "rope_parameters": rope,
        "dtype": "float32",
    }
    if arch.activation == "gelu_tanh":
        out["hidden_activation"] = out["hidden_act"] = "gelu_pytorch_tanh"
    if arch.sliding_pattern:  # Gemma: tserve's scale, windows and soft-caps for the file
        windows = [layer_window(config, i) for i in range(config.num_hidden_layers)]
        out["layer_types"] = ["sliding_attention" if w else "full_attention" for w in windows]
        out["sliding_window"] = config.sliding_window or None
        out["query_pre_attn_scalar"] = config.head_dim
        out["attn_logit_softcapping"] = config.attn_softcap or None
        out["final_logit_softcapping"] = config.final_softcap or None
        if config.local_rope_theta:
            local = {"rope_type": "default", "rope_theta": config.local_rope_theta}
            out["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
    return out


def default_model_dir(
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    progress: ProgressCallback | None = None,
) -> Path:
    """The default model (:func:`default_gguf`) converted to fp32, on first use
    (:func:`converted_gguf_dir`; ~20 s on one core, ~540 MB)."""
    target = Path(cache_dir) if cache_dir is not None else default_cache_root()
    return converted_gguf_dir(default_gguf(), target, name=DEFAULT_MODEL_NAME, progress=progress)


def converted_gguf_dir(
    gguf: Path,
    cache_dir: Path,
    *,
    name: str | None = None,
    progress: ProgressCallback | None = None,
) -> Path:
    """``gguf`` dequantized into a plain fp32 transformers directory under
    ``cache_dir`` (named ``name``, else for the file: its name, and a key of its
    path, size, modification time and the converter's version), converting it
    on first use (:func:`write_fp32_dir`).

    Conversion writes into a temporary sibling and renames it into place, so
    an interrupted conversion leaves no half cache and a later call converts
    afresh; a complete directory is never rewritten.
    """
    report = progress or log.info
    if name is None:
        stat = gguf.stat()
        key = hashlib.blake2b(
            f"{gguf.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{_CONVERSION_VERSION}".encode(),
            digest_size=8,
        ).hexdigest()
        name = f"{gguf.stem}-fp32-{key}"
    target = cache_dir / name
    if (target / _COMPLETE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    report(f"converting {gguf.name} into {target} (once)")
    with staging_dir(target.parent) as staging:
        write_fp32_dir(gguf, staging, report)
        publish_dir(staging, target, _COMPLETE_MARKER, f"{gguf}\n")
    report(f"converted model ready in {target}")
    return target
