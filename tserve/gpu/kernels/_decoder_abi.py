"""``_decoder_kernels.c``'s structs and entry points over raw pointers; no torch.

The fused decoder (every layer of a quantized step in one C call) is built
by the torch forward pass (:mod:`tserve.gpu.forward._decoder`, over a
:class:`~tserve.gpu.forward._llama.PagedLlama`'s tensors) and by the native runner
(:mod:`tserve.gpu.forward._native`, over numpy arrays). Both describe each layer as
:class:`LayerPointers` and get a :class:`DecoderStep` from
:func:`decoder_step`; how a product runs (its ``route``) is chosen here
alone (:func:`product_route`), as :class:`~tserve.gpu.forward._quant.QuantizedLinear`
runs it.

Every pointer must stay valid as long as the :class:`DecoderStep` is used:
its builder owns the weights and the KV pool.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, Final

from tserve.gpu.kernels._library import declare
from tserve.gpu.kernels._quant_abi import K_FORMATS, Activations, product_activations

__all__ = [
    "ACTIVATIONS",
    "MAX_FUSED_TOKENS",
    "DecoderShape",
    "DecoderStep",
    "LayerPointers",
    "Part",
    "Product",
    "add_rms_norm",
    "attend",
    "decoder_step",
    "product",
    "product_route",
    "run_product",
]

MAX_FUSED_TOKENS: Final = 512
"""The most tokens a fused step takes: past it a prefill chunk's token-by-token
attention costs more than the Python it saves (SmolLM2 Q4_1, one core, a
prompt from position 0: 0.96x the forward pass's time at 64 tokens, 1.02x at 128)."""

# _decoder_kernels.c's ROUTE_* codes: how QuantizedLinear runs a product.
_PACKED_INT8, _FP32, _K_FP32 = 0, 1, 2

_I64, _I32, _F32, _PTR = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p


def product_route(fmt: int, activations: Activations) -> tuple[int, bool]:
    """``(route, packed)``: how a product in ``fmt`` asked for ``activations``
    runs (``_decoder_kernels.c``'s route code), and whether it reads the weight
    packed (:meth:`~tserve.gpu.kernels._quant_abi.QuantLibrary.pack`) or as the file
    lays it out."""
    if product_activations(fmt, activations) == "int8":
        return _PACKED_INT8, True  # every format with an int8 kernel packs
    return (_K_FP32 if fmt in K_FORMATS else _FP32), False


ACTIVATIONS: Final = {"silu": 0, "gelu_tanh": 1}
"""The MLP gate's activations ``_decoder_kernels.c`` runs (its ``ACT_*`` codes)."""

MAX_PARTS: Final = 3
"""The most formats one product joins (Q, K and V, each its own)."""


class Part(ctypes.Structure):
    """``tserve_part``: ``n`` rows of a product's weight in one format, at ``data``,
    run by ``route`` (:func:`product_route`)."""

    _fields_ = (("data", _PTR), ("n", _I64), ("route", _I32), ("fmt", _I32))


class Product(ctypes.Structure):
    """``tserve_product``: ``y [m, n] = x [m, k] W^T``, W the rows of ``count``
    parts one after another (:func:`product`)."""

    _fields_ = (("n", _I64), ("k", _I64), ("count", _I32), ("parts", Part * MAX_PARTS))


def product(k: int, parts: Sequence[Part]) -> Product:
    """A product of ``k`` inputs over ``parts`` (1 to :data:`MAX_PARTS`), their
    outputs side by side in order: a weight whose tensors differ in format runs
    as one product."""
    if not 0 < len(parts) <= MAX_PARTS:
        raise ValueError(f"a product joins 1 to {MAX_PARTS} parts, not {len(parts)}")
    entries = (Part * MAX_PARTS)(*parts)
    return Product(n=sum(p.n for p in parts), k=k, count=len(parts), parts=entries)


class _Layer(ctypes.Structure):
    """``tserve_layer``; the pools are this layer's ``[kv_heads, slots, D]``."""

    _fields_ = (
        ("qkv", Product),
        ("o", Product),
        ("gate_up", Product),
        ("down", Product),
        ("attn_norm", _PTR),
        ("mlp_norm", _PTR),
        ("k_pool", _PTR),
        ("v_pool", _PTR),
        ("qkv_bias", _PTR),
        ("q_norm", _PTR),
        ("k_norm", _PTR),
        ("post_attn_norm", _PTR),
        ("post_mlp_norm", _PTR),
        ("rope_cos", _PTR),
        ("rope_sin", _PTR),
        ("window", _I64),
        ("group", _I64),
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
        ("softcap", _F32),
        ("kv_type", _I32),
        ("isa", _I32),
        ("activation", _I32),
        ("progress", _PTR),
    )


@dataclasses.dataclass(frozen=True)
class LayerPointers:
    """One layer as the C code reads it: its four products (each of one or more
    formats), its two fp32 norm vectors, its ``[kv_heads, slots, D]`` K and V
    pools, and its architecture's optional parts
    (:mod:`tserve.gpu.models._architectures`; 0 where it has none): the fp32 Q/K/V
    biases ``[qkv.n]``, the Q and K heads' norm weights ``[D]``, the post-norms
    of the attention's and the MLP's outputs ``[hidden]``, a RoPE table of its
    own (``[positions, D/2]`` each, else the model's) (addresses), a
    sliding window's keys, and its KV layer group (:mod:`tserve.gpu.scheduling._kv_groups`):
    the row of a step's slots and block tables it uses."""

    qkv: Product
    o: Product
    gate_up: Product
    down: Product
    attn_norm: int
    mlp_norm: int
    k_pool: int
    v_pool: int
    qkv_bias: int = 0
    q_norm: int = 0
    k_norm: int = 0
    post_attn_norm: int = 0
    post_mlp_norm: int = 0
    rope_cos: int = 0
    rope_sin: int = 0
    window: int = 0
    group: int = 0


@dataclasses.dataclass(frozen=True)
class DecoderShape:
    """The model around the layers: sizes, RoPE tables (fp32 ``[positions, D/2]``
    addresses), the pool's geometry and element type (``KV_CODES``), the
    attention's scale (0: ``head_dim ** -0.5``) and soft-cap of its scores (0:
    none) and the MLP's activation (:data:`ACTIVATIONS`)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_cos: int
    rope_sin: int
    num_slots: int
    block_size: int
    eps: float
    kv_type: int
    isa: int
    scale: float = 0.0
    activation: int = 0
    softcap: float = 0.0


@functools.cache
def _functions(library: ctypes.CDLL) -> tuple[Any, Any]:
    step = declare(
        library.tserve_decoder_step,
        _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64,
        restype=ctypes.c_int,
    )  # fmt: skip
    product = declare(library.tserve_product_run, _PTR, ctypes.c_int, _PTR, _I64, _PTR,
                      restype=ctypes.c_int)  # fmt: skip
    return step, product


@functools.cache
def add_rms_norm(library: ctypes.CDLL) -> Any:
    """``tserve_add_rms_norm(residual, hidden or None, weight, out, rows, dim, eps,
    add)``: ``residual += hidden`` where ``add``, then its RMSNorm times ``weight``
    into ``out`` (fp32, contiguous): the norm of every layer and of the head."""
    return declare(
        library.tserve_add_rms_norm, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32, ctypes.c_int
    )


@functools.cache
def attend(library: ctypes.CDLL) -> Any:
    """``tserve_attend(isa, qkv, qkv_stride, tokens, positions, tables, width,
    token_rows, k_pool, v_pool, num_slots, block_size, heads, kv_heads,
    head_dim, scale, window, softcap, kv_type, out)``: a fused step's attention, as each
    layer runs it (``_attention_kernels.c``). Token ``t``'s Q heads are the first
    ``heads * head_dim`` floats of row ``t`` of ``qkv``; it attends over keys
    ``0..positions[t]`` (the last ``window`` of them where ``window`` > 0) of
    the sequence whose blocks are row ``token_rows[t]`` of ``tables``, in the
    pools ``[kv_heads, num_slots, head_dim]`` of ``kv_type``; ``out [tokens,
    heads * head_dim]``. Returns nonzero when its scratch cannot be had."""
    i64, ptr, c_int = _I64, _PTR, ctypes.c_int
    return declare(
        library.tserve_attend,
        c_int, ptr, i64, i64, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, _F32,
        i64, _F32, c_int, ptr,
        restype=c_int,
    )  # fmt: skip


class DecoderStep:
    """A model's layers and KV pool as ``_decoder_kernels.c`` reads them.

    Holds raw pointers into its builder's weights, pool and progress counter:
    all must outlive it. Not safe to call from two threads at once (the pool
    is written); the counter may be read from any thread meanwhile.
    """

    def __init__(
        self, library: ctypes.CDLL, decoder: _Decoder, layers: Any, max_tokens: int
    ) -> None:
        self._step = _functions(library)[0]
        self._decoder = decoder
        self._layers = layers  # referenced by decoder.layers: kept alive here
        self.max_tokens = max_tokens
        """The most tokens one call may have (at least 1)."""

    def __call__(
        self,
        residual: int,
        tokens: int,
        positions: int,
        slots: int,
        tables: int,
        width: int,
        token_rows: int,
        slot_stride: int = 0,
        table_stride: int = 0,
    ) -> None:
        """Every layer over ``tokens`` packed tokens, in place: ``residual``
        (fp32 ``[tokens, hidden]``), their embeddings, becomes the last layer's
        output plus its residual; K/V are written into the pool. ``positions``
        and ``token_rows`` are int64 ``[tokens]``; in a layer of KV group ``g``,
        token ``t``'s K/V goes to slot ``slots[g * slot_stride + t]`` and its
        sequence's blocks are row ``token_rows[t]`` of the int64 ``[*, width]``
        tables at ``tables + g * table_stride`` (strides in elements; any for
        one group). Blocks until done; MemoryError when its scratch cannot be had."""
        assert 0 < tokens <= self.max_tokens, f"{tokens} tokens in one fused call"
        decoder = ctypes.byref(self._decoder)
        strides = slot_stride, table_stride
        if self._step(
            decoder, residual, tokens, positions, slots, tables, width, token_rows, *strides
        ):
            raise MemoryError(f"no memory for the scratch of a {tokens}-token step")


def decoder_step(
    library: ctypes.CDLL,
    layers: Sequence[LayerPointers],
    shape: DecoderShape,
    max_tokens: int = MAX_FUSED_TOKENS,
    progress: int = 0,
) -> DecoderStep | None:
    """A :class:`DecoderStep` over ``layers`` of ``shape``, or None where the
    layers differ in their products' shapes (the kernel sizes its scratch by
    the first) or ``max_tokens`` < 1. ``progress``: the address of an int64
    that every call adds one to after each layer (0: none); it must outlive
    the step."""
    shapes = {tuple((p.n, p.k) for p in (x.qkv, x.o, x.gate_up, x.down)) for x in layers}
    if len(shapes) != 1 or max_tokens < 1:
        return None
    entries = (_Layer * len(layers))()
    for entry, layer in zip(entries, layers, strict=True):
        for field in dataclasses.fields(LayerPointers):
            setattr(entry, field.name, getattr(layer, field.name))
    fields = dataclasses.asdict(shape)
    fields["scale"] = shape.scale or shape.head_dim**-0.5
    decoder = _Decoder(layers=entries, num_layers=len(layers), progress=progress or None, **fields)
    return DecoderStep(library, decoder, entries, max_tokens)


def run_product(
    library: ctypes.CDLL, product: Product, isa: int, x: int, rows: int, out: int
) -> None:
    """``out [rows, n] = x [rows, k] W^T`` (fp32, contiguous) as a layer's product
    with ``product``'s route runs. Blocks; MemoryError when its scratch cannot be had."""
    if rows and _functions(library)[1](ctypes.byref(product), isa, x, rows, out):
        raise MemoryError(f"no memory for the scratch of a {rows}-row product")
