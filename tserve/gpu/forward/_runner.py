"""Runs one step of the model over every scheduled chunk: ONE forward pass.

The runner owns the KV pool (allocated once) and the model it was given. A
model of an architecture in :mod:`tserve.gpu.models._architectures` runs on tserve's
own forward pass (:mod:`tserve.gpu.forward._llama`, ``model_impl="auto"``); any other, or any model
with ``model_impl="hf"``, runs on its Hugging Face modules with their
attention switched to tserve's paged attention (:mod:`tserve.gpu.forward._attention`).
Either way the model must not be used for anything else afterwards. It does
not decide who runs; the scheduler does, and hands it
:class:`~tserve.gpu.scheduling._sequence.ScheduledChunk` s whose block tables it has
already allocated.

The device and dtype are decided in :mod:`tserve.gpu.models._placement` (torch's
objects: :func:`resolve_device`); from them the runner picks, once, the glue kernels of tserve's own
forward pass (the fused CPU kernels for fp32 on CPU, torch calls otherwise;
both read and write a KV pool of any of :data:`KV_CACHE_DTYPES`),
how decode attention runs, whether linear layers are tuned (CPU only), and
whether a quantized model's short steps run every layer in one call
(:mod:`tserve.gpu.forward._decoder`, CPU fp32); it hands them down, and no other
module looks at the device.

A model is a Hugging Face model, or a :class:`~tserve.gpu.forward._llama.PagedLlama`
built already (a GGUF file's: :mod:`tserve.gpu.forward._gguf`, CPU fp32).

Threads: the runner never calls ``torch.set_num_threads``; on CPU the engine
sets it (``--threads``, default 1) before building the runner.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import torch

from tserve.gpu.forward._attention import ATTENTION_NAME, register_paged_attention
from tserve.gpu.forward._attention_step import KVPool, build_step
from tserve.gpu.forward._decoder import fused_decoder
from tserve.gpu.forward._gemm import tune_linears
from tserve.gpu.forward._llama import PagedLlama, hf_layer_windows, unsupported_reason
from tserve.gpu.forward._quant import tune_quantized
from tserve.gpu.forward._step_ops import TORCH_OPS, StepOps
from tserve.gpu.kernels._cpu_kernels import cpu_kernels
from tserve.gpu.kernels._heap import untouched_pages
from tserve.gpu.models._directory import ModelLoadError
from tserve.gpu.models._placement import KV_DTYPES, as_is_problem, device_and_dtype
from tserve.gpu.scheduling._kv import kv_shape, kv_token_bytes
from tserve.gpu.scheduling._kv_groups import KVGroups
from tserve.gpu.scheduling._sequence import ScheduledChunk
from tserve.protocol import CpuGemm, EngineConfig, KvCacheDtype, ModelImpl

__all__ = [
    "KV_CACHE_DTYPES",
    "ModelRunner",
    "kv_bytes_per_token",
    "kv_windows",
    "resolve_device",
    "resolve_kv_dtype",
]

log = logging.getLogger(__name__)


def resolve_device(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """The config's device and dtype as torch's (decided by
    :func:`tserve.gpu.models._placement.device_and_dtype`)."""
    device, dtype = device_and_dtype(config, cuda=torch.cuda.is_available())
    return torch.device(device), getattr(torch, dtype)


KV_CACHE_DTYPES: Final[dict[str, torch.dtype]] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}
"""``--kv-cache-dtype``'s values, "auto" aside, as torch's dtypes."""


def resolve_kv_dtype(kv_cache_dtype: KvCacheDtype, dtype: torch.dtype) -> torch.dtype:
    """What the KV cache stores for a model in ``dtype`` (decided by
    :func:`tserve.gpu.models._placement.kv_dtype`), as torch's dtype."""
    if kv_cache_dtype == "auto":
        return KV_CACHE_DTYPES[KV_DTYPES[str(dtype).removeprefix("torch.")]]
    return KV_CACHE_DTYPES[kv_cache_dtype]


