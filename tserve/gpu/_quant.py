"""Linear layers and embeddings over GGUF weights kept in their formats.

A weight stays as the GGUF file lays it out: one row per output feature,
each row a run of blocks (``Q8_0``, ``Q4_0``, ``Q4_1``: 32 weights each, a
fp16 scale, and for ``Q4_1`` a fp16 offset), of K-quant super-blocks
(``Q4_K``, ``Q5_K``, ``Q6_K``: 256 weights each, 4.5, 5.5 and 6.56 bits a
weight with their scales) or of 16-bit floats (``F16``, ``BF16``).
``_quant_kernels.c`` (and ``_kquant_kernels.c`` for the K-quants) multiplies
by it directly; every weight row is read once per product whatever the
number of rows (decode rows and prefill chunks alike).

**Activations** stay fp32: each block of weights is dequantized in
registers once per tile of up to 4 activation rows and multiplied in fp32,
so a product equals dequantize-then-``F.linear`` up to summation order
(the tests bound the difference at float rounding), and greedy outputs match
the model converted to fp32. The C code also has llama.cpp's scheme,
activations quantized to 8 bits per block of 32 and integer dot products
(``int8=True``); it is not the serving path because it moves every product
by about 0.5 % (relative, measured on SmolLM2's layers), which flips
near-ties: SmolLM2 answers "What is the capital of France?" greedily with
"The capital of France is Paris." in fp32 and with "L'Étoile, ..." in int8,
its two top logits being 0.06 apart. K-quants have both (``_kquant_kernels.c``).

**Instructions.** AVX2 + FMA + F16C where the CPU has them (chosen at run
time), else portable C, said once in the log. ``F32`` weights are no
business of this module: they load as plain fp32 linear layers.

**Many rows.** For a prefill chunk the product is compute-bound; each layer
measures once, per weight shape, whether its rows are faster through the
kernel or through dequantizing the weight into a scratch fp32 copy and
``F.linear`` (the BLAS), and picks by row count (:class:`QuantizedLinear`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, Literal

import torch
import torch.nn.functional as F

from tserve.gpu._cpu_kernels import kernel_library

__all__ = [
    "BLOCK_FORMATS",
    "FORMATS",
    "K_FORMATS",
    "QuantKernels",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "QuantizedWeight",
    "quant_kernels",
    "row_bytes",
    "tune_quantized",
]

log = logging.getLogger(__name__)

# GGML's type ids (gguf.GGMLQuantizationType), the C code's format codes.
F16: Final = 1
Q4_0: Final = 2
Q4_1: Final = 3
Q8_0: Final = 8
Q4_K: Final = 12
Q5_K: Final = 13
Q6_K: Final = 14
BF16: Final = 30
FORMATS: Final = {
    "F16": F16,
    "BF16": BF16,
    "Q4_0": Q4_0,
    "Q4_1": Q4_1,
    "Q8_0": Q8_0,
    "Q4_K": Q4_K,
    "Q5_K": Q5_K,
    "Q6_K": Q6_K,
}
"""The formats the kernels multiply by, by GGUF name."""
BLOCK_FORMATS: Final = frozenset({Q4_0, Q4_1, Q8_0})
K_FORMATS: Final = frozenset({Q4_K, Q5_K, Q6_K})
"""Super-blocks of 256 weights (``_kquant_kernels.c``)."""
_BLOCK: Final = 32
_BLOCK_BYTES: Final = {Q4_0: 18, Q4_1: 20, Q8_0: 34, Q4_K: 144, Q5_K: 176, Q6_K: 210}
_BLOCK_VALUES: Final = {Q4_0: _BLOCK, Q4_1: _BLOCK, Q8_0: _BLOCK, Q4_K: 256, Q5_K: 256, Q6_K: 256}
_ISA_NAMES: Final = ("portable C", "AVX2 + FMA + F16C")

Isa = Literal[0, 1]
"""0: portable C; 1: AVX2 + FMA + F16C."""


def row_bytes(fmt: int, k: int) -> int:
    """Bytes of one weight row of ``k`` values in ``fmt``."""
    if fmt in _BLOCK_VALUES:
        return k // _BLOCK_VALUES[fmt] * _BLOCK_BYTES[fmt]
    return 2 * k


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A ``[out_features, in_features]`` weight in ``fmt``: ``data [out, row_bytes]`` uint8.

    For a block format ``in_features`` is a multiple of its block (32; a
    K-quant's 256): GGUF's own rule.
    """

    fmt: int
    data: torch.Tensor
    out_features: int
    in_features: int

    def __post_init__(self) -> None:
        expected = (self.out_features, row_bytes(self.fmt, self.in_features))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            raise ValueError(f"weight data {tuple(self.data.shape)} is not uint8 {expected}")
        block = _BLOCK_VALUES.get(self.fmt, 1)
        if self.in_features % block:
            raise ValueError(f"in_features {self.in_features} is not a multiple of {block}")


