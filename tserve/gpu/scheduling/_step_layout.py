"""A step's tokens laid out over the paged KV pool, as numpy int64 arrays; no torch.

Both the torch forward pass (:func:`tserve.gpu.forward._attention_step.build_step`, which
wraps these with ``torch.from_numpy``) and the native runner
(:mod:`tserve.gpu.forward._native`) build a step's layout here: the packed tokens in
chunk order, their positions, the pool slot each token's K/V goes to
(``slot = block * block_size + offset``) in each KV layer group, and each
sequence's block table of each group padded to one width (a block reclaimed
outside a sliding window, ``NO_BLOCK``, reads as the padding block 0: no
kernel reads it). Per-token lists are built in Python and become arrays
once: a step's fixed cost is a handful of calls, whatever the batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from tserve.gpu.scheduling._kv import NO_BLOCK
from tserve.gpu.scheduling._sequence import ScheduledChunk

__all__ = ["StepLayout", "block_tables", "lay_out", "token_tables"]


@dataclasses.dataclass(frozen=True, slots=True)
class StepLayout:
    """``packed [2 + groups, T]`` int64: rows ``tokens``, ``positions``, then
    ``slots`` of each KV layer group; ``offsets[i]``: the packed index of
    chunk ``i``'s first token (one more entry than chunks: the last is T)."""

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
        """``[groups, T]``: each group's row of slots (rows of one C array)."""
        rows: np.ndarray = self.packed[2:]
        return rows


def lay_out(chunks: Sequence[ScheduledChunk], block_size: int, num_groups: int = 1) -> StepLayout:
    """Pack ``chunks`` in chunk order. Every chunk's sequence must have block
    tables (``num_groups`` of them) covering ``start + len(token_ids)``
    positions (asserted)."""
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[list[int]] = [[] for _ in range(num_groups)]
    offsets = [0]
    for chunk in chunks:
        assert chunk.token_ids, "a scheduled chunk has at least one token"
        span = range(chunk.start, chunk.start + len(chunk.token_ids))
        tables = chunk.seq.block_tables
        assert len(tables) == num_groups, f"{chunk.seq.request_id}: {len(tables)} block tables"
        for table, row in zip(tables, slots, strict=True):
            assert len(table) * block_size >= span.stop, f"{chunk.seq.request_id}: table short"
            row += [table[p // block_size] * block_size + p % block_size for p in span]
        tokens += chunk.token_ids
        positions += span
        offsets.append(offsets[-1] + len(span))
    packed = np.array([tokens, positions, *slots], dtype=np.int64).reshape(2 + num_groups, -1)
    return StepLayout(packed, offsets)


def block_tables(
    members: Sequence[int],
    chunks: Sequence[ScheduledChunk],
    kv_lens: Sequence[int],
    block_size: int,
    group: int = 0,
) -> np.ndarray:
    """``[B, ceil(max(kv_lens) / block_size)]`` int64: each member's sequence's blocks
    of KV group ``group`` that hold its ``kv_lens`` keys, padding (and blocks
    reclaimed outside a window) -> block 0."""
    width = -(-max(kv_lens) // block_size)
    rows = []
    for i, kv_len in zip(members, kv_lens, strict=True):
        n = -(-kv_len // block_size)
        rows.append(chunks[i].seq.block_tables[group][:n] + [0] * (width - n))
    table = np.array(rows, dtype=np.int64).reshape(len(rows), width)
    table[table == NO_BLOCK] = 0
    return table


def token_tables(
    chunks: Sequence[ScheduledChunk], offsets: Sequence[int], block_size: int, num_groups: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """``(tables [groups, chunks, width], rows [T])``: chunk ``i``'s sequence's
    blocks of each KV group as row ``i`` (covering its keys through this step),
    and each token's row, for the fused step's attention."""
    kv_lens = [c.start + len(c.token_ids) for c in chunks]
    members = range(len(chunks))
    tables = np.stack(
        [block_tables(members, chunks, kv_lens, block_size, g) for g in range(num_groups)]
    )
    counts = [offsets[i + 1] - offsets[i] for i in range(len(chunks))]
    return tables, np.repeat(np.arange(len(chunks), dtype=np.int64), counts)