def runs_gguf(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a GGUF file runs as it is here (its kernels are CPU fp32 ones)."""
    return as_is_problem("", str(device), str(dtype).removeprefix("torch.")) is None


def kv_windows(model: Any, model_impl: ModelImpl = "auto") -> tuple[int, ...]:
    """Each layer's sliding window as the runner's KV groups are laid out for
    ``model`` (0: global): a :class:`PagedLlama`'s, or those of the layers
    tserve's own forward pass will run; none on transformers' modules, which
    mask their windows (from their own attention kwargs) in one group of
    every layer."""
    if isinstance(model, PagedLlama):
        return tuple(layer.window for layer in model.layers)  # type: ignore[misc]
    layers = _model_kv_shape(model)[0]
    if model_impl == "hf" or unsupported_reason(model) is not None:
        return (0,) * layers
    return tuple(hf_layer_windows(model.config))


def _model_kv_shape(model: Any) -> tuple[int, int, int]:
    if isinstance(model, PagedLlama):
        return len(model.layers), model.num_kv_heads, model.head_dim
    return kv_shape(model.config)


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes of K plus V that one token occupies across all layers."""
    return kv_token_bytes(config, dtype.itemsize)


class ModelRunner:
    """Executes scheduled chunks with a paged KV cache of ``num_blocks * block_size`` slots.

    ``device`` and ``dtype`` default to the model's; the pool stores ``kv_dtype``
    (default: ``dtype``), any of :data:`KV_CACHE_DTYPES` with any model dtype.
    On CPU, every linear layer runs on the matrix-product library that
    measured fastest for it (``cpu_gemm="auto"``: :mod:`tserve.gpu.forward._gemm`;
    blocks while it measures), or on the one ``cpu_gemm`` names.
    Raises :class:`ModelLoadError` if the model's attention is not pluggable
    through transformers' ``AttentionInterface``, or is of a kind the paged
    attention cannot run (attention sinks, layers other than full or sliding
    window). On transformers' modules as on tserve's own forward pass, each
    layer's sliding window and attention soft-cap are honoured.
    ``kv_groups`` (default: one group of every layer) lays the pool out by
    KV layer group (:mod:`tserve.gpu.scheduling._kv_groups`): take them from
    :func:`kv_windows` of the same model and ``model_impl``.
    """

    def __init__(
        self,
        model: Any,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        kv_dtype: torch.dtype | None = None,
        cpu_gemm: CpuGemm = "auto",
        model_impl: ModelImpl = "auto",
        kv_groups: KVGroups | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        prebuilt = isinstance(model, PagedLlama)
        self.device = torch.device(
            device if device is not None else "cpu" if prebuilt else model.device
        )
        self.dtype = dtype if dtype is not None else torch.float32 if prebuilt else model.dtype
        if prebuilt and not runs_gguf(self.device, self.dtype):
            raise ValueError(f"a GGUF model runs on CPU in float32, not {self.device} {self.dtype}")
        self.vocab_size: int = (
            model.vocab_size if prebuilt else model.config.get_text_config().vocab_size
        )
        layers, kv_heads, head_dim = _model_kv_shape(model)
        # The device path, decided here once.
        on_cpu = self.device.type == "cpu"
        kernels = cpu_kernels() if on_cpu and self.dtype == torch.float32 else None
        self._decode_products = on_cpu and self.dtype == torch.float32
        ops: StepOps = TORCH_OPS if kernels is None else kernels
        self.model = model if prebuilt else _take_over(model, self.device, self.dtype, model_impl)
        if isinstance(self.model, PagedLlama):
            self.model.ops = ops
        if on_cpu:
            tune_linears(self.model, cpu_gemm)
            tune_quantized(self.model)
        self.kv_dtype = self.dtype if kv_dtype is None else kv_dtype
        if self.kv_dtype not in KV_CACHE_DTYPES.values():
            raise ValueError(f"a KV cache stores one of {sorted(KV_CACHE_DTYPES)}, not {kv_dtype}")
        groups = kv_groups or KVGroups.single(layers)
        if groups.num_layers != layers:
            raise ValueError(f"{groups.num_layers} layers in KV groups, not {layers}")
        if groups.num_groups > 1 and not isinstance(self.model, PagedLlama):
            raise ValueError("KV layer groups need tserve's own forward pass")
        shape = (groups.group_size, kv_heads, num_blocks * block_size, head_dim)
        with torch.inference_mode():
            self.pool = KVPool(
                k=_untouched_zeros(shape, self.device, self.kv_dtype),
                v=_untouched_zeros(shape, self.device, self.kv_dtype),
                block_size=block_size,
                groups=groups,
            )
        # Steps of at most this many tokens run every layer in one call (0: none do;
        # None: decided at the first step, over the model's modules as they are then).
        fuses = kernels is not None and isinstance(self.model, PagedLlama)
        self._fused_tokens: int | None = None if fuses else 0
        self.progress = np.zeros(1, dtype=np.int64)
        """Layers run so far (int64 ``[1]``), read from any thread: it grows while
        :meth:`execute` works, by one per layer on tserve's forward pass (fused
        or not), by the model's layer count after each step on a Hugging Face
        model's modules."""
        if isinstance(self.model, PagedLlama):
            self.model.progress = self.progress
        self._num_layers = layers

    @property
    def num_blocks(self) -> int:
        return self.pool.num_slots // self.pool.block_size

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def execute(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Run ``chunks`` (any mix of prefill chunks and decodes) in one forward pass.

        Writes each chunk's K/V into its sequence's slots and returns fp32
        logits ``[n, vocab]`` for the chunks with ``sample=True``, in chunk
        order. Blocks until the device finishes. Token ids must be < vocab size
        (checked at admission, not here): a bad one fails the whole step.
        """
        if not chunks:
            return torch.empty(0, self.vocab_size)
        keep: list[int] = []  # packed index of each sampling chunk's last token
        end = 0
        for chunk in chunks:
            end += len(chunk.token_ids)
            if chunk.sample:
                keep.append(end - 1)
        if self._fused_tokens is None:
            self._fused_tokens = self._fuse()
        with torch.inference_mode():
            input_ids, position_ids, step = build_step(
                chunks,
                self.pool,
                self.device,
                decode_products=self._decode_products,
                per_token=end <= self._fused_tokens,
            )
            rows = torch.tensor(keep, dtype=torch.long, device=self.device)
            if isinstance(self.model, PagedLlama):
                logits: torch.Tensor = self.model(input_ids[0], position_ids[0], step, rows)
                return logits.float()
            out: Any = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                logits_to_keep=rows,
                use_cache=False,
                tserve_step=step,
            )
            self.progress[0] += self._num_layers
            return out.logits[0].float()  # type: ignore[no-any-return]

    def _fuse(self) -> int:
        """Hands the model a fused decoder where its layers allow one: the most
        tokens a step may have to run on it (0: none)."""
        assert isinstance(self.model, PagedLlama)
        progress = int(self.progress.ctypes.data)
        self.model.decoder = decoder = fused_decoder(self.model, self.pool, progress)
        return 0 if decoder is None else decoder.max_tokens


def _untouched_zeros(
    shape: tuple[int, ...], device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Zeros that take no memory until written, on CPU
    (:func:`~tserve.gpu.kernels._heap.untouched_pages`). Elsewhere ``torch.zeros``."""
    if device.type != "cpu":
        return torch.zeros(shape, device=device, dtype=dtype)
    count = math.prod(shape)
    pages = untouched_pages(count * dtype.itemsize)
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)


def _take_over(model: Any, device: torch.device, dtype: torch.dtype, model_impl: ModelImpl) -> Any:
    """The module the runner calls: tserve's own for the models it covers."""
    model = model.to(device=device, dtype=dtype).eval()
    reason = "asked for" if model_impl == "hf" else unsupported_reason(model)
    if reason is None:
        return PagedLlama.from_hf(model)
    problem = _paged_attention_problem(model)
    if problem is not None:
        raise ModelLoadError(
            f"{type(model).__name__} runs on its Hugging Face modules ({reason}), and "
            f"tserve's paged attention cannot run {problem}"
        )
    log.info("%s runs on its Hugging Face modules (%s)", type(model).__name__, reason)
    register_paged_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    if model.config._attn_implementation != ATTENTION_NAME:
        raise ModelLoadError(
            f"{type(model).__name__} does not support pluggable attention "
            "(transformers AttentionInterface); tserve cannot batch it"
        )
    return model


# The attention kinds of transformers' ``layer_types`` that the paged attention runs.
_PAGED_LAYER_TYPES: Final = frozenset({"full_attention", "sliding_attention"})


def _paged_attention_problem(model: Any) -> str | None:
    """What of a Hugging Face model's attention the paged attention
    (:func:`~tserve.gpu.forward._attention.paged_attention_forward`) cannot honour, or
    None: it honours causal attention with a layer's sliding window, scale and
    soft-cap."""
    text = model.config.get_text_config()
    kinds = set(getattr(text, "layer_types", None) or ()) - _PAGED_LAYER_TYPES
    if kinds:
        return f"its {', '.join(sorted(kinds))} layers"
    if any(name.endswith(".sinks") for name, _ in model.named_parameters()):
        return "attention sinks"
    return None
