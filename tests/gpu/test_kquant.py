"""The K-quant products (Q4_K, Q5_K, Q6_K) against dequantize-then-``F.linear``.

``gguf`` cannot quantize K-quants, so the weights are super-blocks packed by
:mod:`tests.gpu.kquant_blocks` in ggml's layout (random quants, valid scales
and mins; :mod:`tests.gpu.quant_products`); ``gguf``'s dequantizers are the
reference, an implementation independent of tserve's. Each kernel runs in
every variant this CPU has (portable C, and AVX2 where present) on shapes
where such kernels go wrong: one row, several super-blocks per row, odd row
counts, rows that leave a partial tile, more rows than a tile or a chunk, odd
output counts. What every format shares (threads, the tuned route,
dequantized rows, the weight's size, the packed layout): test_quant.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.gpu import kquant_blocks
from tests.gpu.quant_products import (
    assert_every_variant_is_the_product,
    built_kernels,
    dequantized,
    variants,
    weight,
)
from tserve.gpu.forward._quant import QuantKernels

_SHAPES = [
    (1, 1, 256),
    (1, 33, 768),
    (5, 7, 512),
    (11, 17, 512),
    (13, 40, 256),
    (67, 9, 512),
    (130, 3, 256),
]
"""(rows, n, k): one row, a partial tile, more rows than a tile (AVX2 6, AVX-512 8),
the widest single-panel tile (AVX-512 below 12 rows), a chunk (64)."""


@pytest.fixture(scope="module")
def kernels() -> QuantKernels:
    return built_kernels()


@pytest.mark.parametrize("fmt", kquant_blocks.FORMATS)
@pytest.mark.parametrize(("rows", "n", "k"), _SHAPES)
def test_every_variant_is_the_product_with_the_dequantized_weight(
    kernels: QuantKernels, fmt: str, rows: int, n: int, k: int
) -> None:
    assert_every_variant_is_the_product(kernels, fmt, rows, n, k)


@pytest.mark.parametrize("fmt", kquant_blocks.FORMATS)
@pytest.mark.parametrize(("rows", "n", "k"), _SHAPES)
def test_int8_activations_cost_under_one_percent(
    kernels: QuantKernels, fmt: str, rows: int, n: int, k: int
) -> None:
    """llama.cpp's q8_K: activations rounded to 8 bits per super-block of 256
    (about 0.7% on these; a single 256-long output, near zero, up to 1.6%), on
    the packed layout; integer sums are exact, so each variant is the product
    with those rounded activations up to the scaling's rounding."""
    quantized, dense = weight(fmt, n, k, seed=rows + n * k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n))
    supers = x.view(rows, -1, kquant_blocks.SUPER)
    step = supers.abs().amax(-1, keepdim=True) / 127
    rounded = (torch.round(supers / torch.where(step > 0, step, 1)) * step).view(rows, k)
    expected = F.linear(x, dense)
    packed = kernels.pack(quantized)
    outs = [kernels.linear_int8(x, packed, isa=isa) for isa in variants(kernels)]
    for out in outs:
        torch.testing.assert_close(out, F.linear(rounded, dense), rtol=1e-4, atol=1e-4 * k**0.5)
        error = float((out - expected).norm() / expected.norm())
        assert error < (0.02 if rows * n == 1 else 0.01)
    # Integer sums are exact: every variant gives the same products up to the scaling's rounding.
    torch.testing.assert_close(outs[0], outs[-1], rtol=1e-5, atol=1e-4 * k**0.5)


@pytest.mark.parametrize("fmt", kquant_blocks.FORMATS)
def test_the_test_quantizer_writes_ggml_s_layout(fmt: str) -> None:
    """gguf reads back what kquant_blocks.quantize wrote, within its bits' error."""
    values = np.random.default_rng(7).standard_normal((6, 512)).astype(np.float32)
    back = dequantized(fmt, kquant_blocks.quantize(values, fmt), 6, 512).numpy()
    error = np.linalg.norm(back - values) / np.linalg.norm(values)
    assert error < {"Q4_K": 0.12, "Q5_K": 0.06, "Q6_K": 0.03}[fmt]
