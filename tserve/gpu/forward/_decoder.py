"""Every layer of a quantized :class:`~tserve.gpu.forward._llama.PagedLlama` step in one C call
(the structs and the call itself: :mod:`tserve.gpu.kernels._decoder_abi`, shared with
the native runner).

On CPU a decode step of the default model (SmolLM2 135M, Q4_1) is 30 layers
of about nine kernel calls each; their Python side (module calls, tensor
allocations, ctypes argument conversion, attention grouping) cost about a
fifth of the step on one core beside the products themselves. ``_decoder_kernels.c``
runs the same kernels in the same order, the step's intermediates in one
scratch allocation and each product through the very C entry point
:class:`~tserve.gpu.forward._quant.QuantKernels` calls, so a decode step gives bit
for bit the logits of the forward pass on
:class:`~tserve.gpu.kernels._cpu_kernels.CpuKernels`; the embedding before it and
the output head after it stay on the forward pass.

:func:`fused_decoder` builds one for a model whose every layer product is a
:class:`~tserve.gpu.forward._quant.QuantizedLinear` or a
:class:`~tserve.gpu.forward._gguf.Concat` of them (a GGUF file's tensors of several
formats side by side: one product of parts); a dense layer (a GGUF file's
F32 weight, a transformers model's) keeps the step on the forward pass,
where it runs on its tuned BLAS. The model runner decides whether a model gets one
and, step by step, whether a step is short enough for it
(:attr:`FusedDecoder.max_tokens`: at most
:data:`~tserve.gpu.kernels._decoder_abi.MAX_FUSED_TOKENS`, fewer where a product is
tuned to dequantize at more rows; longer steps stay on the forward pass and
its SDPA).
"""

from __future__ import annotations

import torch

from tserve.gpu.forward._attention_step import KVPool, StepMetadata
from tserve.gpu.forward._gguf import Concat
from tserve.gpu.forward._llama import LayerWeights, PagedLlama
from tserve.gpu.forward._quant import PackedWeight, QuantizedLinear, quant_kernels
from tserve.gpu.kernels._cpu_kernels import KV_TYPES
from tserve.gpu.kernels._decoder_abi import (
    ACTIVATIONS,
    MAX_FUSED_TOKENS,
    MAX_PARTS,
    DecoderShape,
    DecoderStep,
    LayerPointers,
    Part,
    Product,
    decoder_step,
    product,
    product_route,
)
from tserve.gpu.kernels._library import kernel_library

__all__ = ["MAX_FUSED_TOKENS", "FusedDecoder", "fused_decoder"]


class FusedDecoder:
    """A :class:`~tserve.gpu.kernels._decoder_abi.DecoderStep` over a model's tensors and
    KV pool, called with a step's tensors. Holds raw pointers into the model's
    weights and the pool: both must outlive it (the runner owns all three). Not
    safe to call from two threads at once (the pool is written)."""

    def __init__(self, step: DecoderStep):
        self._step = step
        self.max_tokens = step.max_tokens
        """The most tokens a step may have here (at least 1)."""

    def __call__(self, residual: torch.Tensor, positions: torch.Tensor, step: StepMetadata) -> None:
        """Every layer over the step's tokens, in place: ``residual [T, hidden]``,
        their embeddings, becomes the last layer's output plus its residual; K/V
        are written into the pool. Blocks until done. ``step`` carries
        :attr:`~tserve.gpu.forward._attention_step.StepMetadata.token_tables`."""
        tables = step.token_tables
        assert tables is not None, "a fused step is built with per_token=True"
        assert residual.is_contiguous() and residual.dtype == torch.float32
        self._step(
            residual.data_ptr(),
            residual.shape[0],
            positions.data_ptr(),
            step.slot_mapping.data_ptr(),
            tables.tables.data_ptr(),
            tables.tables.shape[2],
            tables.rows.data_ptr(),
            slot_stride=step.slot_mapping.stride(0),
            table_stride=tables.tables.stride(0),
        )


def _part(linear: torch.nn.Module) -> tuple[Part, int, int | None] | None:
    """``linear`` as a part of a product ``_decoder_kernels.c`` runs, its inputs,
    and the rows up to which it runs its kernel (None: any); None if it is no
    :class:`QuantizedLinear` (a dense layer runs on its tuned BLAS instead)."""
    if not isinstance(linear, QuantizedLinear):
        return None
    weight = linear.weight_q
    route, packed = product_route(weight.fmt, linear.activations)
    assert packed == isinstance(weight, PackedWeight), "QuantizedLinear packs as routed"
    part = Part(weight.data.data_ptr(), weight.out_features, route, weight.fmt)
    return part, weight.in_features, linear.kernel_rows


