"""A sampled row's candidate tokens under temperature, top-k and top-p, and the
draw among them (the sampler's step 2 for one row, and step 3's inversion).

numpy, and the compiled kernels where most of a row can be drawn, never
torch. A row's exp runs only over its tokens at least ``2^-24 / V`` times as
likely as its most likely one (the rest hold less mass than float32
resolves). A row whose candidates are most of its vocabulary (Gemma 3's
soft-capped logits keep most of its 262,144 tokens within reach) gets their
probabilities from one C pass (``_sampling_kernels.c``), numpy's where the
kernels are not built; a temperature-only such row is drawn in C over the
row itself, with no vocab-long array. Candidates of a top-k/top-p row: the
tokens whose probability is at least ``(1 - top_p) / (2 V)`` (the rest cannot
reach the top-p prefix), then its top 512 of those, else 4096, else all of
them, whichever first holds the top-p mass (``np.argpartition``); only their
probabilities are sorted, to find where top-p ends. What a row gets depends
on that row alone, never on its neighbours.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from typing import Final, TypeAlias

import numpy as np
import numpy.typing as npt

from tserve.gpu.kernels._library import declare, kernel_library
from tserve.protocol import Sampling

__all__ = ["Candidates", "draw", "find_candidates"]

# A top-k/top-p row draws from its top 512 candidates, or 4096, or all of them.
_CANDIDATE_WIDTHS: Final = (512, 4096)
# A sampled row's tokens less likely than 2^-24 / V times its most likely one
# are never drawn: together they hold under 2^-24 of its mass, less than
# float32 resolves in the sum, so they are left out before exp.
_NEGLIGIBLE: Final = math.log(2.0**-24)
# A row whose first _PROBE tokens are mostly candidates goes to the compiled
# pass, which counts them all (a row of few takes numpy's gather either way).
_PROBE: Final = 4096
_BLOCK: Final = 16  # _sampling_kernels.c's BLOCK: a whole-row draw keeps each block's sum

_F32: TypeAlias = npt.NDArray[np.float32]
_Ids: TypeAlias = npt.NDArray[np.intp]
# (candidate token ids or None for "all, in id order", cumulative kept probabilities)
_Cdf: TypeAlias = tuple[_Ids | None, npt.NDArray[np.float64]]
# what a sampled row draws from: its candidates' running sums, or the whole row in C
Candidates: TypeAlias = "_Cdf | _Whole"
# (candidate ids or None for all, their probabilities up to a factor, their running sums or None)
_Near: TypeAlias = tuple[_Ids | None, _F32, npt.NDArray[np.float64] | None]
_Top: TypeAlias = np.float32 | None  # a row's max logit, where known


def find_candidates(
    rows: Iterable[_F32], params: SequenceOf[Sampling], tops: Iterable[_Top] | None = None
) -> list[Candidates]:
    """Temperature, then top-k, then top-p, for each row (float32 ``[V]``);
    ``tops``: each row's max where known (None: found here).

    A row's ``(ids, cdf)``: ``cdf`` is the unnormalised cumulative sum of the
    kept probabilities over the candidate tokens ``ids``, in id order (None =
    all tokens); a draw is the first index where ``cdf > u * cdf[-1]``. With
    the compiled kernels, a temperature-only row that keeps over a quarter of
    its tokens is a :class:`_Whole` instead, drawn the same way in C. The
    most likely token is always kept; tokens below ``_NEGLIGIBLE`` never are.
    What a row gets depends on that row alone, never on its neighbours.
    """
    out: list[Candidates] = []
    kernel = _candidate_kernel()
    rows = list(rows)
    for logits, p, top in zip(rows, params, tops or [None] * len(rows), strict=True):
        plain = p.top_k <= 0 and p.top_p >= 1
        if kernel is not None:
            near = kernel(logits, p.temperature, plain, top)
            if isinstance(near, _Whole):
                out.append(near)
                continue
            ids, probs, cdf = near
        else:
            ids, probs, cdf = _near_top(logits, p.temperature, plain, top)
        out.append((ids, cdf) if cdf is not None else _top_candidates(probs, ids, len(logits), p))
    return out


def draw(candidates: Candidates, u: float) -> int:
    """The token ``u`` (in [0, 1)) picks from a row's candidates: the first whose
    running sum exceeds ``u`` times the row's."""
    if isinstance(candidates, _Whole):
        kernel = _candidate_kernel()
        assert kernel is not None, "only the compiled kernel makes a _Whole"
        return kernel.draw(candidates, u)
    ids, cdf = candidates
    k = min(int(np.searchsorted(cdf, u * float(cdf[-1]), side="right")), len(cdf) - 1)
    return k if ids is None else int(ids[k])


