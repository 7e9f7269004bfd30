"""The quantized kernels' formats and C entry points over raw pointers and numpy; no torch.

What both the torch forward pass (:mod:`tserve.gpu.forward._quant`) and the native
runner (:mod:`tserve.gpu.forward._native`) need of ``_quant_kernels.c`` and
``_kquant_kernels.c``, declared once: the format table (``_FORMAT_TABLE``:
a format's GGML id, block size and bytes, whether it has an int8 kernel, over
a packed layout), which instructions run (AVX2 + FMA + F16C where the CPU
has them, else portable C, said once in the log; at most what
``TSERVE_MAX_ISA`` names), the block formats'
products, every int8 product, dequantizing rows (an embedding's lookup) and
packing a weight for the int8 kernel at load. The K-quants' fp32 products are
declared by :mod:`tserve.gpu.forward._quant` alone; the native runner reaches them through
``_decoder_kernels.c`` (:mod:`tserve.gpu.kernels._decoder_abi`).

Every call blocks until done; products run on the OpenMP threads
:mod:`tserve.gpu.kernels._library` describes.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Final, Literal

import numpy as np

from tserve.gpu.kernels._library import MAX_ISA_ENV, declare, isa_cap, kernel_library

__all__ = [
    "BLOCK_FORMATS",
    "FORMATS",
    "K_FORMATS",
    "MAX_ISA_ENV",
    "Activations",
    "Isa",
    "QuantLibrary",
    "format_spec",
    "product_activations",
    "quant_library",
    "row_bytes",
]

log = logging.getLogger(__name__)

Activations = Literal["int8", "fp32"]
"""How a product treats its activations: ``int8``, quantized per block of 32
(K-quants: per super-block of 256) against the packed weight; ``fp32``,
against the weight dequantized in registers."""


@dataclasses.dataclass(frozen=True)
class _Format:
    """A weight format the kernels multiply by. ``block``: values per block (1 for
    a float format), of ``block_bytes`` bytes; ``int8``: it has an int8-activation
    kernel, over a packed layout (:meth:`QuantLibrary.pack`)."""

    name: str
    code: int  # GGML's type id (gguf.GGMLQuantizationType), the C code's format code
    block: int
    block_bytes: int
    int8: bool


_FORMAT_TABLE: Final = {
    f.code: f
    for f in (
        _Format("F32", 0, 1, 4, int8=False),
        _Format("F16", 1, 1, 2, int8=False),
        _Format("BF16", 30, 1, 2, int8=False),
        _Format("Q4_0", 2, 32, 18, int8=True),
        _Format("Q4_1", 3, 32, 20, int8=True),
        _Format("Q5_0", 6, 32, 22, int8=True),
        _Format("Q5_1", 7, 32, 24, int8=True),
        _Format("Q8_0", 8, 32, 34, int8=True),
        _Format("Q4_K", 12, 256, 144, int8=True),
        _Format("Q5_K", 13, 256, 176, int8=True),
        _Format("Q6_K", 14, 256, 210, int8=True),
    )
}
FORMATS: Final = {f.name: f.code for f in _FORMAT_TABLE.values()}
"""The formats the kernels multiply by, by GGUF name."""
BLOCK_FORMATS: Final = frozenset(f.code for f in _FORMAT_TABLE.values() if f.block == 32)
K_FORMATS: Final = frozenset(f.code for f in _FORMAT_TABLE.values() if f.block == 256)
"""Super-blocks of 256 weights (``_kquant_kernels.c``)."""
_ISA_NAMES: Final = (
    "portable C",
    "AVX2 + FMA + F16C",
    "AVX-512 VNNI (the block formats' products, the K-quants' int8 ones) and AVX2 + FMA + F16C",
)

Isa = Literal[0, 1, 2]
"""0: portable C; 1: AVX2 + FMA + F16C; 2: AVX-512 F/BW/VL + VNNI for the block
formats' products (int8 and fp32), the K-quants' int8 products, the fp32 panel
kernel (``_cpu_kernels.c``) and the fused step's attention, AVX2 for the rest."""


def format_spec(fmt: int) -> _Format:
    """The table's entry for GGML format id ``fmt`` (KeyError: no kernel)."""
    return _FORMAT_TABLE[fmt]


def row_bytes(fmt: int, k: int) -> int:
    """Bytes of one weight row of ``k`` values in ``fmt``."""
    spec = _FORMAT_TABLE[fmt]
    return k // spec.block * spec.block_bytes


