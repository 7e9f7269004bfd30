"""Where a model runs and in what: its runner, device, dtype and KV dtype. No torch.

Every such decision of the engine is made here, from an
:class:`~tserve.protocol.EngineConfig` and what the caller found out about
the machine (whether CUDA is there) and the file (whether the native runner
has a kernel for each of its weights). The loaders only carry them out:

1. **Runner.** A GGUF file served as it is runs on the native runner (numpy
   and the C kernels, no torch) unless :func:`native_config_problem` names
   a reason in the config or the machine, or the file has a weight the
   native runner cannot run; else on torch's forward pass.
2. **Device and dtype** (:func:`device_and_dtype`): "auto" is CUDA with
   bf16 where CUDA is available, else CPU with fp32.
3. **KV dtype** (:func:`kv_dtype`): "auto" is the model's dtype, as in
   vLLM (fp32 on CPU, bf16 on CUDA).
4. **GGUF as it is** runs on CPU in float32 only (:func:`as_is_problem`);
   elsewhere it must be served through its fp32 conversion (--dequantize).

Names are strings (``"cpu"``, ``"cuda:1"``, ``"float32"``, ``"bf16"``): the
torch path turns them into torch objects.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from tserve.protocol import EngineConfig

__all__ = [
    "DTYPES",
    "KV_DTYPES",
    "as_is_problem",
    "cuda_possible",
    "device_and_dtype",
    "kv_dtype",
    "native_config_problem",
]

DTYPES: Final = ("float32", "bfloat16", "float16")
"""``--dtype``'s values, "auto" aside."""

KV_DTYPES: Final[dict[str, str]] = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
"""Each model dtype's ``--kv-cache-dtype`` name."""

_DTYPE_ALIASES: Final = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}


def cuda_possible() -> bool:
    """Whether this machine may have a CUDA device (an NVIDIA driver's device
    files), told without importing torch."""
    return any(Path("/dev").glob("nvidia[0-9]*"))


def native_config_problem(config: EngineConfig, *, cuda: bool) -> str | None:
    """What in ``config`` or the machine keeps a GGUF file off the native runner,
    or None (rule 1). ``cuda``: whether a CUDA device may be present."""
    if config.gguf_runner == "torch":
        return "--gguf-runner torch"
    if config.device not in ("auto", "cpu") or config.dtype not in ("auto", "float32"):
        return f"it runs on CPU in float32, not {config.device} {config.dtype}"
    if config.device == "auto" and cuda:
        return "a CUDA device may be present (--device cpu serves it natively)"
    if config.model_impl == "hf":
        return "--model-impl hf"
    return None


def device_and_dtype(config: EngineConfig, *, cuda: bool) -> tuple[str, str]:
    """The device and dtype ``config`` asks for (rule 2). ``cuda``: whether CUDA
    is available. Raises ValueError for a dtype that is none of :data:`DTYPES`."""
    device = ("cuda" if cuda else "cpu") if config.device == "auto" else config.device
    if config.dtype == "auto":
        return device, "bfloat16" if device.startswith("cuda") else "float32"
    dtype = _DTYPE_ALIASES.get(config.dtype, config.dtype)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {config.dtype!r}: one of auto, {', '.join(DTYPES)}")
    return device, dtype


def kv_dtype(config: EngineConfig, dtype: str) -> str:
    """What the KV cache stores for a model in ``dtype`` (rule 3): a
    ``--kv-cache-dtype`` name. On CPU fp32 keeps results exact; fp16 or bf16
    halve the cache's memory and make long-context decode a little faster
    (docs/configuration.md has the figures)."""
    if config.kv_cache_dtype == "auto":
        return KV_DTYPES[dtype]
    return config.kv_cache_dtype


def as_is_problem(name: str, device: str, dtype: str) -> str | None:
    """Why GGUF file ``name`` cannot run as it is on ``device`` in ``dtype``
    (rule 4), or None."""
    if device == "cpu" and dtype == "float32":
        return None
    return (
        f"{name} runs as it is on CPU in float32; on {device} ({dtype}) serve it with --dequantize"
    )
