"""A step's attention layout over the paged KV pool, built once per step.

:func:`build_step` packs the scheduled chunks into one row of tokens and says,
for every layer alike, where each new token's K/V goes (``slot_mapping``) and
which keys each token reads: either padded batches (:class:`AttentionGroup`,
decodes apart from prefill chunks, so that a long chunk does not pad every
decode to its length), which the torch forward pass's attention runs
(``_attention.py``), or each token's block tables (:class:`TokenTables`),
which the fused native decoder's C attention reads (``_decoder.py``).

Pool layout ``[group layers, KVH, slots, D]``, ``slot = block * block_size +
offset``. A model whose layers attend alike has one KV layer group of every
layer; one with sliding-window layers among global ones has several
(:mod:`tserve.gpu.scheduling._kv_groups`), each with its own block tables, so
each step has a row of slots and each attention group its key slots per KV
group. Index tensors are built on the CPU from the numpy layout
(:mod:`tserve.gpu.scheduling._step_layout`) and moved to the device once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from tserve.gpu.scheduling._kv_groups import KVGroups
from tserve.gpu.scheduling._sequence import ScheduledChunk
from tserve.gpu.scheduling._step_layout import block_tables, lay_out, token_tables

__all__ = ["AttentionGroup", "KVPool", "StepMetadata", "TokenTables", "build_step"]


@dataclasses.dataclass(frozen=True, slots=True)
class KVPool:
    """Preallocated K and V: each ``[group layers, KVH, slots, D]``; layer ``l``
    keeps its K/V in row ``groups.place(l)[1]`` at its group's slots."""

    k: torch.Tensor
    v: torch.Tensor
    block_size: int
    groups: KVGroups

    @property
    def num_slots(self) -> int:
        return int(self.k.shape[2])

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(K [KVH, slots, D], V, its KV group)`` of ``layer``."""
        group, row = self.groups.place(layer)
        return self.k[row], self.v[row], group


@dataclasses.dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Sequences whose attention runs as one padded SDPA call.

    Index tensors are flat (row-major over ``[B, Qmax]`` / ``[B, Kmax]``) so
    that gathers are ``index_select`` (a row copy) rather than advanced
    indexing. Padding entries point at index 0; the mask and ``out_rows`` keep
    them from mattering. Shortcuts that skip work which would change nothing:

    * ``packed``: the queries are already contiguous packed tokens ``[start,
      stop)`` in ``[B, Qmax]`` order (one token per sequence, or one sequence):
      no gather, no scatter;
    * ``fresh``: every sequence starts at position 0, so its keys and values
      are exactly this step's new ones for its query tokens: they are taken
      like the queries, not gathered from the pool (``kv_slots`` is unused);
    * ``mask`` None: no padding at all: every key is visible, or, with
      ``is_causal``, every query starts at position 0 so SDPA's own causal
      mask is exact.
    """

    shape: tuple[int, int, int]  # (B, Qmax, Kmax)
    # The next three are empty when ``packed`` (the queries need no gather or scatter).
    q_index: torch.Tensor  # [B * Qmax] long: packed token index of each query
    out_rows: torch.Tensor  # [n] long: rows of the flattened [B*Qmax] output that are real
    out_index: torch.Tensor  # [n] long: packed token index of each of those rows
    # Per KV group: [B * Kmax_g] long: pool slot of each key position from the sequence's
    # first in ``kv_firsts`` (padding -> slot 0); empty if fresh.
    kv_slots: tuple[torch.Tensor, ...]
    # Per KV group, [B, ceil(Kmax / block_size)] long: each sequence's blocks (padding
    # -> block 0), and [B] long: its number of keys. Only for a decode group that reads
    # the pool (empty otherwise), for the fused CPU kernel alone: kept on the CPU by to().
    block_tables: tuple[torch.Tensor, ...]
    kv_lens: torch.Tensor
    mask: torch.Tensor | None  # [B, 1, Qmax, Kmax] bool: True where the query may attend
    # [B, 1, Kmax] float, 0 where visible and -inf past a sequence's length: the mask of a
    # padded one-query group as a bias for the product path. None when nothing is padded.
    key_bias: torch.Tensor | None
    packed: tuple[int, int] | None = None  # queries are packed tokens [start, stop)
    is_causal: bool = False  # only with mask None: Qmax == Kmax, all sequences unpadded
    fresh: bool = False  # every sequence starts at 0: keys/values are this step's
    # A decode group that reads the pool runs as two batched products, not SDPA.
    products: bool = False
    starts: tuple[int, ...] = ()  # each sequence's first query position
    kv_lengths: tuple[int, ...] = ()  # each sequence's keys
    # Per KV group: each sequence's first key read (0, or in a sliding-window group
    # the first key of its first query's window: no block before it is read), and
    # Kmax_g, the most keys read from there. Empty if fresh (every key from 0).
    kv_firsts: tuple[tuple[int, ...], ...] = ()
    kv_maxes: tuple[int, ...] = ()

    def keys_read(self, kv_group: int) -> tuple[tuple[int, ...], int]:
        """``(each sequence's first key, Kmax)`` of the keys read for ``kv_group``."""
        if not self.kv_firsts:
            return (0,) * self.shape[0], self.shape[2]
        return self.kv_firsts[kv_group], self.kv_maxes[kv_group]

    def window_mask(self, window: int, device: torch.device, kv_group: int = 0) -> torch.Tensor:
        """``[B, 1, Qmax, Kmax_g]`` bool over the keys read for ``kv_group``: True
        where a query may attend (causal, within its sequence; with a sliding
        ``window`` > 0, its last ``window`` keys); padding queries see their
        sequence's first key read."""
        _, q_max, _ = self.shape
        firsts, kv_max = self.keys_read(kv_group)
        k_pos = torch.tensor(firsts)[:, None, None] + torch.arange(kv_max)[None, None, :]
        q_pos = torch.tensor(self.starts)[:, None, None] + torch.arange(q_max)[None, :, None]
        valid = k_pos < torch.tensor(self.kv_lengths)[:, None, None]
        mask = (k_pos <= q_pos) & valid
        if window:
            mask &= k_pos > q_pos - window
        mask[:, :, 0] |= ~mask.any(-1)  # a padding query past its sequence: any one key
        return mask.unsqueeze(1).to(device)

    def to(self, device: torch.device) -> AttentionGroup:
        if self.q_index.device == device:
            return self

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return dataclasses.replace(
            self,
            q_index=move(self.q_index),
            kv_slots=tuple(move(slots) for slots in self.kv_slots),
            mask=None if self.mask is None else move(self.mask),
            key_bias=None if self.key_bias is None else move(self.key_bias),
            out_rows=move(self.out_rows),
            out_index=move(self.out_index),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class TokenTables:
    """Each token's sequence's blocks, for the fused step's attention (token
    ``t`` at position ``p`` over keys ``0..p`` of its sequence; on CPU)."""

    # [groups, chunks, width] long: each chunk's sequence's blocks per KV group, padding -> 0
    tables: torch.Tensor
    rows: torch.Tensor  # [T] long: the row of ``tables`` of each token


@dataclasses.dataclass(frozen=True, slots=True)
class StepMetadata:
    """Everything attention needs for one step; built once, used by every layer.

    Either ``groups`` (padded batches for :func:`attend_groups`) or, for a step
    that runs on the fused decoder, ``token_tables`` (``groups`` then empty).
    """

    pool: KVPool
    slot_mapping: torch.Tensor  # [groups, T] long: pool slot where each new token's K/V goes
    groups: tuple[AttentionGroup, ...]
    token_tables: TokenTables | None = None


def build_step(
    chunks: Sequence[ScheduledChunk],
    pool: KVPool,
    device: torch.device,
    *,
    decode_products: bool = False,
    per_token: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, StepMetadata]:
    """Pack ``chunks`` into ``(input_ids [1, T], position_ids [1, T], metadata)``.

    ``decode_products``: decodes attend as batched products
    (:attr:`AttentionGroup.products`), the runner's choice for its device.
    ``per_token``: the metadata has :class:`TokenTables` instead of groups
    (CPU only: the fused decoder's).

    Tokens are packed in chunk order (:func:`~tserve.gpu.scheduling._step_layout.lay_out`).
    Every chunk's sequence must have a block table covering ``start +
    len(token_ids)`` positions.
    """
    block_size, windows = pool.block_size, pool.groups.windows
    num_groups = len(windows)
    layout = lay_out(chunks, block_size, num_groups)
    offsets = layout.offsets
    packed = torch.from_numpy(layout.packed).to(device)  # one transfer
    if per_token:
        tables, rows = token_tables(chunks, offsets, block_size, num_groups)
        token_rows = TokenTables(torch.from_numpy(tables), torch.from_numpy(rows))
        return packed[0:1], packed[1:2], StepMetadata(pool, packed[2:], (), token_rows)

    decodes = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
    prefills = [i for i, c in enumerate(chunks) if len(c.token_ids) > 1]
    groups = tuple(
        _group(members, chunks, offsets, block_size, decode_products, windows).to(device)
        for members in (decodes, prefills)
        if members
    )
    return packed[0:1], packed[1:2], StepMetadata(pool, packed[2:], groups)


def _group(
    members: list[int],
    chunks: Sequence[ScheduledChunk],
    offsets: list[int],
    block_size: int,
    decode_products: bool,
    windows: Sequence[int],
) -> AttentionGroup:
    """Index tensors (on CPU) for one padded attention batch over ``members``;
    ``windows``: each KV group's sliding window (0: none)."""
    q_lens = [len(chunks[i].token_ids) for i in members]
    starts = [chunks[i].start for i in members]
    firsts = [offsets[i] for i in members]
    kv_lens = [start + n for start, n in zip(starts, q_lens, strict=True)]
    batch, q_max, kv_max = len(members), max(q_lens), max(kv_lens)

    # Queries in [B, Qmax] order (padding -> token 0), and where real rows go.
    packed = None
    q_index: list[int] = []
    out_rows: list[int] = []
    if (q_max == 1 or batch == 1) and firsts[-1] - firsts[0] == (batch - 1) * q_max:
        packed = (firsts[0], firsts[0] + batch * q_max)  # no padding, already in order
    else:
        for b, (first, n) in enumerate(zip(firsts, q_lens, strict=True)):
            q_index += [*range(first, first + n), *[0] * (q_max - n)]
            out_rows += range(b * q_max, b * q_max + n)
    out_index = [q_index[row] for row in out_rows]

    fresh = not any(starts)  # keys are the queries' own tokens: no pool gather
    empty = torch.empty(0, dtype=torch.long)
    kv_slots, tables, lens = (empty,) * len(windows), (empty,) * len(windows), empty
    kv_firsts: tuple[tuple[int, ...], ...] = ()
    kv_maxes: tuple[int, ...] = ()
    if not fresh:
        kv_firsts = tuple(
            tuple(max(0, start - window + 1) if window else 0 for start in starts)
            for window in windows
        )
        kv_maxes = tuple(
            max(n - first for n, first in zip(kv_lens, firsts, strict=True)) for firsts in kv_firsts
        )
        per_group = [
            _kv_slots(members, chunks, kv_lens, firsts, block_size, g)
            for g, firsts in enumerate(kv_firsts)
        ]
        kv_slots = tuple(slots for _, slots in per_group)
        if q_max == 1:  # read by the fused decode kernel
            tables = tuple(blocks for blocks, _ in per_group)
            lens = torch.tensor(kv_lens, dtype=torch.long)

    mask = None
    unpadded = all(n == q_max for n in q_lens) and all(k == kv_max for k in kv_lens)
    # Unpadded, one query per sequence at its last position: every key is visible.
    # Unpadded whole prompts from position 0: SDPA's own causal mask is exact.
    is_causal = unpadded and q_max == kv_max > 1
    if not unpadded or q_max not in (1, kv_max):
        # Query j of a sequence sits at position start + j and sees keys 0..start+j.
        # Padding queries (j >= q_len) see every valid key, so no row is all-False.
        k_pos, q_pos = torch.arange(kv_max), torch.arange(q_max)
        causal = k_pos[None, None, :] <= torch.tensor(starts)[:, None, None] + q_pos[None, :, None]
        k_valid = k_pos[None, :] < torch.tensor(kv_lens)[:, None]  # [B, Kmax]
        mask = (causal & k_valid[:, None, :]).unsqueeze(1)
    key_bias = None
    if mask is not None and q_max == 1:
        key_bias = torch.zeros(mask.shape[0], 1, kv_max).masked_fill_(~mask[:, 0], -math.inf)
    return AttentionGroup(
        shape=(batch, q_max, kv_max),
        q_index=torch.tensor(q_index, dtype=torch.long),
        kv_slots=kv_slots,
        block_tables=tables,
        kv_lens=lens,
        mask=mask,
        key_bias=key_bias,
        out_rows=torch.tensor(out_rows, dtype=torch.long),
        out_index=torch.tensor(out_index, dtype=torch.long),
        packed=packed,
        is_causal=is_causal,
        fresh=fresh,
        products=decode_products and q_max == 1 and not fresh,
        starts=tuple(starts),
        kv_lengths=tuple(kv_lens),
        kv_firsts=kv_firsts,
        kv_maxes=kv_maxes,
    )


def _kv_slots(
    members: list[int],
    chunks: Sequence[ScheduledChunk],
    kv_lens: list[int],
    firsts: Sequence[int],
    block_size: int,
    group: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, blocks] block tables, [B * Kmax] pool slot of each key position read)``
    of KV group ``group``: sequence ``b``'s keys ``firsts[b] .. kv_lens[b] - 1``,
    ``Kmax`` the most of them; padding -> block 0, slot 0."""
    tables = torch.from_numpy(block_tables(members, chunks, kv_lens, block_size, group))
    counts = [n - first for n, first in zip(kv_lens, firsts, strict=True)]
    kv_max = max(counts)
    positions = torch.tensor(firsts)[:, None] + torch.arange(kv_max)[None, :]  # [B, Kmax]
    valid = torch.arange(kv_max)[None, :] < torch.tensor(counts)[:, None]
    positions = torch.where(valid, positions, 0)
    blocks = tables.gather(1, positions // block_size)
    slots = torch.where(valid, blocks * block_size + positions % block_size, 0)
    return tables, slots.flatten()