def product_activations(fmt: int, activations: Activations) -> Activations:
    """What a product in ``fmt`` asked for ``activations`` runs on: int8 only
    where the format has an int8 kernel (F16/BF16 run fp32 either way)."""
    return "int8" if activations == "int8" and _FORMAT_TABLE[fmt].int8 else "fp32"


_I64, _INT, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


def _address(a: np.ndarray) -> int:
    return int(a.ctypes.data)


class QuantLibrary:
    """The entry points, their ctypes types declared once; ``best_isa`` is what
    this CPU runs. Pointers are raw addresses; callers hold the C code's rules
    (contiguous rows, the shapes below) and the kernels do not check them."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library
        library.tserve_quant_isa.restype = _INT
        best = min(library.tserve_quant_isa(), isa_cap())
        self.best_isa: Isa = best if best in (1, 2) else 0
        i64, ptr, c_int = _I64, _PTR, _INT
        self.linear = declare(library.tserve_qlinear, c_int, c_int, ptr, i64, i64, ptr, i64, ptr)
        """``(isa, fmt, w, n, k, x, m, y)``: ``y [m, n] = x [m, k] W^T``, fp32
        against the file's rows (any format but the K-quants)."""
        self.linear_int8 = declare(
            library.tserve_qlinear_int8, c_int, c_int, ptr, i64, i64, ptr, i64, ptr, restype=c_int
        )
        """As :attr:`linear` over a packed weight, ``x`` rounded to 8 bits per
        block (K-quants: per super-block of 256); returns nonzero when its
        scratch cannot be had."""
        self.dequantize = declare(library.tserve_dequantize, c_int, ptr, i64, ptr, i64, ptr)
        """``(fmt, w, k, index or 0, count, out)``: rows ``index`` (all: 0) in fp32."""
        self.unpack = declare(library.tserve_unpack, c_int, c_int, ptr, i64, ptr, i64, ptr)
        """:attr:`dequantize` of a packed weight, ``isa`` first."""
        self.kdequantize = declare(
            library.tserve_kdequantize, c_int, c_int, ptr, i64, ptr, i64, ptr
        )
        """:attr:`dequantize` of a K-quant, ``isa`` first."""
        self._pack = declare(library.tserve_pack, c_int, ptr, i64, i64, ptr)
        self._packed_bytes = declare(library.tserve_packed_bytes, c_int, i64, i64, restype=i64)

    def pack(
        self,
        fmt: int,
        rows: np.ndarray,
        n: int,
        k: int,
        take: Callable[[int], np.ndarray] | None = None,
    ) -> np.ndarray:
        """``rows`` (uint8 ``[n, row_bytes]``, a format with an int8 kernel) in the
        int8 kernel's layout: a new 1-D uint8 array (about the same size), from
        ``take(nbytes)`` (a contiguous uint8 array of that size) if given."""
        source = np.ascontiguousarray(rows)
        nbytes = self._packed_bytes(fmt, n, k)
        out = np.empty(nbytes, dtype=np.uint8) if take is None else take(nbytes)
        self._pack(fmt, _address(source), n, k, _address(out))
        return out

    def dequantize_rows(
        self, fmt: int, data: int, k: int, index: np.ndarray, out: np.ndarray, *, packed: bool
    ) -> None:
        """Rows ``index`` (int64 ``[r]``) of the weight at ``data`` into ``out``
        (fp32 ``[r, k]``, contiguous), whichever layout it is in."""
        self.dequantize_at(fmt, data, k, _address(index), len(index), _address(out), packed=packed)

    def dequantize_at(
        self,
        fmt: int,
        data: int,
        k: int,
        index: int,
        count: int,
        out: int,
        *,
        packed: bool,
        isa: Isa | None = None,
    ) -> None:
        """:meth:`dequantize_rows` over raw addresses: ``count`` rows at ``index``
        (int64; 0: rows 0..count-1) into ``out``, on ``isa`` (default: the best)."""
        where = (data, k, index, count, out)
        chosen = self.best_isa if isa is None else isa
        if packed:
            self.unpack(chosen, fmt, *where)
        elif fmt in K_FORMATS:
            self.kdequantize(chosen, fmt, *where)
        else:
            self.dequantize(fmt, *where)


@functools.cache
def quant_library() -> QuantLibrary | None:
    """The quantized kernels, or None where the compiled library is absent.
    Logs once which instructions they run on."""
    library = kernel_library()
    if library is None:
        return None
    quant = QuantLibrary(library)
    if quant.best_isa == 0:
        log.warning("this CPU lacks AVX2/FMA/F16C: quantized products run as portable C (slow)")
    else:
        log.info("quantized products run on %s", _ISA_NAMES[quant.best_isa])
    return quant