def _product(linear: torch.nn.Module) -> tuple[Product, int | None] | None:
    """``linear`` (one layer, or a :class:`~tserve.gpu.forward._gguf.Concat` of layers of
    several formats) as ``_decoder_kernels.c`` runs it and the rows up to which
    it runs its kernels (None: any), or None where a part is no quantized layer."""
    layers = list(linear.parts) if isinstance(linear, Concat) else [linear]
    entries = [_part(layer) for layer in layers]
    found = [entry for entry in entries if entry is not None]
    if len(found) != len(entries) or len(found) > MAX_PARTS:
        return None
    k = found[0][1]
    if any(inputs != k for _, inputs, _ in found):
        return None
    kernel_rows = [rows for _, _, rows in found if rows is not None]
    return product(k, [part for part, _, _ in found]), min(kernel_rows, default=None)


def _vector(t: torch.Tensor) -> int | None:
    return t.data_ptr() if t.dtype == torch.float32 and t.is_contiguous() else None


def fused_decoder(model: PagedLlama, pool: KVPool, progress: int = 0) -> FusedDecoder | None:
    """A :class:`FusedDecoder` over ``model`` (on CPU, fp32) and ``pool``, or None
    where a layer has a product that is not quantized (a dense layer) or the
    compiled kernels are absent. Call after the
    products are tuned: their :attr:`~QuantizedLinear.kernel_rows` bound
    :attr:`FusedDecoder.max_tokens`. ``progress``: the address of an int64
    counter that grows by one per layer run (0: none), outliving the decoder."""
    library, kernels = kernel_library(), quant_kernels()
    rope = [_vector(model.rope_cos), _vector(model.rope_sin)]
    local_cos, local_sin = _vector(model.local_rope_cos), _vector(model.local_rope_sin)
    if library is None or kernels is None or pool.k.dtype not in KV_TYPES or None in rope:
        return None
    if local_cos is None or local_sin is None:
        return None
    layers = []
    max_tokens = MAX_FUSED_TOKENS
    for layer in model.layers:
        assert isinstance(layer, LayerWeights)
        products = [_product(m) for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        norms = [_vector(layer.attn_norm), _vector(layer.mlp_norm)]
        extras = [
            layer.qkv_bias, layer.q_norm, layer.k_norm, layer.post_attn_norm, layer.post_mlp_norm
        ]  # fmt: skip
        extra = [0 if t is None else _vector(t) for t in extras]
        if any(p is None for p in products) or None in norms or None in extra:
            return None
        found = [p for p in products if p is not None]
        for _, kernel_rows in found:
            if kernel_rows is not None:
                max_tokens = min(max_tokens, kernel_rows)
        qkv, o, gate_up, down = (product for product, _ in found)
        attn_norm, mlp_norm = (n for n in norms if n is not None)
        k, v, group = pool.layer(layer.layer_idx)
        k_pool, v_pool = k.data_ptr(), v.data_ptr()
        qkv_bias, q_norm, k_norm, post_attn_norm, post_mlp_norm = (x or 0 for x in extra)
        local = layer.window > 0 and model.local_rope_cos is not model.rope_cos
        layers.append(
            LayerPointers(
                qkv, o, gate_up, down, attn_norm, mlp_norm, k_pool, v_pool,
                qkv_bias=qkv_bias, q_norm=q_norm, k_norm=k_norm,
                post_attn_norm=post_attn_norm, post_mlp_norm=post_mlp_norm,
                rope_cos=local_cos if local else 0,
                rope_sin=local_sin if local else 0,
                window=layer.window, group=group,
            )
        )  # fmt: skip
    shape = DecoderShape(
        hidden=model.norm.shape[0],
        heads=model.num_heads,
        kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        rope_cos=model.rope_cos.data_ptr(),
        rope_sin=model.rope_sin.data_ptr(),
        num_slots=pool.num_slots,
        block_size=pool.block_size,
        eps=model.eps,
        kv_type=KV_TYPES[pool.k.dtype],
        isa=kernels.best_isa,
        scale=model.scaling,
        activation=ACTIVATIONS[model.activation],
        softcap=model.attn_softcap,
    )
    step = decoder_step(library, layers, shape, max_tokens, progress)
    return None if step is None else FusedDecoder(step)
