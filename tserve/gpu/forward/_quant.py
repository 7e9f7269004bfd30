"""Linear layers and embeddings over GGUF weights kept in their formats.

A weight comes as the GGUF file lays it out: one row per output feature,
each row a run of blocks (``Q8_0``, ``Q4_0``, ``Q4_1``, ``Q5_0``, ``Q5_1``:
32 weights each, a fp16 scale, for ``Q4_1``/``Q5_1`` a fp16 offset, for the
Q5s 32 fifth bits), of K-quant super-blocks (``Q4_K``, ``Q5_K``, ``Q6_K``:
256 weights each, 4.5, 5.5 and 6.56 bits a weight with their scales) or of
floats (``F16``, ``BF16``, ``F32``).
``_quant_kernels.c`` (and ``_kquant_kernels.c`` for the K-quants) multiplies
by it directly; every weight byte is read once per product whatever the
number of rows (decode rows and prefill chunks alike).

**Activations** (:data:`Activations`, the engine's ``--gguf-activations``):

* ``int8`` (the serving default), llama.cpp's scheme: each block of 32
  activations is rounded to 8 bits (scale: its largest magnitude / 127) and
  multiplied by the weight's integers with 8-bit dot products; the weight is
  repacked once at load into panels of 8 rows (:class:`PackedWeight`, about
  the same bytes), so that one pass of 256-bit integer products serves 8
  outputs. Its products are several times faster than ``fp32``'s (the
  decode step of SmolLM2 Q4_1 about 1.6 times on one core). Each product moves
  by about 0.5 % (relative; the tests bound it), and the model's perplexity
  on ``benchmarks/sonnet.txt`` (4,980 tokens, SmolLM2 Q4_1, windows of 512)
  by +0.36 % (``benchmarks/perplexity.py``: 63.856 against 63.629 for the
  model dequantized to fp32). Greedy answers can part from the fp32
  model's at near-ties: SmolLM2 answers "What is the capital of France?"
  with "The capital of France is Paris." in fp32 and, when its prompt's
  products run int8, with "L'Étoile, ...", its two top logits being 0.06
  apart. The K-quants (Q4_K, Q5_K, Q6_K) take llama.cpp's own scheme for
  them instead, one scale per super-block of 256 activations, so that a
  super-block's integer sums need no float work per group; each product
  moves by about 0.7 %.
* ``fp32``: each block of weights is dequantized in registers once per tile
  of up to 4 activation rows and multiplied in fp32, so a product equals
  dequantize-then-``F.linear`` up to summation order (the tests bound the
  difference at float rounding) and greedy outputs match the model
  converted to fp32.

K-quants (``_kquant_kernels.c``) have both paths, their int8 one on panels
of 8 rows too (their 6-bit scales and mins as bytes: 148 bytes a Q4_K
super-block row for the file's 144). ``F16``/``BF16``/``F32``
weights run ``fp32`` either way. Each product is one C call, here and in
the fused decoder (``_decoder.py``) alike; one that quantizes or sums its
activations first does so into scratch of its own. The torch forward pass
loads ``F32`` weights as plain fp32 linear layers; the fused decoder runs
them on this module's ``F32`` kernel.

**Instructions.** AVX2 + FMA + F16C where the CPU has them (chosen at run
time), else portable C, said once in the log; the block formats' products
(int8 and fp32) and the K-quants' int8 ones run AVX-512 (VNNI) where the CPU has it
(``TSERVE_MAX_ISA=avx2`` caps them at AVX2).

**Threads.** A product's output rows are split among torch's threads
(``torch.set_num_threads``, the engine's ``--threads``), in torch's own
OpenMP pool; small products run on the caller alone.

**Many rows.** For a prefill chunk the product is compute-bound; each layer
measures once, per weight shape, whether its rows are faster through the
kernel or through dequantizing the weight into a scratch fp32 copy and
``F.linear`` (the BLAS), and picks by row count (:class:`QuantizedLinear`).

**Formats** are one table (``_quant_abi.py``'s, with the entry points both this module
and the native runner call): a format's GGML id, block
size and bytes, and whether it has a packed int8 kernel.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Final, Literal

import torch
import torch.nn.functional as F

from tserve.gpu.kernels._quant_abi import (
    BLOCK_FORMATS,
    FORMATS,
    K_FORMATS,
    Activations,
    Isa,
    QuantLibrary,
    format_spec,
    product_activations,
    quant_library,
    row_bytes,
)

__all__ = [
    "BLOCK_FORMATS",
    "FORMATS",
    "K_FORMATS",
    "Activations",
    "Isa",
    "PackedWeight",
    "QuantKernels",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "QuantizedWeight",
    "quant_kernels",
    "row_bytes",
    "tune_quantized",
]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A ``[out_features, in_features]`` weight in ``fmt`` as the file lays it out:
    ``data [out, row_bytes]`` uint8.

    For a block format ``in_features`` is a multiple of its block (GGUF's own rule).
    """

    fmt: int
    data: torch.Tensor
    out_features: int
    in_features: int

    def __post_init__(self) -> None:
        expected = (self.out_features, row_bytes(self.fmt, self.in_features))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            raise ValueError(f"weight data {tuple(self.data.shape)} is not uint8 {expected}")
        block = format_spec(self.fmt).block
        if self.in_features % block:
            raise ValueError(f"in_features {self.in_features} is not a multiple of {block}")


