"""Every layer of a quantized :class:`~tserve.gpu._llama.PagedLlama` step in one C call.

On CPU a decode step of the default model (SmolLM2 135M, Q4_1) is 30 layers
of about nine kernel calls each; their Python side (module calls, tensor
allocations, ctypes argument conversion, attention grouping) cost about a
fifth of the step on one core beside the products themselves. ``_decoder_kernels.c``
runs the same kernels in the same order, the step's intermediates in one
scratch allocation and each product through the very C entry point
:class:`~tserve.gpu._quant.QuantKernels` calls, so a decode step gives bit
for bit the logits of the forward pass on
:class:`~tserve.gpu._cpu_kernels.CpuKernels`; the embedding before it and
the output head after it stay on the forward pass.

:func:`fused_decoder` builds one for a model whose every layer product is a
:class:`~tserve.gpu._quant.QuantizedLinear` (a GGUF file's, all of one
format per product); the model runner decides whether a model gets one
and, step by step, whether a step is short enough for it
(:attr:`FusedDecoder.max_tokens`: attention runs token by token there, so
long prefill chunks stay on the forward pass and its SDPA, and so do row
counts at which a product is tuned to dequantize).
"""

from __future__ import annotations

import ctypes
from typing import Any, Final

import torch

from tserve.gpu._attention import KVPool, StepMetadata
from tserve.gpu._cpu_kernels import KV_TYPES, kernel_library
from tserve.gpu._llama import LayerWeights, PagedLlama
from tserve.gpu._quant import K_FORMATS, PackedWeight, QuantizedLinear, quant_kernels

__all__ = ["MAX_FUSED_TOKENS", "FusedDecoder", "fused_decoder"]

MAX_FUSED_TOKENS: Final = 64
"""The most tokens a fused step takes: past it a prefill chunk's token-by-token
attention costs more than the Python it saves (SmolLM2 Q4_1, one core, a
prompt from position 0: 0.96x the forward pass's time at 64 tokens, 1.02x at 128)."""

# _decoder_kernels.c's ROUTE_* codes: how QuantizedLinear runs a product.
_PACKED_INT8, _FP32, _K_INT8, _K_FP32 = 0, 1, 2, 3

_I64, _I32, _F32, _PTR = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p


class _Product(ctypes.Structure):
    """``tserve_product``: ``y [m, n] = x [m, k] W^T`` over ``data``."""

    _fields_ = (("data", _PTR), ("n", _I64), ("k", _I64), ("route", _I32), ("fmt", _I32))


class _Layer(ctypes.Structure):
    """``tserve_layer``; the pools are this layer's ``[kv_heads, slots, D]``."""

    _fields_ = (
        ("qkv", _Product),
        ("o", _Product),
        ("gate_up", _Product),
        ("down", _Product),
        ("attn_norm", _PTR),
        ("mlp_norm", _PTR),
        ("k_pool", _PTR),
        ("v_pool", _PTR),
    )


class _Decoder(ctypes.Structure):
    """``tserve_decoder``."""

    _fields_ = (
        ("layers", ctypes.POINTER(_Layer)),
        ("num_layers", _I64),
        ("hidden", _I64),
        ("heads", _I64),
        ("kv_heads", _I64),
        ("head_dim", _I64),
        ("rope_cos", _PTR),
        ("rope_sin", _PTR),
        ("num_slots", _I64),
        ("block_size", _I64),
        ("eps", _F32),
        ("scale", _F32),
        ("kv_type", _I32),
        ("isa", _I32),
    )


