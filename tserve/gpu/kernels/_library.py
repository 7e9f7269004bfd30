"""The compiled kernels (``tserve/gpu/kernels/_kernels*.so``), loaded once with ctypes; no torch.

``setup.py`` compiles ``_cpu_kernels.c``, ``_quant_kernels.c``,
``_kquant_kernels.c``, ``_attention_kernels.c``, ``_decoder_kernels.c`` and
``_sampling_kernels.c`` into
one shared library when the package is installed (an editable install builds
it in place): no torch
headers, no Python extension ABI, no compiler on the serving machine. Both
the torch forward pass and the native runner (:mod:`tserve.gpu.forward._native`)
reach it through :func:`kernel_library`.

**Threads.** The products split their output rows among OpenMP threads
(libgomp), the fused step's attention its query tiles. With torch imported
it is torch's own runtime, so ``torch.set_num_threads`` sets the count;
without torch :func:`set_threads` sets the same count on the same runtime
(``omp_set_num_threads``). Either way it is the engine's ``--threads``.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os
from typing import Any, Final

__all__ = ["KV_CODES", "MAX_ISA_ENV", "declare", "isa_cap", "kernel_library", "set_threads"]

log = logging.getLogger(__name__)

_LIBRARY: Final = "tserve.gpu.kernels._kernels"  # setup.py's extension

MAX_ISA_ENV: Final = "TSERVE_MAX_ISA"
"""An environment variable that caps every kernel's instruction set at a
variant ("portable", "avx2"; "avx512", the default, caps nothing), as a CPU
without the rest would run; read once, when the library loads (benchmarks;
the tests pass an ``isa`` instead)."""
_ISA_CAPS: Final = {"portable": 0, "avx2": 1, "avx512": 2}


def isa_cap() -> int:
    """:data:`MAX_ISA_ENV`'s cap as an ISA code (``_quant_common.h``'s ISA_*);
    ValueError naming the variable for an unknown name."""
    cap = os.environ.get(MAX_ISA_ENV, "avx512")
    if cap not in _ISA_CAPS:
        raise ValueError(f"{MAX_ISA_ENV}={cap!r}: one of {', '.join(_ISA_CAPS)}")
    return _ISA_CAPS[cap]


KV_CODES: Final = {"fp32": 0, "fp16": 1, "bf16": 2}
"""The KV pool element types the kernels read and write, by ``--kv-cache-dtype``
name: their ``KV_*`` codes in ``_cpu_kernels.c`` (bf16 is stored as its 16 bits)."""


def declare(function: Any, *argtypes: type[ctypes._SimpleCData[Any]], restype: Any = None) -> Any:
    """``function`` with its ctypes argument and result types set; returns it."""
    function.argtypes, function.restype = argtypes, restype
    return function


@functools.cache
def kernel_library() -> ctypes.CDLL | None:
    """The compiled kernels (built at install), or None where the package was
    never built (logged once)."""
    spec = importlib.util.find_spec(_LIBRARY)  # located, not imported: it is no Python module
    if spec is None or spec.origin is None:
        log.warning(
            "tserve's compiled CPU kernels are not built (pip install -e . builds them); "
            "running on torch alone"
        )
        return None
    try:
        library = ctypes.CDLL(spec.origin)
    except OSError as exc:
        log.warning("tserve's compiled CPU kernels do not load (%s); running on torch alone", exc)
        return None
    # The fused fp32 loops (_cpu_kernels.c) pick their variant per call under
    # this cap; the products take theirs as an argument (QuantLibrary.best_isa).
    declare(library.tserve_set_isa_cap, ctypes.c_int)(isa_cap())
    return library


def set_threads(library: ctypes.CDLL, threads: int) -> None:
    """The products' OpenMP threads from now on (at least 1), for the calling
    thread's parallel regions: what ``torch.set_num_threads`` sets when torch
    is imported (its runtime is the library's)."""
    declare(library.omp_set_num_threads, ctypes.c_int)(max(1, threads))
