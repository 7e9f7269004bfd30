"""Paged attention over tserve's own KV pool, plugged into transformers.

A step packs every scheduled token of every sequence into ONE row,
``input_ids[1, T]``, with per-token ``position_ids`` (so RoPE is right for any
offset). The linear layers therefore see exactly T tokens, no padding. Only
attention needs to know which token belongs to which sequence; it gets that
from a :class:`StepMetadata`, built once per step and handed down through the
model's ``**kwargs`` as ``tserve_step=`` (transformers forwards unknown kwargs
to the attention function).

Per layer, :func:`paged_attention_forward`:

1. writes this step's K/V into the pool at ``slot_mapping`` (one slot per token);
2. for each :class:`AttentionGroup` (decodes; prefill chunks): gathers the
   queries into a padded ``[B, H, Qmax, D]`` batch and each sequence's keys and
   values through its block table into ``[B, KVH, Kmax, D]``;
3. runs ONE ``scaled_dot_product_attention`` per group with a ``[B, 1, Qmax,
   Kmax]`` boolean mask (causal within the sequence, nothing past its length);
4. scatters the real (non-padding) rows back into packed order.

Decodes and prefill chunks are grouped apart so that a long chunk does not pad
every decode to its length. The pool layout is ``[layers, slots, KVH, D]``
with ``slot = block * block_size + offset``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Final

import torch
import torch.nn.functional as F

from tserve.gpu._sequence import ScheduledChunk

__all__ = [
    "ATTENTION_NAME",
    "AttentionGroup",
    "KVPool",
    "StepMetadata",
    "build_step",
    "paged_attention_forward",
    "register_paged_attention",
]

ATTENTION_NAME: Final = "tserve_paged"
"""The name under which :func:`paged_attention_forward` is registered."""


@dataclasses.dataclass(frozen=True, slots=True)
class KVPool:
    """Preallocated K and V for every layer: each ``[layers, slots, KVH, D]``."""

    k: torch.Tensor
    v: torch.Tensor
    block_size: int

    @property
    def num_slots(self) -> int:
        return int(self.k.shape[1])


@dataclasses.dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Sequences whose attention runs as one padded SDPA call.

    Padding entries of ``q_index`` and ``kv_slots`` point at index 0; the mask
    and ``out_rows`` keep them from mattering. Two shortcuts skip work that
    would change nothing: ``packed`` (the queries are one token per sequence,
    already contiguous in packed order: no gather, no scatter) and ``mask``
    None (no padding at all: every key is visible, or, with ``is_causal``,
    every query starts at position 0 so SDPA's own causal mask is exact).
    """

    q_index: torch.Tensor  # [B, Qmax] long: packed token index of each query
    kv_slots: torch.Tensor  # [B, Kmax] long: pool slot of each key position
    mask: torch.Tensor | None  # [B, 1, Qmax, Kmax] bool: True where the query may attend
    out_rows: torch.Tensor  # [n] long: rows of the flattened [B*Qmax] output that are real
    out_index: torch.Tensor  # [n] long: packed token index of each of those rows
    packed: tuple[int, int] | None = None  # queries are packed tokens [start, stop), Qmax == 1
    is_causal: bool = False  # only with mask None: Qmax == Kmax, all sequences unpadded

    def to(self, device: torch.device) -> AttentionGroup:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return dataclasses.replace(
            self,
            q_index=move(self.q_index),
            kv_slots=move(self.kv_slots),
            mask=None if self.mask is None else move(self.mask),
            out_rows=move(self.out_rows),
            out_index=move(self.out_index),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class StepMetadata:
    """Everything attention needs for one step; built once, used by every layer."""

    pool: KVPool
    slot_mapping: torch.Tensor  # [T] long: pool slot where each new token's K/V goes
    groups: tuple[AttentionGroup, ...]


def build_step(
    chunks: Sequence[ScheduledChunk], pool: KVPool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, StepMetadata]:
    """Pack ``chunks`` into ``(input_ids [1, T], position_ids [1, T], metadata)``.

    Tokens are packed in chunk order. Every chunk's sequence must have a block
    table covering ``start + len(token_ids)`` positions.
    """
    tokens: list[int] = []
    positions: list[int] = []
    for chunk in chunks:
        assert chunk.token_ids, "a scheduled chunk has at least one token"
        tokens.extend(chunk.token_ids)
        positions.extend(range(chunk.start, chunk.start + len(chunk.token_ids)))
    tables = _block_tables(chunks, pool.block_size)
    seq_of_token = torch.repeat_interleave(
        torch.arange(len(chunks)), torch.tensor([len(c.token_ids) for c in chunks])
    )
    pos = torch.tensor(positions)
    slot_mapping = tables[seq_of_token, pos // pool.block_size] * pool.block_size
    slot_mapping += pos % pool.block_size

    decodes = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
    prefills = [i for i, c in enumerate(chunks) if len(c.token_ids) > 1]
    offsets = _packed_offsets(chunks)
    groups = tuple(
        _group(members, chunks, tables, offsets, pool.block_size).to(device)
        for members in (decodes, prefills)
        if members
    )
    metadata = StepMetadata(pool, slot_mapping.to(device), groups)
    input_ids = torch.tensor([tokens], device=device)
    return input_ids, pos.unsqueeze(0).to(device), metadata


def _block_tables(chunks: Sequence[ScheduledChunk], block_size: int) -> torch.Tensor:
    """``[num_chunks, max_blocks]`` long: each chunk's block table, zero-padded."""
    needed = [-(-(c.start + len(c.token_ids)) // block_size) for c in chunks]
    width = max(needed)
    rows = []
    for chunk, n in zip(chunks, needed, strict=True):
        table = chunk.seq.block_table
        assert len(table) >= n, f"{chunk.seq.request_id}: block table too short"
        rows.append(table[:n] + [0] * (width - n))
    return torch.tensor(rows, dtype=torch.long)


def _packed_offsets(chunks: Sequence[ScheduledChunk]) -> list[int]:
    offsets = [0]
    for chunk in chunks:
        offsets.append(offsets[-1] + len(chunk.token_ids))
    return offsets


def _group(
    members: list[int],
    chunks: Sequence[ScheduledChunk],
    tables: torch.Tensor,
    offsets: list[int],
    block_size: int,
) -> AttentionGroup:
    """Index tensors (on CPU) for one padded attention batch over ``members``."""
    q_lens = torch.tensor([len(chunks[i].token_ids) for i in members])
    starts = torch.tensor([chunks[i].start for i in members])
    kv_lens = starts + q_lens
    q_max, kv_max = int(q_lens.max()), int(kv_lens.max())

    q_pos = torch.arange(q_max)
    q_valid = q_pos[None, :] < q_lens[:, None]  # [B, Qmax]
    first = torch.tensor([offsets[i] for i in members])
    q_index = torch.where(q_valid, first[:, None] + q_pos[None, :], 0)

    k_pos = torch.arange(kv_max)
    blocks = tables[members][:, : -(-kv_max // block_size)]
    slots = (blocks[:, :, None] * block_size + torch.arange(block_size)).flatten(1)[:, :kv_max]
    k_valid = k_pos[None, :] < kv_lens[:, None]  # [B, Kmax]
    kv_slots = torch.where(k_valid, slots, 0)

    out_rows = torch.nonzero(q_valid.flatten()).squeeze(1)
    out_index = q_index.flatten()[out_rows]
    packed = None
    if q_max == 1 and offsets[members[-1]] - offsets[members[0]] == len(members) - 1:
        packed = (offsets[members[0]], offsets[members[0]] + len(members))
    unpadded = bool((kv_lens == kv_max).all() and (q_lens == q_max).all())
    if unpadded and q_max == 1:  # one query per sequence, at its last position
        return AttentionGroup(q_index, kv_slots, None, out_rows, out_index, packed)
    if unpadded and q_max == kv_max:  # whole prompts from position 0
        return AttentionGroup(q_index, kv_slots, None, out_rows, out_index, packed, True)

    # Query j of a sequence sits at position start + j and sees keys 0..start+j.
    # Padding queries (j >= q_len) see every valid key, so no row is all-False.
    causal = k_pos[None, None, :] <= (starts[:, None, None] + q_pos[None, :, None])
    mask = (causal & k_valid[:, None, :]).unsqueeze(1)
    return AttentionGroup(q_index, kv_slots, mask, out_rows, out_index, packed)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    tserve_step: StepMetadata | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The transformers attention interface over the paged pool.

    ``query`` is ``[1, H, T, D]``, ``key``/``value`` ``[1, KVH, T, D]`` (RoPE
    applied); returns ``([1, T, H, D], None)``. Mutates the pool in place.
    """
    if tserve_step is None:
        raise RuntimeError(
            f"attention {ATTENTION_NAME!r} runs only inside ModelRunner.execute "
            "(the model was handed to a ModelRunner)"
        )
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention softcap / sinks are not supported")
    layer: int = module.layer_idx  # type: ignore[assignment]
    k_pool, v_pool = tserve_step.pool.k[layer], tserve_step.pool.v[layer]
    k_pool.index_copy_(0, tserve_step.slot_mapping, key[0].transpose(0, 1))
    v_pool.index_copy_(0, tserve_step.slot_mapping, value[0].transpose(0, 1))

    q_flat = query[0].transpose(0, 1)  # [T, H, D]
    groups = tserve_step.groups
    if len(groups) == 1 and groups[0].packed == (0, q_flat.shape[0]):  # decodes only
        o = _attend(groups[0], q_flat.unsqueeze(2), k_pool, v_pool, scaling)
        return o.squeeze(2).unsqueeze(0), None
    out = query.new_empty(q_flat.shape)
    for group in groups:
        if group.packed is not None:
            start, stop = group.packed
            o = _attend(group, q_flat[start:stop].unsqueeze(2), k_pool, v_pool, scaling)
            out[start:stop] = o.squeeze(2)
        else:
            q = q_flat[group.q_index].transpose(1, 2)  # [B, H, Qmax, D]
            o = _attend(group, q, k_pool, v_pool, scaling).transpose(1, 2).flatten(0, 1)
            out[group.out_index] = o[group.out_rows]  # from [B * Qmax, H, D]
    return out.unsqueeze(0), None


def _attend(
    group: AttentionGroup,
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """SDPA of ``q [B, H, Qmax, D]`` over the group's keys; returns ``[B, H, Qmax, D]``."""
    k = k_pool[group.kv_slots].transpose(1, 2)  # [B, KVH, Kmax, D]
    v = v_pool[group.kv_slots].transpose(1, 2)
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=group.mask,
        is_causal=group.is_causal,
        scale=scaling,
        enable_gqa=True,
    )


def register_paged_attention() -> None:
    """Register :func:`paged_attention_forward` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