def _cut(logits: _F32, temperature: float, top: _Top) -> tuple[np.float32, np.float32]:
    """A row's max (``top``, unless None), and the logit below which its tokens are
    never drawn."""
    if top is None:
        top = logits.max()
    return top, top + np.float32(temperature * (_NEGLIGIBLE - math.log(len(logits))))


def _near_top(logits: _F32, temperature: float, cumulate: bool, top: _Top = None) -> _Near:
    """A sampled row's candidates: ``(ids, probs, cdf)``. ``ids``: the tokens
    at or above the cut, or None where they are over a quarter of the row
    (then every token, no gather); ``probs``: their ``exp((logit - max) / T)``
    (float32, up to a common factor); ``cdf``: the running sums of ``probs``
    in float64 if ``cumulate``, else None. numpy's form of
    :class:`_CandidateKernel`, for an install without the compiled kernels."""
    top, cut = _cut(logits, temperature, top)
    found = np.flatnonzero(logits >= cut)
    ids = None if len(found) > len(logits) // 4 else found
    near = logits if ids is None else logits[ids]
    probs = np.subtract(near, top)
    probs *= np.float32(1.0 / temperature)
    np.exp(probs, out=probs)
    return ids, probs, np.cumsum(probs.astype(np.float64)) if cumulate else None


@dataclasses.dataclass(frozen=True, slots=True)
class _Whole:
    """A temperature-only row whose candidates are most of its vocabulary:
    drawn by :meth:`_CandidateKernel.draw` over the row itself, with no
    vocab-long array made for it."""

    logits: _F32
    top: np.float32
    inv_t: np.float32


