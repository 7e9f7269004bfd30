"""K-quant super-blocks (Q4_K, Q5_K, Q6_K) built in numpy, in ggml's byte layout.

The ``gguf`` package dequantizes K-quants but cannot quantize them, so the
tests write their own: :func:`pack` lays out quants and scales exactly as
ggml's ``block_q4_K``/``block_q5_K``/``block_q6_K`` (the inverse of
``gguf.quants``' ``dequantize_blocks``); :func:`random_rows` packs random
quants with valid scales and mins; :func:`quantize` fits scales to given
weights (plain min/max fits, not llama.cpp's search: its error is larger,
its layout the same).
"""

from __future__ import annotations

import dataclasses
from typing import Final

import numpy as np

__all__ = ["FORMATS", "SUPER", "Parts", "pack", "quantize", "random_rows"]

SUPER: Final = 256
FORMATS: Final = ("Q4_K", "Q5_K", "Q6_K")
_BITS: Final = {"Q4_K": 4, "Q5_K": 5, "Q6_K": 6}


@dataclasses.dataclass(frozen=True)
class Parts:
    """A run of ``nb`` super-blocks before packing.

    Q4_K/Q5_K: ``d``, ``dmin`` fp16 ``[nb]``; ``scales``, ``mins`` 0..63
    ``[nb, 8]``; ``q`` 0..15 or 0..31 ``[nb, 256]``; a weight is
    ``d * scale * q - dmin * min`` of its group of 32. Q6_K: ``d`` fp16
    ``[nb]``, ``scales`` int8 ``[nb, 16]`` (one per 16 weights), ``q`` 0..63,
    a weight ``d * scale * (q - 32)``; ``dmin`` and ``mins`` unused.
    """

    d: np.ndarray
    scales: np.ndarray
    q: np.ndarray
    dmin: np.ndarray | None = None
    mins: np.ndarray | None = None


def _pack_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """ggml's 12 bytes of 6-bit scales and mins (the inverse of get_scale_min_k4)."""
    sc, m = scales.astype(np.uint8), mins.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return out


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 bytes: per pair of groups, the even one low, the odd one high."""
    pairs = (q & 0x0F).reshape(q.shape[0], 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(q.shape[0], 128).astype(np.uint8)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def pack(fmt: str, parts: Parts) -> np.ndarray:
    """``parts`` as ggml's bytes: uint8 ``[nb, 144 | 176 | 210]``."""
    q = parts.q.astype(np.uint8)
    if fmt == "Q6_K":
        halves = q.reshape(-1, 2, 4, 32)  # [nb, half, quarter, l]: element 128h + 32g + l
        low, high = halves & 0x0F, halves >> 4
        # Per half: 64 bytes of low nibbles (quarters 0 | 2 << 4, then 1 | 3 << 4),
        # 32 bytes of the quarters' high 2-bit pairs.
        ql = np.stack([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], 2)
        qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
        ql = ql.reshape(-1, 128)
        scales = parts.scales.astype(np.int8).view(np.uint8)
        return np.concatenate([ql, qh.reshape(-1, 64), scales, _f16_bytes(parts.d)], axis=1)
    assert parts.dmin is not None and parts.mins is not None
    head = [_f16_bytes(parts.d), _f16_bytes(parts.dmin), _pack_scales(parts.scales, parts.mins)]
    if fmt == "Q5_K":
        bits = ((q >> 4) & 1).reshape(-1, 8, 32) << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        head.append(np.bitwise_or.reduce(bits, axis=1).astype(np.uint8))
    return np.concatenate([*head, _nibbles(q)], axis=1)


def random_rows(fmt: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` rows of ``k`` (a multiple of 256) random weights in ``fmt``: uint8 ``[n, bytes]``.

    Random quants, 6-bit scales and mins over their whole range, and
    super-block scales of either sign's magnitude a weight of order 1.
    """
    nb = n * k // SUPER
    q = rng.integers(0, 1 << _BITS[fmt], (nb, SUPER))
    if fmt == "Q6_K":
        d = rng.uniform(0.5, 2.0, nb) / (32 * 64)
        parts = Parts(d=d, scales=rng.integers(-128, 128, (nb, 16)), q=q)
    else:
        d = rng.uniform(0.5, 2.0, nb) / (64 << _BITS[fmt])
        dmin = rng.uniform(0.5, 2.0, nb) / 64
        scales, mins = rng.integers(0, 64, (nb, 8)), rng.integers(0, 64, (nb, 8))
        parts = Parts(d=d, scales=scales, q=q, dmin=dmin, mins=mins)
    return pack(fmt, parts).reshape(n, -1)


def _fit(top: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Per super-block fp16 ``d`` and integer 0..levels ``codes`` with ``d * codes ≈ top``."""
    d = (top.max(axis=-1) / levels).astype(np.float16).astype(np.float32)
    safe = np.where(d > 0, d, 1.0)[:, None]
    return d, np.clip(np.rint(top / safe), 0, levels)


def quantize(values: np.ndarray, fmt: str) -> np.ndarray:
    """``values [n, k]`` (k a multiple of 256) in ``fmt``: uint8 ``[n, bytes]``."""
    n = values.shape[0]
    blocks = values.astype(np.float32).reshape(-1, SUPER)
    if fmt == "Q6_K":
        groups = blocks.reshape(-1, 16, 16)
        amax = np.abs(groups).max(axis=-1)
        d, codes = _fit(amax / 31, 127)
        step = d[:, None, None] * codes[:, :, None]
        safe = np.where(step > 0, step, 1.0)
        q = np.clip(np.rint(groups / safe), -32, 31) + 32
        return pack(fmt, Parts(d=d, scales=codes, q=q.reshape(-1, SUPER))).reshape(n, -1)
    top = (1 << _BITS[fmt]) - 1
    groups = blocks.reshape(-1, 8, 32)
    low = np.minimum(groups.min(axis=-1), 0.0)  # ggml's mins are subtracted: a group's min <= 0
    d, scales = _fit((groups.max(axis=-1) - low) / top, 63)
    dmin, mins = _fit(-low, 63)
    step = d[:, None, None] * scales[:, :, None]
    offset = dmin[:, None, None] * mins[:, :, None]
    safe = np.where(step > 0, step, 1.0)
    q = np.clip(np.rint((groups + offset) / safe), 0, top).reshape(-1, SUPER)
    parts = Parts(d=d, scales=scales, q=q, dmin=dmin, mins=mins)
    return pack(fmt, parts).reshape(n, -1)
