"""The fused decoder (every layer of a quantized step in one C call) against the
forward pass it stands in for.

One model serves both sides: :meth:`PagedLlama.forward` runs a step built
with token tables on its fused decoder (bound to one pool) and any other
step op by op (over the step's own pool), so the two pools see the same
weights. Decodes over the same pool contents give the same logits bit for
bit (the same kernels in the same order); prefill chunks attend as causal
blocks here and through SDPA there, so they agree up to float rounding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tests.gpu import kquant_blocks
from tserve.gpu.forward._attention_step import KVPool, build_step
from tserve.gpu.forward._decoder import MAX_FUSED_TOKENS, fused_decoder
from tserve.gpu.forward._llama import LayerWeights, PagedLlama
from tserve.gpu.forward._quant import (
    FORMATS,
    Activations,
    QuantizedLinear,
    QuantizedWeight,
    quant_kernels,
)
from tserve.gpu.forward._runner import ModelRunner
from tserve.gpu.forward._step_ops import TORCH_OPS
from tserve.gpu.kernels._cpu_kernels import CpuKernels, cpu_kernels
from tserve.gpu.scheduling._kv_groups import KVGroups
from tserve.gpu.scheduling._sequence import ScheduledChunk, Sequence
from tserve.protocol import SamplingParams

BLOCK_SIZE, NUM_BLOCKS, VOCAB, POSITIONS = 4, 24, 100, MAX_FUSED_TOKENS + 16


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    layers: int = 2


# 16 query heads on one KV head of 6 (a Q/K/V width of 108: a partial panel of
# 8 rows); three heads of 32 as plain multi-head attention.
SMALL = [Shape(64, 16, 1, 6, 96), Shape(96, 3, 3, 32, 64, layers=3)]
K_SHAPE = Shape(256, 4, 2, 64, 256)  # K-quants: rows of whole 256-weight super-blocks
CASES: list[tuple[str, Activations, Shape]] = [
    *[("Q4_1", "int8", s) for s in SMALL],
    ("Q8_0", "int8", SMALL[0]),
    ("Q4_0", "fp32", SMALL[1]),
    ("F16", "fp32", SMALL[0]),
    ("Q4_K", "int8", K_SHAPE),
    ("Q6_K", "fp32", K_SHAPE),
]
KV_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _linear(
    fmt: str, n: int, k: int, activations: Activations, rng: np.random.Generator
) -> QuantizedLinear:
    """A random ``[n, k]`` weight in ``fmt`` of about unit gain."""
    import gguf

    kernels = quant_kernels()
    assert kernels is not None, "the package is installed, so its kernels are built"
    if fmt in kquant_blocks.FORMATS:
        raw = kquant_blocks.random_rows(fmt, n, k, rng)
    else:
        values = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
        raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType[fmt])
    data = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(n, -1))
    return QuantizedLinear(QuantizedWeight(FORMATS[fmt], data, n, k), kernels, activations)


def _model(fmt: str, activations: Activations, shape: Shape, seed: int = 0) -> PagedLlama:
    rng = np.random.default_rng(seed)
    hidden, dim = shape.hidden, shape.head_dim

    def linear(n: int, k: int) -> QuantizedLinear:
        return _linear(fmt, n, k, activations, rng)

    def norm() -> torch.Tensor:
        return torch.from_numpy(rng.uniform(0.5, 1.5, hidden).astype(np.float32))

    layers = [
        LayerWeights(
            i,
            qkv=linear((shape.heads + 2 * shape.kv_heads) * dim, hidden),
            o=linear(hidden, shape.heads * dim),
            gate_up=linear(2 * shape.inter, hidden),
            down=linear(hidden, shape.inter),
            attn_norm=norm(),
            mlp_norm=norm(),
        )
        for i in range(shape.layers)
    ]
    table = torch.from_numpy(rng.standard_normal((VOCAB, hidden)).astype(np.float32))
    angles = torch.arange(POSITIONS)[:, None] * 10000.0 ** (-torch.arange(0, dim, 2) / dim)
    return PagedLlama(
        embed=torch.nn.Embedding(VOCAB, hidden, _weight=table, _freeze=True),
        layers=layers,
        norm=norm(),
        lm_head=_linear("Q8_0", VOCAB, hidden, "int8", rng),
        rope=(torch.cos(angles).float(), torch.sin(angles).float()),
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        head_dim=dim,
        eps=1e-5,
        vocab_size=VOCAB,
        ops=_cpu_kernels(),
    )


def _cpu_kernels() -> CpuKernels:
    kernels = cpu_kernels()
    assert kernels is not None, "the package is installed, so its kernels are built"
    return kernels


def _pool(model: PagedLlama, dtype: torch.dtype) -> KVPool:
    shape = (len(model.layers), model.num_kv_heads, NUM_BLOCKS * BLOCK_SIZE, model.head_dim)
    groups = KVGroups.single(len(model.layers))
    k, v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    return KVPool(k, v, BLOCK_SIZE, groups)


def _sequences() -> tuple[Sequence, Sequence]:
    """Two sequences whose blocks interleave, in reverse order."""
    blocks = list(range(NUM_BLOCKS))[::-1]
    a, b = Sequence("a", [], SamplingParams()), Sequence("b", [], SamplingParams())
    a.block_table, b.block_table = blocks[0::2], blocks[1::2]
    return a, b


def _steps() -> Iterator[list[ScheduledChunk]]:
    """Chunked prefill beside decodes, then decodes: ``a``'s prompt in chunks of
    5 and 4 (the first not sampled), ``b``'s in one of 3, then both decode."""
    a, b = _sequences()
    tokens = [(i * 37 + 11) % VOCAB for i in range(40)]
    yield [ScheduledChunk(a, 0, tokens[:5], False), ScheduledChunk(b, 0, tokens[20:23], True)]
    yield [ScheduledChunk(a, 5, tokens[5:9], True), ScheduledChunk(b, 3, [tokens[23]], True)]
    for i in range(5):
        yield [
            ScheduledChunk(a, 9 + i, [tokens[9 + i]], True),
            ScheduledChunk(b, 4 + i, [tokens[24 + i]], True),
        ]