class _CandidateKernel:
    """:func:`_near_top` with its whole-row work in C (``tserve_sample_candidates``,
    ``_sampling_kernels.c``): a row's tokens at or above the cut counted in one
    vectorized pass; where they are over a quarter of it, their probabilities
    (each within a few float32 ulps of numpy's exp) in one more, into scratch
    held here and copied out, or, for a temperature-only row, none: it is a
    :class:`_Whole`, which :meth:`draw` draws from. A row of fewer candidates
    goes to numpy's compare and gather (vectorized, where C's are not), as
    does one whose first ``_PROBE`` tokens hold few of them, without a call."""

    __slots__ = ("_call", "_draw", "_probs", "_sums")

    def __init__(self, library: ctypes.CDLL) -> None:
        ptr, i64, f32, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_double
        self._call = declare(
            library.tserve_sample_candidates, ptr, i64, f32, f32, f32, i64, ctypes.c_int, ptr, ptr
        )
        self._draw = declare(library.tserve_sample_draw, ptr, i64, f32, f32, f64, ptr, ptr)
        self._probs = np.empty(0, dtype=np.float32)
        self._sums = np.empty(0, dtype=np.float64)

    def __call__(
        self, logits: _F32, temperature: float, plain: bool, top: _Top = None
    ) -> _Near | _Whole:
        """``plain``: temperature only (the running sums, or a :class:`_Whole`)."""
        logits = np.ascontiguousarray(logits, dtype=np.float32)
        vocab = len(logits)
        if len(self._probs) < vocab:
            self._probs = np.empty(vocab, dtype=np.float32)
            self._sums = np.empty(vocab // _BLOCK + 1, dtype=np.float64)
        top, cut = _cut(logits, temperature, top)
        probe = logits[:_PROBE]
        if np.count_nonzero(probe >= cut) * 4 <= len(probe):  # likely few: not worth a call
            return _near_top(logits, temperature, plain, top)
        inv_t = np.float32(1.0 / temperature)
        count = ctypes.c_int64()
        self._call(
            logits.ctypes.data, vocab, top, inv_t, cut, vocab // 4, plain,
            self._probs.ctypes.data, ctypes.byref(count),
        )  # fmt: skip
        if count.value <= vocab // 4:
            return _near_top(logits, temperature, plain, top)
        if plain:
            return _Whole(logits, top, inv_t)
        return None, self._probs[:vocab].copy(), None

    def draw(self, whole: _Whole, u: float) -> int:
        """The token ``u`` (in [0, 1)) picks: the first whose running sum exceeds
        ``u`` times the row's, as a search of :func:`_near_top`'s sums would."""
        token = ctypes.c_int64()
        row = whole.logits
        sums = self._sums  # scratch: a row's block sums
        assert len(sums) > len(row) // _BLOCK, "a _Whole comes from a row this kernel has seen"
        self._draw(
            row.ctypes.data, len(row), whole.top, whole.inv_t, u, sums.ctypes.data,
            ctypes.byref(token),
        )  # fmt: skip
        return token.value


@functools.cache
def _candidate_kernel() -> _CandidateKernel | None:
    """The compiled candidate pass, or None where the kernels are not built."""
    library = kernel_library()
    return None if library is None else _CandidateKernel(library)


def _top_candidates(probs: _F32, ids: _Ids | None, vocab: int, p: Sampling) -> _Cdf:
    """The kept tokens of a filtered row from the narrowest top-w selection that holds them.

    ``probs`` (unnormalised) are those of tokens ``ids`` (None = all
    ``vocab``). They first lose the tokens of probability below
    ``(1 - top_p) / (2 V)``: together they hold less than ``1 - top_p``, so
    none of them is in the top-p prefix. Of the rest, widths are tried in
    ``_CANDIDATE_WIDTHS`` order, then all of them; a row moves on only if
    top-p needs more mass than its top-w holds and top-k does not stop within it.
    """
    total = float(probs.sum())
    top_p = min(p.top_p, 1.0)
    goal = top_p * total
    pool = np.flatnonzero(probs >= (1.0 - top_p) / (2 * vocab) * total)
    values = probs[pool]
    for width in _CANDIDATE_WIDTHS:
        if width >= len(values):
            break
        if not 0 < p.top_k <= width and width * float(values.max()) < goal:
            continue  # not even ``width`` tokens as likely as the top one hold it
        best = np.sort(np.argpartition(values, len(values) - width)[len(values) - width :])
        # Without top-p (1) only top-k stops it: a rounded mass can reach the whole.
        if 0 < p.top_k <= width or (top_p < 1 and float(values[best].sum()) >= goal):
            pool, values = pool[best], values[best]
            break
    if 0 < p.top_k < len(values):
        best = np.sort(np.argpartition(values, len(values) - p.top_k)[len(values) - p.top_k :])
        pool, values = pool[best], values[best]
    if top_p < 1:
        # The n most likely have less than top_p of the mass strictly above each
        # (values sorted, not their ids: several times faster).
        falling = np.sort(values)[::-1]
        mass = np.cumsum(falling.astype(np.float64))  # float32 drifts over 10^4 terms
        n = 1 + int(np.searchsorted(mass[:-1], goal, side="left"))
        if n < len(values):
            last = falling[n - 1]  # of the tokens tied with the n-th, the first ones
            keep = values > last
            keep[np.flatnonzero(values == last)[: n - int(np.count_nonzero(keep))]] = True
            kept = np.flatnonzero(keep)  # then gathers: faster than two boolean indexings
            pool, values = pool[kept], values[kept]
    return (pool if ids is None else ids[pool]), np.cumsum(values.astype(np.float64))
