"""The quantized products against dequantize-then-``F.linear``, on awkward shapes.

Weights come from :mod:`tests.gpu.quant_products` (the ``gguf`` package's
quantizers, K-quant super-blocks packed in ggml's layout) and ``gguf``'s
dequantizers are the reference: an implementation independent of tserve's.
Each kernel runs in every variant this CPU has (portable C, AVX2 and, for
the int8 panels, AVX-512 VNNI where present) on shapes where such kernels go
wrong: one block, odd row counts, rows that leave a partial tile, more rows
than a tile or a chunk, odd output counts. The rules every format shares
(threads, the tuned route, dequantized rows) are tested here for the K-quants
too; their products and their int8 scheme: test_kquant.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.gpu import kquant_blocks
from tests.gpu.quant_products import (
    assert_every_variant_is_the_product,
    built_kernels,
    variants,
    weight,
)
from tserve.gpu.forward._quant import (
    BLOCK_FORMATS,
    FORMATS,
    K_FORMATS,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedWeight,
    QuantKernels,
)

_GGUF_QUANTIZED = [name for name, fmt in FORMATS.items() if fmt not in K_FORMATS]
"""The formats gguf quantizes (K-quants: test_kquant.py)."""
_SHAPES = [(1, 33, 32), (5, 7, 96), (13, 100, 576), (67, 9, 64), (130, 3, 160)]  # (rows, n, k)
"""One block; odd rows and outputs; K a multiple of 32 but not of 256; a chunk and more."""


@pytest.fixture(scope="module")
def kernels() -> QuantKernels:
    return built_kernels()


def test_the_best_variant_is_the_one_the_cpu_flags_allow(kernels: QuantKernels) -> None:
    """What the C code's run-time check chose, against what Linux says the CPU has."""
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            break
    avx2 = {"avx2", "fma", "f16c"} <= flags
    vnni = avx2 and {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags
    assert kernels.best_isa == (2 if vnni else 1 if avx2 else 0)


@pytest.mark.parametrize(("cap", "isa"), [("avx2", 1), ("portable", 0)])
def test_max_isa_caps_the_variant_that_runs(kernels: QuantKernels, cap: str, isa: int) -> None:
    """``TSERVE_MAX_ISA``, read when the kernels load (a fresh interpreter here),
    caps the products and the fused fp32 loops of ``_cpu_kernels.c`` alike."""
    code = (
        "from tserve.gpu.kernels._quant_abi import quant_library as q;"
        "print(q().best_isa, q().library.tserve_glue_isa())"
    )
    env = {**os.environ, "TSERVE_MAX_ISA": cap}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    products, glue = map(int, done.stdout.split())
    assert products == min(isa, kernels.best_isa)
    assert glue <= isa and (glue == isa or kernels.best_isa < isa)


def _k(fmt: str, blocks: int) -> int:
    """``blocks`` blocks of ``fmt``, in weights (32 each; 256 for a K-quant)."""
    return blocks * (kquant_blocks.SUPER if fmt in kquant_blocks.FORMATS else 32)


@pytest.mark.parametrize("fmt", _GGUF_QUANTIZED)
@pytest.mark.parametrize(("rows", "n", "k"), _SHAPES)
def test_every_variant_is_the_product_with_the_dequantized_weight(
    kernels: QuantKernels, fmt: str, rows: int, n: int, k: int
) -> None:
    assert_every_variant_is_the_product(kernels, fmt, rows, n, k)


_PACKED_SHAPES = [
    *_SHAPES,
    (4, 8, 32),
    (9, 17, 2048),
    (15, 24, 64),
]  # a whole panel; many panels of long rows; a 7-row tile


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
@pytest.mark.parametrize(("rows", "n", "k"), _PACKED_SHAPES)
def test_int8_activations_are_the_product_with_the_rounded_activations(
    kernels: QuantKernels, fmt: str, rows: int, n: int, k: int
) -> None:
    """llama.cpp's scheme: each block of 32 activations rounded to 8 bits, scaled
    by its largest magnitude over 127; integer sums are exact, so each variant is
    the product with those rounded activations up to the scaling's rounding."""
    quantized, dense = weight(fmt, n, k, seed=rows + n * k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n))
    blocks = x.view(rows, -1, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    rounded = (torch.round(blocks / torch.where(step > 0, step, 1)) * step).view(rows, k)
    packed = kernels.pack(quantized)
    for isa in variants(kernels):
        out = kernels.linear_int8(x, packed, isa=isa)
        torch.testing.assert_close(out, F.linear(rounded, dense), rtol=1e-4, atol=1e-4 * k**0.5)
        error = float((out - F.linear(x, dense)).norm() / F.linear(x, dense).norm())
        assert error < 0.015  # what the rounding costs: about half a percent


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", *kquant_blocks.FORMATS])
@pytest.mark.parametrize("rows", [1, 4, 11, 12, 19, 31, 32, 35])
def test_a_panel_gives_the_same_outputs_beside_another(
    kernels: QuantKernels, fmt: str, rows: int
) -> None:
    """From 12 rows of x (the K-quants from 32), AVX-512 runs two adjacent panels in one
    pass of 512-bit registers and a last odd panel alone (below, every panel alone):
    W's first 8 rows give bitwise the same outputs whether
    they are a weight of their own (one panel) or the first of 16 (a pair), and
    so do its next 8 (the second of a pair, then a panel alone)."""
    k = _k(fmt, 6 if fmt in _GGUF_QUANTIZED else 2)
    quantized, _ = weight(fmt, 16, k, seed=rows)
    first = QuantizedWeight(quantized.fmt, quantized.data[:8].clone(), 8, k)
    second = QuantizedWeight(quantized.fmt, quantized.data[8:].clone(), 8, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    for isa in variants(kernels):
        pair = kernels.linear_int8(x, kernels.pack(quantized), isa=isa)
        alone = [kernels.linear_int8(x, kernels.pack(w), isa=isa) for w in (first, second)]
        assert torch.equal(pair, torch.cat(alone, dim=1))


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", *kquant_blocks.FORMATS])
def test_the_packed_layout_keeps_every_row(kernels: QuantKernels, fmt: str) -> None:
    """Every row comes back from its panel as the file's row dequantizes (the
    K-quants' scales and mins, unpacked from 6 bits to bytes, included)."""
    quantized, _ = weight(fmt, 21, _k(fmt, 3), seed=4)  # a partial last panel
    packed = kernels.pack(quantized)
    rows = torch.tensor([20, 0, 9, 9])
    for isa in variants(kernels):
        dense = kernels.dequantize(quantized, isa=isa)
        assert torch.equal(kernels.dequantize(packed, isa=isa), dense)
        assert torch.equal(kernels.dequantize(packed, rows, isa=isa), dense[rows])


@pytest.mark.parametrize("fmt", ["Q4_1", "Q5_0", "Q5_1", *kquant_blocks.FORMATS])
@pytest.mark.parametrize("activations", ["fp32", "int8"])
@pytest.mark.parametrize("threads", [2, 3])
def test_a_product_shared_among_threads_is_the_same(
    kernels: QuantKernels, fmt: str, activations: str, threads: int
) -> None:
    """Output rows (and dequantized rows) split among torch's threads (3: more
    than this machine's cores is allowed): every split gives each row's own sum."""
    k = _k(fmt, 4)
    quantized, dense = weight(fmt, 203, k, seed=6)
    layer = QuantizedLinear(quantized, kernels, activations)  # type: ignore[arg-type]
    x = torch.randn(5, k)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = layer(x), kernels.dequantize(quantized)
        torch.set_num_threads(threads)
        shared = layer(x), kernels.dequantize(quantized)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(alone[0], shared[0]) and torch.equal(alone[1], shared[1])
    torch.testing.assert_close(shared[1], dense, rtol=1e-6, atol=1e-6)


def test_a_batch_of_leading_dimensions_keeps_its_shape(kernels: QuantKernels) -> None:
    quantized, dense = weight("Q4_1", 10, 64, seed=1)
    x = torch.randn(2, 3, 64)
    out = kernels.linear(x, quantized)
    assert out.shape == (2, 3, 10)
    torch.testing.assert_close(out, F.linear(x, dense), rtol=1e-5, atol=1e-4)
    assert kernels.linear(torch.empty(0, 64), quantized).shape == (0, 10)


@pytest.mark.parametrize("fmt", [*_GGUF_QUANTIZED, *kquant_blocks.FORMATS])
def test_dequantized_rows_are_gguf_s_own(kernels: QuantKernels, fmt: str) -> None:
    """Bit for bit for every format gguf quantizes (its packed layout too);
    the K-quants up to the rounding of their two-level scales."""
    quantized, dense = weight(fmt, 40, _k(fmt, 3), seed=3)
    for isa in variants(kernels):
        out = kernels.dequantize(quantized, isa=isa)
        if fmt in _GGUF_QUANTIZED:
            assert torch.equal(out, dense)
        else:
            torch.testing.assert_close(out, dense, rtol=1e-6, atol=1e-6)
    if fmt in _GGUF_QUANTIZED and FORMATS[fmt] in BLOCK_FORMATS:
        assert torch.equal(kernels.dequantize(kernels.pack(quantized)), dense)
    ids = torch.tensor([[39, 0], [7, 7]])
    embedding = QuantizedEmbedding(quantized, kernels)
    torch.testing.assert_close(embedding(ids), dense[ids], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q4_K"])
@pytest.mark.parametrize("activations", ["fp32", "int8"])
def test_a_tuned_layer_gives_the_same_product_on_either_route(
    kernels: QuantKernels, fmt: str, activations: str
) -> None:
    """Many rows may go through an fp32 copy and the BLAS; the product is the
    same (int8: up to the activations' rounding)."""
    k = _k(fmt, 2)
    quantized, dense = weight(fmt, 96, k, seed=5)
    layer = QuantizedLinear(quantized, kernels, activations)  # type: ignore[arg-type]
    bound = 1e-5 if activations == "fp32" else 0.015
    chosen = layer.tune(rows=(2, 8))
    assert chosen in (None, 1, 2)
    x = torch.randn(9, k)
    expected = F.linear(x, dense)
    for kernel_rows in (None, 0):
        layer.kernel_rows = kernel_rows
        assert float((layer(x) - expected).norm() / expected.norm()) < bound


def test_a_weight_of_the_wrong_size_is_refused() -> None:
    with pytest.raises(ValueError, match="not uint8"):
        QuantizedWeight(FORMATS["Q4_1"], torch.zeros(4, 19, dtype=torch.uint8), 4, 32)
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedWeight(FORMATS["Q8_0"], torch.zeros(4, 34, dtype=torch.uint8), 4, 40)
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantizedWeight(FORMATS["Q4_K"], torch.zeros(4, 144, dtype=torch.uint8), 4, 384)
