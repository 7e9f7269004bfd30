"""Paged attention over tserve's own KV pool, plugged into transformers.

A step packs every scheduled token of every sequence into ONE row,
``input_ids[1, T]``, with per-token ``position_ids`` (so RoPE is right for any
offset). The linear layers therefore see exactly T tokens, no padding. Only
attention needs to know which token belongs to which sequence; it gets that
from a :class:`~tserve.gpu.forward._attention_step.StepMetadata`, built once
per step (``_attention_step.py``) and handed down through the model's
``**kwargs`` as ``tserve_step=`` (transformers forwards unknown kwargs to the
attention function).

Per layer, :func:`paged_attention_forward`:

1. writes this step's K/V into the pool at ``slot_mapping`` (one slot per token);
2. for each attention group (decodes; prefill chunks): takes the
   queries as a padded ``[B, H, Qmax, D]`` batch (a view when they are already
   in order) and each sequence's keys and values, ``[KVH, B, Kmax, D]``,
   through its block table with ``index_select`` (or straight from this step's
   new K/V when every sequence in the group starts at position 0);
3. runs ONE ``scaled_dot_product_attention`` per group with a ``[B, 1, Qmax,
   Kmax]`` boolean mask (causal within the sequence, nothing past its length),
   or none when nothing is padded. Decodes run as two batched products and a
   softmax instead where the model runner asks for it (``decode_products``:
   1.5x SDPA's CPU kernel in fp32) or, in
   :class:`~tserve.gpu.forward._llama.PagedLlama`, through the fused kernel
   :func:`attend_groups` is handed;
4. scatters the real (non-padding) rows back into packed order.

With the pool's layout (``_attention_step.py``), B sequences' keys gather as
``[KVH, B * Kmax, D]``, per KV group of layers.

The pool's dtype (``--kv-cache-dtype``) may differ from the model's: K/V are
cast to it as they are written and back to the queries' dtype as they are
gathered, so attention runs in the model's dtype over K/V exactly as the pool
holds them. A ``fresh`` group, which takes this step's own K/V instead, rounds
them the same way first: whether a prompt's keys come from the pool (a later
chunk, a cached prefix, a recomputation after preemption) or not changes no
value, as in fp32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Final, NamedTuple

import torch
import torch.nn.functional as F

from tserve.gpu.forward._attention_step import AttentionGroup, StepMetadata

__all__ = [
    "ATTENTION_NAME",
    "Tokens",
    "attend_groups",
    "paged_attention_forward",
    "register_paged_attention",
]

ATTENTION_NAME: Final = "tserve_paged"
"""The name under which :func:`paged_attention_forward` is registered."""


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
    A layer's ``sliding_window`` and ``softcap`` (Gemma's) are honoured;
    attention sinks (``s_aux``) are not (the runner refuses such models).
    """
    if tserve_step is None:
        raise RuntimeError(
            f"attention {ATTENTION_NAME!r} runs only inside ModelRunner.execute "
            "(the model was handed to a ModelRunner)"
        )
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention sinks are not supported")
    window = int(kwargs.get("sliding_window") or 0)
    softcap = float(kwargs.get("softcap") or 0.0)
    layer: int = module.layer_idx  # type: ignore[assignment]
    new = Tokens(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1))
    k_pool, v_pool, group = tserve_step.pool.layer(layer)
    slots = tserve_step.slot_mapping[group]
    k_pool.index_copy_(1, slots, key[0].to(k_pool.dtype))
    v_pool.index_copy_(1, slots, value[0].to(v_pool.dtype))
    out = attend_groups(
        tserve_step.groups, new, k_pool, v_pool, scaling, None, window, softcap, group
    )
    return out.unsqueeze(0), None