def _run(
    model: PagedLlama, step_chunks: list[ScheduledChunk], pool: KVPool, fused: bool
) -> torch.Tensor:
    ids, positions, step = build_step(step_chunks, pool, torch.device("cpu"), per_token=fused)
    ends = np.cumsum([len(c.token_ids) for c in step_chunks]) - 1
    keep = torch.tensor([int(e) for e, c in zip(ends, step_chunks, strict=True) if c.sample])
    with torch.inference_mode():
        logits: torch.Tensor = model(ids[0], positions[0], step, keep)
    return logits


@pytest.mark.parametrize(("fmt", "activations", "shape"), CASES)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_decodes_are_the_forward_pass_bit_for_bit(
    fmt: str, activations: Activations, shape: Shape, kv_dtype: torch.dtype
) -> None:
    model = _model(fmt, activations, shape)
    fused_pool, plain_pool = _pool(model, kv_dtype), _pool(model, kv_dtype)
    model.decoder = fused_decoder(model, fused_pool)
    assert model.decoder is not None
    for i, chunks in enumerate(_steps()):
        if i < 2:  # the prompts, op by op into both pools alike
            for pool in (fused_pool, plain_pool):
                _run(model, chunks, pool, fused=False)
            continue
        ours = _run(model, chunks, fused_pool, fused=True)
        assert torch.equal(ours, _run(model, chunks, plain_pool, fused=False))
    assert torch.equal(fused_pool.k, plain_pool.k) and torch.equal(fused_pool.v, plain_pool.v)


@pytest.mark.parametrize(("fmt", "activations", "shape"), CASES)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("reference", ["cpu-kernels", "torch-only"])
def test_chunked_prefill_and_decodes_match_the_forward_pass(
    fmt: str, activations: Activations, shape: Shape, kv_dtype: torch.dtype, reference: str
) -> None:
    model = _model(fmt, activations, shape)
    fused_pool, plain_pool = _pool(model, kv_dtype), _pool(model, kv_dtype)
    model.decoder = fused_decoder(model, fused_pool)
    assert model.decoder is not None
    ops = model.ops
    for chunks in _steps():
        ours = _run(model, chunks, fused_pool, fused=True)
        if reference == "torch-only":
            model.ops = TORCH_OPS
        expected = _run(model, chunks, plain_pool, fused=False)
        model.ops = ops
        error = float((ours - expected).abs().max() / expected.abs().max())
        assert error <= _bound(activations, kv_dtype)


def _bound(activations: Activations, kv_dtype: torch.dtype) -> float:
    """The largest difference of two logits of a step, relative to the largest logit.

    Attention in causal blocks here and through SDPA (or torch's ops) there sum
    in other orders: about 1e-7 of a logit. Where that moves a K/V value across
    a rounding boundary of the pool's dtype, or an activation across one of its
    8-bit rounding, the step of that rounding enters the logits (measured: up
    to 3e-3 with fp16 K/V, 7e-3 with 8-bit activations and bf16 K/V)."""
    bound = 1e-5
    if kv_dtype != torch.float32:
        bound = max(bound, 4 * torch.finfo(kv_dtype).eps)
    if activations == "int8":
        bound = max(bound, 2 / 127)
    return bound


def test_a_model_with_a_dense_product_gets_no_fused_decoder() -> None:
    shape = SMALL[0]
    model = _model("Q4_1", "int8", shape)
    layer = model.layers[1]
    assert isinstance(layer, LayerWeights)
    layer.o = torch.nn.Linear(shape.heads * shape.head_dim, shape.hidden, bias=False)
    assert fused_decoder(model, _pool(model, torch.float32)) is None


def test_the_runner_runs_short_steps_fused_and_long_ones_op_by_op() -> None:
    """A prompt longer than a fused step, then decodes; the same prompt in short
    chunks: the same logits, up to float rounding. Either way every step, op by
    op or fused, adds one to the runner's progress per layer."""
    prompt = [(i * 37 + 11) % VOCAB for i in range(MAX_FUSED_TOKENS + 6)]
    results = []
    for chunk in (len(prompt), 5):
        # fp32 activations: a tuned product may take the long prompt through an
        # fp32 copy of its weight, which rounds alike only for fp32 activations.
        blocks = POSITIONS // BLOCK_SIZE
        model = _model("Q4_0", "fp32", SMALL[0])
        runner = ModelRunner(model, num_blocks=blocks, block_size=BLOCK_SIZE)
        seq = Sequence("s", prompt, SamplingParams())
        seq.block_table = list(range(blocks))[::-1]
        rows = []
        for start in range(0, len(prompt), chunk):
            piece = prompt[start : start + chunk]
            sample = start + chunk >= len(prompt)
            logits = runner.execute([ScheduledChunk(seq, start, piece, sample)])
            if sample:
                rows.append(logits)
        assert isinstance(runner.model, PagedLlama) and runner.model.decoder is not None
        for p in range(len(prompt), len(prompt) + 4):
            rows.append(runner.execute([ScheduledChunk(seq, p, [p % VOCAB], True)]))
        steps = -(-len(prompt) // chunk) + 4
        assert runner.progress[0] == steps * len(model.layers)
        results.append(torch.cat(rows))
    torch.testing.assert_close(results[0], results[1], atol=1e-4, rtol=1e-4)
