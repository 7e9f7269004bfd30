"""The K-quant products (Q4_K, Q5_K, Q6_K) against dequantize-then-``F.linear``.

``gguf`` cannot quantize K-quants, so the weights are super-blocks packed by
:mod:`tests.gpu.kquant_blocks` in ggml's layout (random quants, valid scales
and mins); ``gguf``'s dequantizers are the reference, an implementation
independent of tserve's. Each kernel runs in every variant this CPU has
(portable C, and AVX2 where present) on shapes where such kernels go wrong:
one row, several super-blocks per row, odd row counts, rows that leave a
partial tile, more rows than a tile or a chunk, odd output counts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.gpu import kquant_blocks
from tserve.gpu._quant import (
    FORMATS,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedWeight,
    QuantKernels,
    quant_kernels,
)

_SHAPES = [(1, 1, 256), (1, 33, 768), (5, 7, 512), (13, 40, 256), (67, 9, 512), (130, 3, 256)]
"""(rows, n, k): one row, a partial tile, more rows than a tile (4) and a chunk (64)."""


@pytest.fixture(scope="module")
def kernels() -> QuantKernels:
    found = quant_kernels()
    assert found is not None, "the package is installed, so its kernels are built"
    return found


def _dequantized(fmt: str, rows: np.ndarray, n: int, k: int) -> torch.Tensor:
    import gguf

    values = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[fmt])
    return torch.from_numpy(values.astype(np.float32).reshape(n, k))


def _weight(fmt: str, n: int, k: int, seed: int) -> tuple[QuantizedWeight, torch.Tensor]:
    """A random ``[n, k]`` weight in ``fmt``, and gguf's own dequantization of it."""
    rows = kquant_blocks.random_rows(fmt, n, k, np.random.default_rng(seed))
    raw = torch.from_numpy(rows)
    return QuantizedWeight(FORMATS[fmt], raw, n, k), _dequantized(fmt, rows, n, k)


def _isas(kernels: QuantKernels) -> list[int]:
    return sorted({0, kernels.best_isa})


@pytest.mark.parametrize("fmt", kquant_blocks.FORMATS)
@pytest.mark.parametrize(("rows", "n", "k"), _SHAPES)
def test_every_variant_is_the_product_with_the_dequantized_weight(
    kernels: QuantKernels, fmt: str, rows: int, n: int, k: int
) -> None:
    weight, dense = _weight(fmt, n, k, seed=rows * n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    expected = F.linear(x, dense)
    for isa in _isas(kernels):
        out = kernels.linear(x, weight, isa=isa)  # type: ignore[arg-type]
        # fp32 products: only the order of the sums (and a fused multiply-add) differ.
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4 * k**0.5)


@pytest.mark.parametrize("fmt", kquant_blocks.FORMATS)
@pytest.mark.parametrize(("rows", "n", "k"), _SHAPES)
def test_int8_activations_cost_about_half_a_percent(
    kernels: QuantKernels, fmt: str, rows: int, n: int, k: int
) -> None:
    """llama.cpp's scheme: activations rounded to 8 bits per block of 32."""
    weight, dense = _weight(fmt, n, k, seed=rows + n * k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n))
    expected = F.linear(x, dense)
    outs = [kernels.linear(x, weight, int8=True, isa=isa) for isa in _isas(kernels)]  # type: ignore[arg-type]
    for out in outs:
        error = float((out - expected).norm() / expected.norm())
        assert error < 0.015
    # Integer sums are exact: every variant gives the same products up to the scaling's rounding.
    torch.testing.assert_close(outs[0], outs[-1], rtol=1e-5, atol=1e-4 * k**0.5)


@pytest.mark.parametrize("fmt", kquant_blocks.FORMATS)
def test_dequantized_rows_are_gguf_s_own(kernels: QuantKernels, fmt: str) -> None:
    weight, dense = _weight(fmt, 40, 512, seed=3)
    for isa in _isas(kernels):
        out = kernels.dequantize(weight, isa=isa)  # type: ignore[arg-type]
        torch.testing.assert_close(out, dense, rtol=1e-6, atol=1e-6)
    ids = torch.tensor([[39, 0], [7, 7]])
    embedding = QuantizedEmbedding(weight, kernels)
    torch.testing.assert_close(embedding(ids), dense[ids], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fmt", kquant_blocks.FORMATS)
def test_the_test_quantizer_writes_ggml_s_layout(fmt: str) -> None:
    """gguf reads back what kquant_blocks.quantize wrote, within its bits' error."""
    values = np.random.default_rng(7).standard_normal((6, 512)).astype(np.float32)
    back = _dequantized(fmt, kquant_blocks.quantize(values, fmt), 6, 512).numpy()
    error = np.linalg.norm(back - values) / np.linalg.norm(values)
    assert error < {"Q4_K": 0.12, "Q5_K": 0.06, "Q6_K": 0.03}[fmt]


@pytest.mark.parametrize("fmt", kquant_blocks.FORMATS)
@pytest.mark.parametrize("activations", ["fp32", "int8"])
def test_a_product_shared_among_threads_is_the_same(
    kernels: QuantKernels, fmt: str, activations: str
) -> None:
    """Output rows (and dequantized rows) split among torch's threads (3 here: more
    than this machine's cores is allowed): every split gives each row's own sum."""
    weight, dense = _weight(fmt, 203, 1024, seed=6)
    layer = QuantizedLinear(weight, kernels, activations)  # type: ignore[arg-type]
    x = torch.randn(5, 1024)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = layer(x), kernels.dequantize(weight)
        torch.set_num_threads(3)
        shared = layer(x), kernels.dequantize(weight)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(alone[0], shared[0]) and torch.equal(alone[1], shared[1])
    torch.testing.assert_close(shared[1], dense, rtol=1e-6, atol=1e-6)


def test_a_tuned_layer_gives_the_same_product_on_either_route(kernels: QuantKernels) -> None:
    """Many rows may go through an fp32 copy and the BLAS; the product is the same."""
    weight, dense = _weight("Q4_K", 48, 512, seed=5)
    layer = QuantizedLinear(weight, kernels)
    assert layer.tune(rows=(2, 8)) in (None, 1, 2)
    x = torch.randn(9, 512)
    for kernel_rows in (None, 0):
        layer.kernel_rows = kernel_rows
        torch.testing.assert_close(layer(x), F.linear(x, dense), rtol=1e-5, atol=1e-3)


def test_a_k_quant_weight_needs_whole_super_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantizedWeight(FORMATS["Q4_K"], torch.zeros(4, 144, dtype=torch.uint8), 4, 384)
