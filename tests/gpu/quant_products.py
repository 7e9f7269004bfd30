"""Random quantized weights, and the check every format's product passes.

:func:`weight` makes a random weight in any format the kernels multiply by:
the float and 32-weight block formats through ``gguf``'s own quantizers, the
K-quants (which ``gguf`` cannot quantize) as random super-blocks packed by
:mod:`tests.gpu.kquant_blocks`. The reference, ``gguf``'s dequantizers, is an
implementation independent of tserve's. :func:`variants` lists the kernel
variants a test runs (portable C, and AVX2 where this CPU has it), and
:func:`assert_every_variant_is_the_product` is the fp32 product's check, on
the shapes each test file chooses for its formats.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from tests.gpu import kquant_blocks
from tserve.gpu.forward._quant import FORMATS, Isa, QuantizedWeight, QuantKernels, quant_kernels

__all__ = [
    "assert_every_variant_is_the_product",
    "built_kernels",
    "dequantized",
    "variants",
    "weight",
]


def built_kernels() -> QuantKernels:
    """The compiled kernels (the package is installed, so they are built)."""
    found = quant_kernels()
    assert found is not None, "the package is installed, so its kernels are built"
    return found


def variants(kernels: QuantKernels) -> list[Isa]:
    """The kernel variants to run: portable C (0) and each one up to the best this CPU has."""
    return [isa for isa in (0, 1, 2) if isa <= kernels.best_isa]


def dequantized(fmt: str, rows: np.ndarray, n: int, k: int) -> torch.Tensor:
    """``gguf``'s fp32 dequantization of ``rows``, the bytes of an ``[n, k]`` weight in ``fmt``."""
    import gguf

    values = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[fmt])
    return torch.from_numpy(values.astype(np.float32).reshape(n, k))


def weight(fmt: str, n: int, k: int, seed: int) -> tuple[QuantizedWeight, torch.Tensor]:
    """A random ``[n, k]`` weight in ``fmt``, and gguf's own dequantization of it."""
    import gguf

    rng = np.random.default_rng(seed)
    if fmt in kquant_blocks.FORMATS:
        rows = kquant_blocks.random_rows(fmt, n, k, rng)
    else:
        values = rng.standard_normal((n, k), dtype=np.float32)
        data = gguf.quants.quantize(values, gguf.GGMLQuantizationType[fmt])
        rows = np.ascontiguousarray(data).view(np.uint8).reshape(n, -1)
    return QuantizedWeight(FORMATS[fmt], torch.from_numpy(rows), n, k), dequantized(fmt, rows, n, k)


def assert_every_variant_is_the_product(
    kernels: QuantKernels, fmt: str, rows: int, n: int, k: int
) -> None:
    """Each variant's fp32 product of ``rows`` random inputs with a random ``[n, k]``
    weight in ``fmt`` is ``F.linear`` with gguf's dequantization of it: fp32 products,
    only the order of the sums (and a fused multiply-add) differ."""
    quantized, dense = weight(fmt, n, k, seed=rows * n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    expected = F.linear(x, dense)
    for isa in variants(kernels):
        out = kernels.linear(x, quantized, isa=isa)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4 * k**0.5)