_I64, _INT, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


def _declare(function: Any, *argtypes: type[ctypes._SimpleCData[Any]]) -> Any:
    function.argtypes, function.restype = argtypes, None
    return function


class QuantKernels:
    """``_quant_kernels.c``'s and ``_kquant_kernels.c``'s entry points. ``isa`` is
    what runs (this CPU's best unless a caller forces portable, as the tests do)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        library.tserve_quant_isa.restype = _INT
        self.best_isa: Isa = 1 if library.tserve_quant_isa() == 1 else 0
        i64, ptr = _I64, _PTR
        self._quantize = _declare(library.tserve_quantize_q8, ptr, i64, i64, ptr, ptr, ptr)
        self._linear = _declare(
            library.tserve_qlinear, _INT, _INT, ptr, i64, i64, i64, i64, ptr, ptr, ptr, i64, ptr
        )
        self._dequantize = _declare(library.tserve_dequantize, _INT, ptr, i64, ptr, i64, ptr)
        self._klinear = _declare(
            library.tserve_kqlinear, _INT, _INT, ptr, i64, i64, i64, i64, ptr, ptr, i64, ptr
        )
        self._kgroup_sums = _declare(library.tserve_kgroup_sums, ptr, i64, i64, ptr)
        self._klinear_int8 = _declare(
            library.tserve_kqlinear_int8,
            _INT,
            _INT,
            ptr,
            i64,
            i64,
            i64,
            i64,
            ptr,
            ptr,
            ptr,
            i64,
            ptr,
        )
        self._kdequantize = _declare(
            library.tserve_kdequantize, _INT, _INT, ptr, i64, ptr, i64, ptr
        )

    def linear(
        self,
        x: torch.Tensor,
        weight: QuantizedWeight,
        *,
        int8: bool = False,
        isa: Isa | None = None,
    ) -> torch.Tensor:
        """``x [..., in] @ W.T``: a new fp32 ``[..., out]``. Blocks for the product.

        ``int8`` (block formats and K-quants): activations quantized to 8 bits
        per block of 32 and integer products; else fp32 against the weights
        dequantized in registers.
        """
        k, n = weight.in_features, weight.out_features
        rows = x.reshape(-1, k).contiguous()
        m = rows.shape[0]
        out = torch.empty(m, n)
        chosen = self.best_isa if isa is None else isa
        if m and weight.fmt in K_FORMATS:
            self._k_product(rows, weight, out, int8=int8, isa=chosen)
        elif m:
            xd = xs = None
            operand = rows
            if int8 and weight.fmt in BLOCK_FORMATS:
                operand = torch.empty(m, k, dtype=torch.int8)
                xd, xs = torch.empty(m, k // _BLOCK), torch.empty(m, k // _BLOCK)
                pointers = (operand.data_ptr(), xd.data_ptr(), xs.data_ptr())
                self._quantize(rows.data_ptr(), m, k, *pointers)
            self._linear(
                chosen,
                weight.fmt,
                weight.data.data_ptr(),
                n,
                0,
                n,
                k,
                operand.data_ptr(),
                0 if xd is None else xd.data_ptr(),
                0 if xs is None else xs.data_ptr(),
                m,
                out.data_ptr(),
            )
        return out.view(*x.shape[:-1], n)

    def _k_product(
        self,
        rows: torch.Tensor,
        weight: QuantizedWeight,
        out: torch.Tensor,
        *,
        int8: bool,
        isa: int,
    ) -> None:
        """``out [m, n] = rows [m, k] @ W.T`` for a K-quant ``weight`` (``_kquant_kernels.c``)."""
        m, k = rows.shape
        n = weight.out_features
        head = (isa, weight.fmt, weight.data.data_ptr(), n, 0, n, k)
        per_block = torch.empty(m, k // _BLOCK)  # int8: the scales; fp32: the sums of x
        if int8:
            xq, sums = torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // _BLOCK)
            quantized = (xq.data_ptr(), per_block.data_ptr(), sums.data_ptr())
            self._quantize(rows.data_ptr(), m, k, *quantized)
            self._klinear_int8(*head, *quantized, m, out.data_ptr())
        else:
            self._kgroup_sums(rows.data_ptr(), m, k, per_block.data_ptr())
            self._klinear(*head, rows.data_ptr(), per_block.data_ptr(), m, out.data_ptr())

    def dequantize(
        self, weight: QuantizedWeight, rows: torch.Tensor | None = None, *, isa: Isa | None = None
    ) -> torch.Tensor:
        """The fp32 rows ``rows`` (int64 ``[r]``; all when None) of the weight: ``[r, in]``."""
        count = weight.out_features if rows is None else rows.numel()
        out = torch.empty(count, weight.in_features)
        index = None if rows is None else rows.reshape(-1).to(torch.int64).contiguous()
        where = (
            weight.data.data_ptr(),
            weight.in_features,
            0 if index is None else index.data_ptr(),
            count,
            out.data_ptr(),
        )
        if weight.fmt in K_FORMATS:
            self._kdequantize(self.best_isa if isa is None else isa, weight.fmt, *where)
        else:
            self._dequantize(weight.fmt, *where)
        return out


@functools.cache
def quant_kernels() -> QuantKernels | None:
    """The quantized kernels, or None where the compiled library is absent.
    Logs once which instructions they run on."""
    library = kernel_library()
    if library is None:
        return None
    kernels = QuantKernels(library)
    if kernels.best_isa == 0:
        log.warning("this CPU lacks AVX2/FMA/F16C: quantized products run as portable C (slow)")
    else:
        log.info("quantized products run on %s", _ISA_NAMES[kernels.best_isa])
    return kernels


Route = Literal["kernel", "dequantize"]
"""``kernel``: the quantized product; ``dequantize``: an fp32 copy, then ``F.linear``."""

TUNED_ROWS: Final = (16, 32, 64, 128, 256, 512)
"""Row counts at which the two paths are compared (fewer rows: the kernel)."""


class QuantizedLinear(torch.nn.Module):
    """A linear layer (no bias) over a :class:`QuantizedWeight`.

    ``forward`` takes fp32 ``[..., in_features]``; rows up to :attr:`kernel_rows`
    (inclusive) run on the kernel, more on dequantize-then-``F.linear``
    (:meth:`tune` sets it; the kernel at every row count until then).
    """

    def __init__(self, weight: QuantizedWeight, kernels: QuantKernels) -> None:
        super().__init__()
        self.weight_q = weight
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self._kernels = kernels
        self.kernel_rows: int | None = None  # None: the kernel at every row count

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.kernel_rows is not None and rows > self.kernel_rows:
            return F.linear(x, self._kernels.dequantize(self.weight_q))
        return self._kernels.linear(x, self.weight_q)

    def tune(
        self,
        rows: Sequence[int] = TUNED_ROWS,
        timer: Callable[[], float] = time.perf_counter,
    ) -> int | None:
        """Measure both paths at each of ``rows`` (ascending); above the first
        count where dequantizing wins, it is used. Blocks while it measures.
        Returns (and sets) :attr:`kernel_rows`."""
        products: dict[Route, Callable[[torch.Tensor], torch.Tensor]] = {
            "kernel": lambda x: self._kernels.linear(x, self.weight_q),
            "dequantize": lambda x: F.linear(x, self._kernels.dequantize(self.weight_q)),
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
    """A token embedding over a :class:`QuantizedWeight` (``[vocab, dim]``):
    ``forward(ids)`` dequantizes just the rows asked for."""

    def __init__(self, weight: QuantizedWeight, kernels: QuantKernels) -> None:
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
    by_shape: dict[tuple[int, int, int], int | None] = {}
    chosen: dict[str, int | None] = {}
    for name, module in model.named_modules():
        if not isinstance(module, QuantizedLinear):
            continue
        if 4 * module.in_features * module.out_features > _TUNED_BYTES:
            continue
        key = (module.weight_q.fmt, module.out_features, module.in_features)
        if key not in by_shape:
            by_shape[key] = module.tune()
            rows = by_shape[key]
            log.info("%s %s: kernel up to %s rows", name, key, "any" if rows is None else rows)
        module.kernel_rows = chosen[name] = by_shape[key]
    return chosen
