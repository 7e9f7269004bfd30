"""The fused CPU kernels against the torch code they replace (float rounding only)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tserve.gpu import _cpu_kernels
from tserve.gpu._cpu_kernels import CpuKernels, cpu_kernels
from tserve.gpu._llama import _rotate

KERNELS = cpu_kernels()


@pytest.fixture
def kernels() -> CpuKernels:
    assert KERNELS is not None, "the package is installed, so its kernels are built"
    return KERNELS


@pytest.mark.parametrize("dim", [16, 64, 96, 100, 576])
def test_add_rms_norm_adds_in_place_and_normalizes(kernels: CpuKernels, dim: int) -> None:
    torch.manual_seed(dim)
    residual, hidden, weight = torch.randn(5, dim) * 20, torch.randn(5, dim), torch.randn(dim)
    expected_sum = residual + hidden
    out = kernels.add_rms_norm(residual, hidden, weight, 1e-5)
    assert torch.equal(residual, expected_sum)  # the sum, exactly, where the residual was
    torch.testing.assert_close(out, F.rms_norm(expected_sum, (dim,), weight, 1e-5))
    untouched = residual.clone()
    out = kernels.add_rms_norm(residual, None, weight, 1e-6)  # no add: the first layer
    assert torch.equal(residual, untouched)
    torch.testing.assert_close(out, F.rms_norm(untouched, (dim,), weight, 1e-6))


@pytest.mark.parametrize("inter", [96, 1536, 37])
def test_silu_mul_is_the_mlp_activation(kernels: CpuKernels, inter: int) -> None:
    torch.manual_seed(inter)
    gate_up = torch.randn(6, 2 * inter) * 8  # well into both tails of silu
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 16), (2, 1, 24)])
def test_rope_store_rotates_q_and_k_and_fills_the_pool(
    kernels: CpuKernels, heads: int, kv_heads: int, dim: int
) -> None:
    torch.manual_seed(heads)
    tokens, slots_total = 7, 40
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    cos, sin = torch.randn(50, dim // 2), torch.randn(50, dim // 2)
    positions = torch.randint(0, 50, (tokens,))
    slots = torch.randperm(slots_total)[:tokens]
    k_pool = torch.zeros(kv_heads, slots_total, dim)
    v_pool = torch.zeros(kv_heads, slots_total, dim)
    heads3 = qkv.view(tokens, -1, dim)
    rotated = _rotate(heads3[:, : heads + kv_heads], cos[positions, None], sin[positions, None])
    values = heads3[:, heads + kv_heads :].clone()

    kernels.rope_store(qkv, heads, kv_heads, positions, cos, sin, slots, k_pool, v_pool)

    torch.testing.assert_close(heads3[:, : heads + kv_heads], rotated)
    torch.testing.assert_close(k_pool[:, slots].transpose(0, 1), rotated[:, heads:])
    assert torch.equal(v_pool[:, slots].transpose(0, 1), values)
    others = torch.ones(slots_total, dtype=torch.bool)
    others[slots] = False
    assert not k_pool[:, others].any() and not v_pool[:, others].any()  # no other slot written


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 16), (6, 2, 40)])
def test_paged_decode_matches_attention_over_gathered_keys(
    kernels: CpuKernels, heads: int, kv_heads: int, dim: int
) -> None:
    torch.manual_seed(dim)
    block_size, blocks = 4, 64
    lens = torch.tensor([1, 4, 5, 17, 33, 2])  # one key, block edges, several blocks
    width = -(-int(lens.max()) // block_size)
    tables = torch.stack([torch.randperm(blocks)[:width] for _ in lens])
    k_pool = torch.randn(kv_heads, blocks * block_size, dim) * 3
    v_pool = torch.randn(kv_heads, blocks * block_size, dim)
    q = torch.randn(len(lens), (heads + 2 * kv_heads) * dim)  # rows of a qkv product
    scale = 1 / math.sqrt(dim)

    out = kernels.paged_decode(
        q, heads, k_pool, v_pool, tables, lens, int(lens.max()), block_size, scale
    )

    for b, length in enumerate(lens.tolist()):
        slots = torch.tensor(
            [int(tables[b, p // block_size]) * block_size + p % block_size for p in range(length)]
        )
        keys = k_pool[:, slots].repeat_interleave(heads // kv_heads, 0)  # [heads, len, D]
        values = v_pool[:, slots].repeat_interleave(heads // kv_heads, 0)
        query = q[b, : heads * dim].view(heads, 1, dim)
        expected = torch.softmax(query @ keys.transpose(1, 2) * scale, dim=-1) @ values
        torch.testing.assert_close(out[b], expected[:, 0])


def test_the_kernels_are_the_library_the_install_built_beside_the_package() -> None:
    """Built by setup.py at install (an editable install builds it in place), never
    compiled at run time; a fresh interpreter (an engine process) finds it too."""
    import importlib.util
    import subprocess
    import sys

    spec = importlib.util.find_spec("tserve.gpu._kernels")
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).parent == Path(_cpu_kernels.__file__).parent
    probe = (
        "from tserve.gpu._cpu_kernels import cpu_kernels; "
        "from tserve.gpu._quant import quant_kernels; "
        "assert cpu_kernels() is not None and quant_kernels() is not None"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=120)


@pytest.mark.parametrize(
    ("rows", "n", "k"), [(1, 960, 576), (4, 200, 96), (13, 33, 40), (30, 7, 5)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_over_panels_is_the_product(
    kernels: CpuKernels, rows: int, n: int, k: int, bias: bool
) -> None:
    """Partial last panels (n not a multiple of 32) and more rows than one
    register tile holds (13, 30 > 12) are where such a kernel goes wrong."""
    if not kernels.linear_available:
        pytest.skip("no AVX-512 here")
    torch.manual_seed(rows * n)
    weight, x = torch.randn(n, k), torch.randn(2, rows, k)
    b = torch.randn(n) if bias else None
    out = kernels.linear(x, kernels.pack_linear(weight), b, n)
    assert out.shape == (2, rows, n)
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-4)
