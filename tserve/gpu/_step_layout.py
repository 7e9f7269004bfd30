"""A step's tokens laid out over the paged KV pool, as numpy int64 arrays; no torch.

Both the torch forward pass (:func:`tserve.gpu._attention.build_step`, which
wraps these with ``torch.from_numpy``) and the native runner
(:mod:`tserve.gpu._native`) build a step's layout here: the packed tokens in
chunk order, their positions, the pool slot each token's K/V goes to
(``slot = block * block_size + offset``), and each sequence's block table
padded to one width. Per-token lists are built in Python and become arrays
once: a step's fixed cost is a handful of calls, whatever the batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from tserve.gpu._sequence import ScheduledChunk

__all__ = ["StepLayout", "block_tables", "lay_out", "token_tables"]


@dataclasses.dataclass(frozen=True, slots=True)
class StepLayout:
    """``packed [3, T]`` int64: rows ``tokens``, ``positions``, ``slots``;
    ``offsets[i]``: the packed index of chunk ``i``'s first token (one more
    entry than chunks: the last is T)."""

    packed: np.ndarray
    offsets: list[int]

    @property
    def tokens(self) -> np.ndarray:
        row: np.ndarray = self.packed[0]
        return row

    @property
    def positions(self) -> np.ndarray:
        row: np.ndarray = self.packed[1]
        return row

    @property
    def slots(self) -> np.ndarray:
        row: np.ndarray = self.packed[2]
        return row


def lay_out(chunks: Sequence[ScheduledChunk], block_size: int) -> StepLayout:
    """Pack ``chunks`` in chunk order. Every chunk's sequence must have a block
    table covering ``start + len(token_ids)`` positions (asserted)."""
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    offsets = [0]
    for chunk in chunks:
        assert chunk.token_ids, "a scheduled chunk has at least one token"
        span = range(chunk.start, chunk.start + len(chunk.token_ids))
        table = chunk.seq.block_table
        assert len(table) * block_size >= span.stop, f"{chunk.seq.request_id}: block table short"
        tokens += chunk.token_ids
        positions += span
        slots += [table[p // block_size] * block_size + p % block_size for p in span]
        offsets.append(offsets[-1] + len(span))
    packed = np.array([tokens, positions, slots], dtype=np.int64).reshape(3, -1)
    return StepLayout(packed, offsets)


def block_tables(
    members: Sequence[int],
    chunks: Sequence[ScheduledChunk],
    kv_lens: Sequence[int],
    block_size: int,
) -> np.ndarray:
    """``[B, ceil(max(kv_lens) / block_size)]`` int64: each member's sequence's blocks
    that hold its ``kv_lens`` keys, padding -> block 0."""
    width = -(-max(kv_lens) // block_size)
    rows = []
    for i, kv_len in zip(members, kv_lens, strict=True):
        n = -(-kv_len // block_size)
        rows.append(chunks[i].seq.block_table[:n] + [0] * (width - n))
    return np.array(rows, dtype=np.int64).reshape(len(rows), width)


def token_tables(
    chunks: Sequence[ScheduledChunk], offsets: Sequence[int], block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(tables [chunks, width], rows [T])``: chunk ``i``'s sequence's blocks as
    row ``i`` (covering its keys through this step), and each token's row, for
    the fused step's attention."""
    kv_lens = [c.start + len(c.token_ids) for c in chunks]
    tables = block_tables(range(len(chunks)), chunks, kv_lens, block_size)
    counts = [offsets[i + 1] - offsets[i] for i in range(len(chunks))]
    return tables, np.repeat(np.arange(len(chunks), dtype=np.int64), counts)