class FusedDecoder:
    """A model's layers and KV pool as ``_decoder_kernels.c`` reads them.

    Holds raw pointers into the model's weights and the pool: both must
    outlive it (the runner owns all three). Not safe to call from two
    threads at once (the pool is written).
    """

    def __init__(self, step: Any, decoder: _Decoder, layers: ctypes.Array[_Layer], max_tokens: int):
        self._step = step
        self._decoder = decoder
        self._layers = layers  # referenced by decoder.layers: kept alive here
        self.max_tokens = max_tokens
        """The most tokens a step may have here (at least 1)."""

    def __call__(self, residual: torch.Tensor, positions: torch.Tensor, step: StepMetadata) -> None:
        """Every layer over the step's tokens, in place: ``residual [T, hidden]``,
        their embeddings, becomes the last layer's output plus its residual; K/V
        are written into the pool. Blocks until done. ``step`` carries
        :attr:`~tserve.gpu._attention.StepMetadata.token_tables`."""
        tables = step.token_tables
        assert tables is not None, "a fused step is built with per_token=True"
        assert residual.is_contiguous() and residual.dtype == torch.float32
        if self._step(
            ctypes.byref(self._decoder),
            residual.data_ptr(),
            residual.shape[0],
            positions.data_ptr(),
            step.slot_mapping.data_ptr(),
            tables.tables.data_ptr(),
            tables.tables.shape[1],
            tables.rows.data_ptr(),
        ):
            raise MemoryError(f"no memory for the scratch of a {residual.shape[0]}-token step")


def _product(linear: torch.nn.Module) -> tuple[_Product, int | None] | None:
    """``linear`` as ``_decoder_kernels.c`` runs it and the rows up to which it
    runs its kernel (None: any), or None if it is no quantized product."""
    if not isinstance(linear, QuantizedLinear):
        return None
    weight = linear.weight_q
    if isinstance(weight, PackedWeight):
        route = _PACKED_INT8
    elif linear.activations == "int8":
        route = _K_INT8  # int8 on the file's layout: K-quants alone (QuantizedLinear)
    else:
        route = _K_FP32 if weight.fmt in K_FORMATS else _FP32
    n, k = weight.out_features, weight.in_features
    return _Product(weight.data.data_ptr(), n, k, route, weight.fmt), linear.kernel_rows


def _vector(t: torch.Tensor) -> int | None:
    return t.data_ptr() if t.dtype == torch.float32 and t.is_contiguous() else None


def fused_decoder(model: PagedLlama, pool: KVPool) -> FusedDecoder | None:
    """A :class:`FusedDecoder` over ``model`` (on CPU, fp32) and ``pool``, or None
    where a layer has a product that is no :class:`QuantizedLinear` (a dense or
    a mixed-format one) or the compiled kernels are absent. Call after the
    products are tuned: their :attr:`~QuantizedLinear.kernel_rows` bound
    :attr:`FusedDecoder.max_tokens`."""
    library, kernels = kernel_library(), quant_kernels()
    rope = [_vector(model.rope_cos), _vector(model.rope_sin)]
    if library is None or kernels is None or pool.k.dtype not in KV_TYPES or None in rope:
        return None
    layers = (_Layer * len(model.layers))()
    max_tokens = MAX_FUSED_TOKENS
    shapes = set()
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, LayerWeights)
        products = [_product(m) for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        norms = [_vector(layer.attn_norm), _vector(layer.mlp_norm)]
        if any(p is None for p in products) or None in norms:
            return None
        entry = layers[i]
        for name, found in zip(("qkv", "o", "gate_up", "down"), products, strict=True):
            assert found is not None
            product, kernel_rows = found
            setattr(entry, name, product)
            if kernel_rows is not None:
                max_tokens = min(max_tokens, kernel_rows)
        entry.attn_norm, entry.mlp_norm = norms
        entry.k_pool = pool.k[layer.layer_idx].data_ptr()
        entry.v_pool = pool.v[layer.layer_idx].data_ptr()
        shapes.add(tuple((p.n, p.k) for p in (entry.qkv, entry.o, entry.gate_up, entry.down)))
    if len(shapes) != 1 or max_tokens < 1:
        return None  # the kernel sizes its scratch by the first layer
    step = library.tserve_decoder_step
    step.argtypes = (_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR)
    step.restype = ctypes.c_int
    decoder = _Decoder(
        layers=layers,
        num_layers=len(model.layers),
        hidden=model.norm.shape[0],
        heads=model.num_heads,
        kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        rope_cos=rope[0],
        rope_sin=rope[1],
        num_slots=pool.num_slots,
        block_size=pool.block_size,
        eps=model.eps,
        scale=model.scaling,
        kv_type=KV_TYPES[pool.k.dtype],
        isa=kernels.best_isa,
    )
    return FusedDecoder(step, decoder, layers, max_tokens)