@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A :class:`QuantizedWeight`'s bytes rearranged for the int8 kernel (the same
    size, up to padding the rows to a multiple of 8; the K-quants' 6-bit scales
    and mins as bytes, 3 % more): ``data`` 1-D uint8."""

    fmt: int
    data: torch.Tensor
    out_features: int
    in_features: int


class QuantKernels:
    """``_quant_kernels.c``'s and ``_kquant_kernels.c``'s entry points. ``isa`` is
    what runs (this CPU's best unless a caller forces portable, as the tests do).
    Every product blocks until done and runs on ``torch.get_num_threads()``
    threads (torch's own OpenMP pool), or on the caller alone when it is small
    """

    def __init__(self, quant: QuantLibrary) -> None:
        library = quant.library
        self._quant = quant
        self.best_isa: Isa = quant.best_isa
        c_int = ctypes.c_int
        self._linear, self._linear_int8 = quant.linear, quant.linear_int8
        # as _linear_int8: 0, or -1 when there is no memory for the activations' scratch
        self._klinear = library.tserve_klinear
        self._klinear.argtypes, self._klinear.restype = self._linear_int8.argtypes, c_int

    def linear(
        self, x: torch.Tensor, weight: QuantizedWeight, *, isa: Isa | None = None
    ) -> torch.Tensor:
        """``x [..., in] @ W.T``, fp32 against the weight dequantized in registers:
        a new fp32 ``[..., out]`` (int8 activations: :meth:`linear_int8`)."""
        k, n = weight.in_features, weight.out_features
        flat = x.dim() == 2 and x.is_contiguous()  # a step's rows: no reshaping (it costs)
        rows = x if flat else x.reshape(-1, k).contiguous()
        m = rows.shape[0]
        out = torch.empty(m, n)
        chosen = self.best_isa if isa is None else isa
        where = (weight.fmt, weight.data.data_ptr(), n, k, rows.data_ptr(), m, out.data_ptr())
        if m and weight.fmt in K_FORMATS:
            if self._klinear(chosen, *where):
                raise MemoryError(f"no memory for {m} x {k} activations' scratch")
        elif m:
            self._linear(chosen, *where)
        return out if flat else out.view(*x.shape[:-1], n)

    def pack(self, weight: QuantizedWeight) -> PackedWeight:
        """``weight`` in :meth:`linear_int8`'s layout (a copy); only for a format
        with an int8 kernel."""
        n, k = weight.out_features, weight.in_features
        data = self._quant.pack(weight.fmt, weight.data.numpy(), n, k)
        return PackedWeight(weight.fmt, torch.from_numpy(data), n, k)

    def linear_int8(
        self, x: torch.Tensor, weight: PackedWeight, *, isa: Isa | None = None
    ) -> torch.Tensor:
        """``x [..., in] @ W.T`` with ``x`` quantized to 8 bits per block of 32 (the
        K-quants: per super-block of 256) and integer products: a new fp32 ``[..., out]``."""
        k, n = weight.in_features, weight.out_features
        flat = x.dim() == 2 and x.is_contiguous()  # a step's rows: no reshaping (it costs)
        rows = x if flat else x.reshape(-1, k).contiguous()
        m = rows.shape[0]
        out = torch.empty(m, n)
        if m and self._linear_int8(
            self.best_isa if isa is None else isa, weight.fmt, weight.data.data_ptr(), n, k,
            rows.data_ptr(), m, out.data_ptr(),
        ):  # fmt: skip
            raise MemoryError(f"no memory for {m} x {k} quantized activations")
        return out if flat else out.view(*x.shape[:-1], n)

    def dequantize(
        self,
        weight: QuantizedWeight | PackedWeight,
        rows: torch.Tensor | None = None,
        *,
        isa: Isa | None = None,
    ) -> torch.Tensor:
        """The fp32 rows ``rows`` (int64 ``[r]``; all when None) of the weight: ``[r, in]``."""
        count = weight.out_features if rows is None else rows.numel()
        out = torch.empty(count, weight.in_features)
        index = None if rows is None else rows.reshape(-1).to(torch.int64).contiguous()
        self._quant.dequantize_at(
            weight.fmt,
            weight.data.data_ptr(),
            weight.in_features,
            0 if index is None else index.data_ptr(),
            count,
            out.data_ptr(),
            packed=isinstance(weight, PackedWeight),
            isa=isa,
        )
        return out


@functools.cache
def quant_kernels() -> QuantKernels | None:
    """The quantized kernels, or None where the compiled library is absent
    (:func:`~tserve.gpu.kernels._quant_abi.quant_library`, which logs their instructions once)."""
    quant = quant_library()
    return None if quant is None else QuantKernels(quant)


Route = Literal["kernel", "dequantize"]
"""``kernel``: the quantized product; ``dequantize``: an fp32 copy, then ``F.linear``."""

TUNED_ROWS: Final = (16, 32, 64, 128, 256, 512)
"""Row counts at which the two paths are compared (fewer rows: the kernel)."""


class QuantizedLinear(torch.nn.Module):
    """A linear layer (no bias) over a :class:`QuantizedWeight`.

    ``activations`` "int8" (a format that packs; others run fp32): the weight
    is packed once here and the file's bytes are no longer read. ``forward``
    takes fp32 ``[..., in_features]``; rows up to :attr:`kernel_rows`
    (inclusive) run on the kernel, more on dequantize-then-``F.linear``
    (:meth:`tune` sets it; the kernel at every row count until then).
    """

    def __init__(
        self, weight: QuantizedWeight, kernels: QuantKernels, activations: Activations = "fp32"
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self._kernels = kernels
        self.activations: Activations = product_activations(weight.fmt, activations)
        self.weight_q: QuantizedWeight | PackedWeight
        self._kernel: Callable[[torch.Tensor], torch.Tensor]
        if self.activations == "int8":  # every format with an int8 kernel packs
            packed = self.weight_q = kernels.pack(weight)
            self._kernel = lambda x: kernels.linear_int8(x, packed)
        else:
            self.weight_q = weight
            self._kernel = lambda x: kernels.linear(x, weight)
        self.kernel_rows: int | None = None  # None: the kernel at every row count

    def _dequantized(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self._kernels.dequantize(self.weight_q))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_rows is not None and x.numel() > self.kernel_rows * self.in_features:
            return self._dequantized(x)
        return self._kernel(x)

    def tune(
        self,
        rows: Sequence[int] = TUNED_ROWS,
        timer: Callable[[], float] = time.perf_counter,
    ) -> int | None:
        """Measure both paths at each of ``rows`` (ascending); above the first
        count where dequantizing wins, it is used. Blocks while it measures.
        Returns (and sets) :attr:`kernel_rows`."""
        products: dict[Route, Callable[[torch.Tensor], torch.Tensor]] = {
            "kernel": self._kernel,
            "dequantize": self._dequantized,
        }
        self.kernel_rows = None
        previous = rows[0] - 1  # below the first count the kernel runs in any case
        with torch.inference_mode():
            for n in rows:
                x = torch.randn(n, self.in_features)
                seconds = {}
                for name, product in products.items():
                    product(x)  # warm-up
                    start = timer()
                    product(x)
                    seconds[name] = timer() - start
                if seconds["dequantize"] < seconds["kernel"]:
                    self.kernel_rows = previous
                    break
                previous = n
        return self.kernel_rows


class QuantizedEmbedding(torch.nn.Module):
    """A token embedding over a :class:`QuantizedWeight` or a :class:`PackedWeight`
    (``[vocab, dim]``; a tied output head's): ``forward(ids)`` dequantizes just
    the rows asked for."""

    def __init__(self, weight: QuantizedWeight | PackedWeight, kernels: QuantKernels) -> None:
        super().__init__()
        self.weight_q = weight
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features
        self._kernels = kernels

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._kernels.dequantize(self.weight_q, ids).view(*ids.shape, self.embedding_dim)


_TUNED_BYTES: Final = 16 << 20
"""Layers whose fp32 copy would be larger (an output head) stay on the kernel
untuned: they see at most a batch of sampled rows, and the copy alone costs
more than the product."""


def tune_quantized(model: torch.nn.Module) -> dict[str, int | None]:
    """:meth:`QuantizedLinear.tune` every quantized layer of ``model``, once per
    weight format and shape; blocks while it measures (SmolLM2: about a
    second). Returns each tuned layer's :attr:`~QuantizedLinear.kernel_rows`."""
    by_shape: dict[tuple[int, str, int, int], int | None] = {}
    chosen: dict[str, int | None] = {}
    for name, module in model.named_modules():
        if not isinstance(module, QuantizedLinear):
            continue
        if 4 * module.in_features * module.out_features > _TUNED_BYTES:
            continue
        key = (module.weight_q.fmt, module.activations, module.out_features, module.in_features)
        if key not in by_shape:
            by_shape[key] = module.tune()
            rows = by_shape[key]
            log.info("%s %s: kernel up to %s rows", name, key, "any" if rows is None else rows)
        module.kernel_rows = chosen[name] = by_shape[key]
    return chosen
