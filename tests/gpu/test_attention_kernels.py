"""A fused step's attention (``_attention_kernels.c``) against float64 attention.

Each case packs several sequences' chunks into one step (prefill chunks that
cross key tiles, query tiles and pool blocks, decodes beside them), fills the
pool with every key and value those tokens see and compares the kernel's
output, on every instruction set this CPU runs, with softmax attention
computed in float64 over the same (widened) keys and values.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from tserve.gpu.forward._native import KV_STORAGE
from tserve.gpu.kernels._decoder_abi import attend
from tserve.gpu.kernels._library import KV_CODES, set_threads
from tserve.gpu.kernels._quant_abi import QuantLibrary, quant_library

TOLERANCE = 2e-6
"""The largest difference from float64 allowed, relative to the largest |value|
in the pool: fp32 sums of products of unit-scale values over a few hundred keys,
each exponent within 2e-7 (measured: below 5e-7)."""


@dataclasses.dataclass(frozen=True)
class Chunk:
    """``length`` tokens of sequence ``seq`` from position ``start``."""

    seq: int
    start: int
    length: int


@dataclasses.dataclass(frozen=True)
class Case:
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    chunks: tuple[Chunk, ...]
    window: int = 0  # a sliding window's keys (0: none)
    softcap: float = 0.0  # scores capped by tanh (0: none)


CASES = {
    # SmolLM2's heads; one prompt from 0 past two key tiles and four query tiles.
    "smollm2": Case(9, 3, 64, 16, (Chunk(0, 0, 150),)),
    # A resumed prefill beside decodes of two other sequences and a 2-token chunk.
    "mixed": Case(
        9, 3, 64, 16, (Chunk(1, 0, 1), Chunk(0, 61, 70), Chunk(2, 200, 1), Chunk(3, 5, 2))
    ),
    # 16 query heads on one KV head of 6 dims: six tokens a query tile.
    "wide group": Case(16, 1, 6, 4, (Chunk(0, 3, 37), Chunk(1, 0, 9))),
    # Plain multi-head attention, odd block size, a tile of idle rows.
    "mha": Case(3, 3, 32, 5, (Chunk(0, 0, 33), Chunk(1, 17, 1), Chunk(2, 64, 66))),
    # Five heads of a group: rows that fill no whole vector.
    "group of five": Case(10, 2, 24, 8, (Chunk(0, 0, 97), Chunk(0, 97, 3))),
    # A sliding window shorter than a key tile: query tiles whose first key tiles
    # are wholly outside some rows' windows, decodes beside them.
    "window": Case(
        4, 1, 32, 4, (Chunk(0, 0, 150), Chunk(1, 80, 1), Chunk(2, 3, 1), Chunk(3, 40, 30)), 20
    ),
    # Gemma 2's soft-capped scores (a small cap, so that it bites) within a window.
    "softcap": Case(8, 4, 16, 4, (Chunk(0, 0, 90), Chunk(1, 30, 1), Chunk(2, 7, 3)), 40, 0.5),
    # A window longer than a key tile, a resumed prefill crossing it.
    "long window": Case(9, 3, 64, 16, (Chunk(0, 0, 70), Chunk(0, 70, 130), Chunk(1, 150, 1)), 100),
}


def _kernels() -> QuantLibrary:
    quant = quant_library()
    assert quant is not None, "the package is installed, so its kernels are built"
    return quant


def _isas() -> list[int]:
    return list(range(_kernels().best_isa + 1))


class Step:
    """A packed step of ``case``'s chunks over a pool holding every key they see."""

    def __init__(self, case: Case, kv: str, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.case = case
        ends: dict[int, int] = {}
        for c in case.chunks:
            ends[c.seq] = max(ends.get(c.seq, 0), c.start + c.length)
        width = max(-(-end // case.block_size) for end in ends.values())
        sequences = max(ends) + 1
        blocks = rng.permutation(sequences * width + 3)  # shuffled, some unused
        self.tables = blocks[: sequences * width].reshape(sequences, width).astype(np.int64)
        self.width = width
        num_slots = len(blocks) * case.block_size
        shape = (case.kv_heads, num_slots, case.head_dim)
        values = rng.standard_normal((2, *shape)).astype(np.float32)
        if kv == "bf16":  # the pool's bits: the fp32 values' upper halves
            stored = (values.view(np.uint32) >> 16).astype(np.uint16)
            self.k, self.v = stored
            self.widened = (stored.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        else:
            self.k, self.v = values.astype(KV_STORAGE[kv])
            self.widened = np.stack([self.k, self.v]).astype(np.float64)
        self.kv, self.num_slots = kv, num_slots
        self.positions = np.concatenate(
            [np.arange(c.start, c.start + c.length) for c in case.chunks]
        ).astype(np.int64)
        self.rows = np.repeat([c.seq for c in case.chunks], [c.length for c in case.chunks])
        self.rows = self.rows.astype(np.int64)
        q_width = case.heads * case.head_dim
        stride = q_width + 2 * case.kv_heads * case.head_dim  # the K/V columns are never read
        self.qkv = rng.standard_normal((len(self.positions), stride)).astype(np.float32)

    def run(self, isa: int, tokens: slice | None = None) -> np.ndarray:
        """The kernel's output for tokens ``tokens`` (all) as one call."""
        case = self.case
        span = tokens or slice(0, len(self.positions))
        qkv = np.ascontiguousarray(self.qkv[span])
        positions = np.ascontiguousarray(self.positions[span])
        rows = np.ascontiguousarray(self.rows[span])
        out = np.full((len(qkv), case.heads * case.head_dim), np.nan, dtype=np.float32)
        failed = attend(_kernels().library)(
            isa, qkv.ctypes.data, qkv.shape[1], len(qkv), positions.ctypes.data,
            self.tables.ctypes.data, self.width, rows.ctypes.data, self.k.ctypes.data,
            self.v.ctypes.data, self.num_slots, case.block_size, case.heads, case.kv_heads,
            case.head_dim, case.head_dim**-0.5, case.window, case.softcap, KV_CODES[self.kv],
            out.ctypes.data,
        )  # fmt: skip
        assert failed == 0
        return out

    def reference(self) -> np.ndarray:
        """Causal softmax attention (within the window) in float64 over the widened pool."""
        case = self.case
        dim, group = case.head_dim, case.heads // case.kv_heads
        out = np.empty((len(self.positions), case.heads, dim))
        keys, values = self.widened
        for t, (position, row) in enumerate(zip(self.positions, self.rows, strict=True)):
            p = np.arange(max(0, position + 1 - case.window) if case.window else 0, position + 1)
            slots = self.tables[row, p // case.block_size] * case.block_size + p % case.block_size
            q = self.qkv[t, : case.heads * dim].astype(np.float64).reshape(case.heads, dim)
            for h in range(case.heads):
                k, v = keys[h // group, slots], values[h // group, slots]
                scores = k @ q[h] * dim**-0.5
                if case.softcap:
                    scores = case.softcap * np.tanh(scores / case.softcap)
                weights = np.exp(scores - scores.max())
                out[t, h] = weights @ v / weights.sum()
        return out.reshape(len(self.positions), -1)


@pytest.mark.parametrize("kv", sorted(KV_CODES))
@pytest.mark.parametrize("name", sorted(CASES))
def test_attention_is_causal_softmax_attention_on_every_isa(name: str, kv: str) -> None:
    step = Step(CASES[name], kv)
    expected = step.reference()
    scale = float(np.abs(step.widened[1]).max())
    for isa in _isas():
        error = float(np.abs(step.run(isa) - expected).max()) / scale
        assert error <= TOLERANCE, (isa, error)


@pytest.mark.parametrize(
    ("name", "cuts"),
    [
        ("smollm2", [2, 33, 35, 99]),
        ("group of five", [2, 33, 35, 98]),
        ("mha", [2, 34, 36]),
        ("window", [2, 33, 35, 99]),
    ],
)
def test_splitting_a_prefill_into_calls_changes_no_bit(name: str, cuts: list[int]) -> None:
    """Each row's sums run in one order whatever tile it lands in, so calls over
    pieces of a step (each prefill piece two tokens or more: one alone is a
    decode) give the one call's output exactly."""
    step = Step(CASES[name], "fp16")
    bounds = [0, *cuts, len(step.positions)]
    for isa in _isas():
        pieces = [step.run(isa, slice(a, b)) for a, b in itertools.pairwise(bounds)]
        assert np.array_equal(np.concatenate(pieces), step.run(isa))


def test_threads_change_no_bit() -> None:
    step = Step(CASES["mixed"], "fp32")
    library = _kernels().library
    one = step.run(_kernels().best_isa)
    set_threads(library, 2)
    try:
        two = step.run(_kernels().best_isa)
    finally:
        set_threads(library, 1)
    assert np.array_equal(one, two)