class Tokens(NamedTuple):
    """This step's packed queries, keys and values: ``[T, heads, D]`` each."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def attend_groups(
    groups: Sequence[AttentionGroup],
    new: Tokens,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    scaling: float | None,
    faster: Callable[[AttentionGroup, Tokens], torch.Tensor | None] | None = None,
    window: int = 0,
    softcap: float = 0.0,
    kv_group: int = 0,
) -> torch.Tensor:
    """Attention of this step's packed queries ``new.q [T, H, D]`` over the pool
    (this step's keys and values already written): ``[T, H, D]``, group by group;
    ``faster(group, new)`` gives a group's ``[B * Qmax, H, D]`` or None (torch's turn).
    ``window`` > 0: each query attends to its last ``window`` keys only;
    ``softcap`` > 0: scores become ``softcap * tanh(score / softcap)``;
    ``kv_group``: the KV layer group whose slots ``k_pool`` and ``v_pool`` are read at."""

    def attend(group: AttentionGroup) -> torch.Tensor:
        o = None if faster is None else faster(group, new)
        if o is None:
            return _attend(group, new, k_pool, v_pool, scaling, window, softcap, kv_group)
        return o

    num_tokens = new.q.shape[0]
    if len(groups) == 1 and groups[0].packed == (0, num_tokens):  # one group, in packed order
        return attend(groups[0])
    out = new.q.new_empty(new.q.shape)
    for group in groups:
        o = attend(group)
        if group.packed is not None:
            start, stop = group.packed
            out[start:stop] = o
        else:
            out.index_copy_(0, group.out_index, o.index_select(0, group.out_rows))
    return out


def _attend(
    group: AttentionGroup,
    new: Tokens,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    scaling: float | None,
    window: int = 0,
    softcap: float = 0.0,
    kv_group: int = 0,
) -> torch.Tensor:
    """Attention for one group; returns ``[B * Qmax, H, D]`` (rows in ``[B, Qmax]`` order)."""
    batch, _, _ = group.shape
    _, kv_max = group.keys_read(kv_group)
    q = _take(new.q, group)
    mask, key_bias, is_causal = group.mask, group.key_bias, group.is_causal
    if window:
        mask, is_causal = group.window_mask(window, q.device, kv_group), False
        if group.products:  # one query per sequence: the mask as a bias
            key_bias = torch.zeros(batch, 1, kv_max, device=q.device, dtype=q.dtype)
            key_bias.masked_fill_(~mask[:, 0], -math.inf)
    if group.fresh:  # the keys of these queries are their own tokens: [B, KVH, Qmax, D]
        k = _as_stored(_take(new.k, group), k_pool.dtype).transpose(1, 2)
        v = _as_stored(_take(new.v, group), v_pool.dtype).transpose(1, 2)
    else:  # [KVH, B, Kmax, D], widened (or narrowed) from the pool's dtype to the queries'
        slots = group.kv_slots[kv_group]
        k = _gather(k_pool, slots, q.dtype).view(-1, batch, kv_max, k_pool.shape[-1])
        v = _gather(v_pool, slots, q.dtype).view(-1, batch, kv_max, v_pool.shape[-1])
        if group.products and not softcap:
            return _attend_decode(q, k, v, key_bias, scaling)
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    if softcap:  # SDPA has no soft-cap: the products, the cap and the softmax in torch
        full = group.window_mask(window, q.device, kv_group)
        return _attend_capped(q, k, v, full, scaling, softcap)
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2),  # [B, H, Qmax, D]
        k,  # [B, KVH, Kmax, D]
        v,
        attn_mask=mask,
        is_causal=is_causal,
        scale=scaling,
        enable_gqa=True,
    )
    return o.transpose(1, 2).flatten(0, 1)


def _attend_capped(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scaling: float | None,
    softcap: float,
) -> torch.Tensor:
    """Soft-capped attention: ``q [B, Qmax, H, D]``, ``k``/``v`` ``[B, KVH, Kmax,
    D]``, ``mask [B, 1, Qmax, Kmax]`` -> ``[B * Qmax, H, D]``, as transformers'
    eager Gemma 2 attention (scale, divide by the cap, tanh, times the cap, mask,
    softmax)."""
    heads, dim = q.shape[2], q.shape[3]
    group = heads // k.shape[1]
    keys, values = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = dim**-0.5 if scaling is None else scaling
    scores = torch.matmul(q.transpose(1, 2), keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, -math.inf)
    out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [B, H, Qmax, D]
    return out.transpose(1, 2).flatten(0, 1)


def _attend_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_bias: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor:
    """One query per sequence as batched products: ``q [B, 1, H, D]``, ``k``/``v``
    ``[KVH, B, Kmax, D]`` -> ``[B, H, D]``.

    Query heads are grouped by the key/value head they share, as in
    transformers' ``repeat_kv``: query head ``h`` reads KV head ``h // (H // KVH)``.
    """
    kv_heads, batch, _, dim = k.shape
    scale = dim**-0.5 if scaling is None else scaling
    grouped = q.view(batch, kv_heads, -1, dim).transpose(0, 1)  # [KVH, B, H/KVH, D]
    scores = torch.matmul(grouped, k.transpose(-1, -2)).mul_(scale)  # [KVH, B, H/KVH, Kmax]
    if key_bias is not None:
        scores.add_(key_bias)
    out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [KVH, B, H/KVH, D]
    return out.transpose(0, 1).reshape(batch, -1, dim)


def _as_stored(x: torch.Tensor, stored: torch.dtype) -> torch.Tensor:
    """``x`` rounded as a pool of dtype ``stored`` holds it, in ``x``'s own dtype."""
    return x if x.dtype == stored else x.to(stored).to(x.dtype)


def _gather(pool: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``pool [KVH, slots, D]`` at ``slots``, in ``dtype``: ``[KVH, len(slots), D]``."""
    return pool.index_select(1, slots).to(dtype)


def _take(tokens: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """``tokens [T, heads, D]`` at the group's query positions: ``[B, Qmax, heads, D]``."""
    batch, q_max, _ = group.shape
    if group.packed is not None:
        start, stop = group.packed
        taken = tokens[start:stop]
    else:
        taken = tokens.index_select(0, group.q_index)
    return taken.view(batch, q_max, *tokens.shape[1:])


def register_paged_attention() -> None:
    """Register :func:`paged_attention_forward` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
