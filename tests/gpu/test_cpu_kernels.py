"""The fused CPU kernels against the torch code they replace (float rounding only)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tserve.gpu.forward._step_ops import rotate
from tserve.gpu.kernels import _cpu_kernels
from tserve.gpu.kernels._cpu_kernels import CpuKernels, cpu_kernels
from tserve.gpu.kernels._quant_abi import Isa

KERNELS = cpu_kernels()


@pytest.fixture
def kernels() -> CpuKernels:
    assert KERNELS is not None, "the package is installed, so its kernels are built"
    return KERNELS


@pytest.fixture
def glue(kernels: CpuKernels, glue_isa: int) -> CpuKernels:
    """The kernels with their fused fp32 loops capped at one variant (conftest's glue_isa)."""
    return kernels


@pytest.mark.parametrize("dim", [16, 64, 96, 100, 576])
def test_add_rms_norm_adds_in_place_and_normalizes(glue: CpuKernels, dim: int) -> None:
    torch.manual_seed(dim)
    residual, hidden, weight = torch.randn(5, dim) * 20, torch.randn(5, dim), torch.randn(dim)
    expected_sum = residual + hidden
    out = glue.add_rms_norm(residual, hidden, weight, 1e-5)
    assert torch.equal(residual, expected_sum)  # the sum, exactly, where the residual was
    torch.testing.assert_close(out, F.rms_norm(expected_sum, (dim,), weight, 1e-5))
    untouched = residual.clone()
    out = glue.add_rms_norm(residual, None, weight, 1e-6)  # no add: the first layer
    assert torch.equal(residual, untouched)
    torch.testing.assert_close(out, F.rms_norm(untouched, (dim,), weight, 1e-6))


@pytest.mark.parametrize("inter", [96, 1536, 37])
def test_silu_mul_is_the_mlp_activation(glue: CpuKernels, inter: int) -> None:
    torch.manual_seed(inter)
    gate_up = torch.randn(6, 2 * inter) * 8  # well into both tails of silu
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(glue.silu_mul(gate_up), F.silu(gate) * up)


KV_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 16), (2, 1, 24)])
def test_rope_store_rotates_q_and_k_and_fills_the_pool(
    glue: CpuKernels, heads: int, kv_heads: int, dim: int, kv_dtype: torch.dtype
) -> None:
    torch.manual_seed(heads)
    tokens, slots_total = 7, 40
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    cos, sin = torch.randn(50, dim // 2), torch.randn(50, dim // 2)
    positions = torch.randint(0, 50, (tokens,))
    slots = torch.randperm(slots_total)[:tokens]
    k_pool = torch.zeros(kv_heads, slots_total, dim, dtype=kv_dtype)
    v_pool = torch.zeros(kv_heads, slots_total, dim, dtype=kv_dtype)
    heads3 = qkv.view(tokens, -1, dim)
    rotated = rotate(heads3[:, : heads + kv_heads], cos[positions, None], sin[positions, None])
    values = heads3[:, heads + kv_heads :].clone()

    glue.rope_store(qkv, heads, kv_heads, positions, cos, sin, slots, k_pool, v_pool)

    torch.testing.assert_close(heads3[:, : heads + kv_heads], rotated)
    # The keys: rotated in fp32 (to its rounding), then rounded to the pool's dtype.
    torch.testing.assert_close(k_pool[:, slots].transpose(0, 1), rotated[:, heads:].to(kv_dtype))
    # The values are only rounded: bit for bit torch's cast.
    assert torch.equal(v_pool[:, slots].transpose(0, 1), values.to(kv_dtype))
    others = torch.ones(slots_total, dtype=torch.bool)
    others[slots] = False
    assert not k_pool[:, others].any() and not v_pool[:, others].any()  # no other slot written


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_rope_store_rounds_to_the_pools_dtype_as_torch_does(
    glue: CpuKernels, kv_dtype: torch.dtype
) -> None:
    """Ties to even, values past the format's range, subnormals, signed zero and
    infinities: the edges of a float cast, in the V heads (stored unrotated)."""
    info = torch.finfo(kv_dtype)
    one_ulp = info.eps  # spacing of the format just above 1.0
    edges = torch.tensor(
        [
            1 + one_ulp / 2,  # a tie: rounds down to the even 1.0
            1 + 3 * one_ulp / 2,  # a tie: rounds up to the even 1 + 2 ulp
            1 + one_ulp / 2 + 2**-20,  # just past a tie: rounds up
            info.max * 1.01,  # past the largest finite value
            float(info.smallest_normal) / 3,  # a subnormal of the format
            float(info.smallest_normal) * 2**-30,  # below every subnormal
            -0.0,
            float("inf"),
            float("-inf"),
            -65519.0,
            3.0e38,
            1.0e-42,  # an fp32 subnormal
            0.1,
            -2.7182817,
            12345.678,
            -1.0e-5,
        ]
    )
    dim = len(edges)
    qkv = torch.cat([torch.zeros(2 * dim), edges]).view(1, 3 * dim)
    k_pool = torch.zeros(1, 4, dim, dtype=kv_dtype)
    v_pool = torch.zeros(1, 4, dim, dtype=kv_dtype)
    table = torch.zeros(1, dim // 2)
    glue.rope_store(qkv, 1, 1, torch.tensor([0]), table, table, torch.tensor([2]), k_pool, v_pool)
    stored, expected = v_pool[0, 2], edges.to(kv_dtype)
    assert torch.equal(stored.view(torch.int16), expected.view(torch.int16)), (stored, expected)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_paged_decode_widens_the_pools_values_exactly(
    glue: CpuKernels, kv_dtype: torch.dtype
) -> None:
    """One key: its value row comes out as it is, widened: subnormals, the
    largest values, infinities and the smallest normal included."""
    info = torch.finfo(kv_dtype)
    tiny = float(info.smallest_normal)
    edges = [tiny, tiny / 2, tiny * 0.75, -tiny / 8, info.max, -info.max, float("inf")]
    edges += [float("-inf"), 0.0, 1.0, -3.140625, 1024.5, 2.0**-20, 65504.0, 1e-7, 7.0]
    dim = len(edges)
    values = torch.tensor(edges).to(kv_dtype)
    k_pool = torch.ones(1, 4, dim, dtype=kv_dtype)
    v_pool = torch.zeros(1, 4, dim, dtype=kv_dtype)
    v_pool[0, 1] = values
    q = torch.ones(1, 3 * dim)
    tables, lens = torch.tensor([[0]]), torch.tensor([2])  # keys at slots 0 and 1
    k_pool[0, 0] = -(2**10)  # slot 0's score is so low that its weight is exactly 0
    out = glue.paged_decode(q, 1, k_pool, v_pool, tables, lens, 2, 4, 1.0)
    assert torch.equal(out[0, 0], values.float()), (out[0, 0], values.float())


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 16), (6, 2, 40), (4, 1, 256), (10, 1, 72)]
)
def test_paged_decode_matches_attention_over_gathered_keys(
    glue: CpuKernels, heads: int, kv_heads: int, dim: int, kv_dtype: torch.dtype
) -> None:
    """Over a pool of any KV dtype: the keys and values it holds, widened to fp32."""
    torch.manual_seed(dim)
    block_size, blocks = 4, 64
    lens = torch.tensor([1, 4, 5, 17, 33, 2])  # one key, block edges, several blocks
    width = -(-int(lens.max()) // block_size)
    tables = torch.stack([torch.randperm(blocks)[:width] for _ in lens])
    k_pool = (torch.randn(kv_heads, blocks * block_size, dim) * 3).to(kv_dtype)
    v_pool = torch.randn(kv_heads, blocks * block_size, dim).to(kv_dtype)
    q = torch.randn(len(lens), (heads + 2 * kv_heads) * dim)  # rows of a qkv product
    scale = 1 / math.sqrt(dim)

    out = glue.paged_decode(
        q, heads, k_pool, v_pool, tables, lens, int(lens.max()), block_size, scale
    )

    assert out.dtype == torch.float32
    for b, length in enumerate(lens.tolist()):
        slots = torch.tensor(
            [int(tables[b, p // block_size]) * block_size + p % block_size for p in range(length)]
        )
        keys = k_pool[:, slots].float().repeat_interleave(heads // kv_heads, 0)  # [heads, len, D]
        values = v_pool[:, slots].float().repeat_interleave(heads // kv_heads, 0)
        query = q[b, : heads * dim].view(heads, 1, dim)
        expected = torch.softmax(query @ keys.transpose(1, 2) * scale, dim=-1) @ values
        torch.testing.assert_close(out[b], expected[:, 0])


def test_the_kernels_are_the_library_the_install_built_beside_the_package() -> None:
    """Built by setup.py at install (an editable install builds it in place), never
    compiled at run time; a fresh interpreter (an engine process) finds it too."""
    import importlib.util
    import subprocess
    import sys

    spec = importlib.util.find_spec("tserve.gpu.kernels._kernels")
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).parent == Path(_cpu_kernels.__file__).parent
    probe = (
        "from tserve.gpu.kernels._cpu_kernels import cpu_kernels; "
        "from tserve.gpu.forward._quant import quant_kernels; "
        "assert cpu_kernels() is not None and quant_kernels() is not None"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=120)


@pytest.mark.parametrize("bias", [False, True])
def test_a_bound_linear_is_the_product(kernels: CpuKernels, bias: bool) -> None:
    """Over a step's [1, T, K] rows and over a strided view (copied first)."""
    if not kernels.linear_available:
        pytest.skip("no AVX2 here")
    torch.manual_seed(7)
    weight, b = torch.randn(70, 48), torch.randn(70) if bias else None
    product = kernels.bound_linear(kernels.pack_linear(weight), b, 70)
    for x in (torch.randn(1, 5, 48), torch.randn(48, 9).t()):
        out = product(x)
        assert out.shape == (*x.shape[:-1], 70)
        torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [
        (1, 960, 576),
        (1, 50, 33),
        (2, 40, 7),
        (4, 200, 96),
        (13, 33, 40),
        (30, 7, 5),
        (37, 100, 65),
        (40, 70, 3),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_over_panels_is_the_product(
    kernels: CpuKernels, rows: int, n: int, k: int, bias: bool
) -> None:
    """In each variant this CPU runs (1: AVX2 + FMA, 2: AVX-512). Partial last
    panels (n not a multiple of 32), odd K (one row pairs its k), and more
    rows than one register tile holds (13, 30 > 12 and 3) are where such a
    kernel goes wrong; with three blocks of rows or more, the later blocks
    prefetch the next panel, shared out by k rows (37 rows, 4 panels; 40
    rows over K = 3, fewer k rows than blocks to share them)."""
    if not kernels.linear_available:
        pytest.skip("no AVX2 here")
    torch.manual_seed(rows * n)
    weight, x = torch.randn(n, k), torch.randn(1, rows, k)
    b = torch.randn(n) if bias else None
    packed = kernels.pack_linear(weight)
    isas: tuple[Isa, ...] = (1, 2)
    for isa in isas[: kernels.linear_isa]:
        out = kernels.linear(x, packed, b, n, isa=isa)
        assert out.shape == (1, rows, n)
        torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-4)
