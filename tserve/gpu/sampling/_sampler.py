"""Picks each request's next token from its logits, one request failing alone.

Pipeline for one step (``logits [N, V]``, one row per request):

1. per request, guarded: check its parameters and the row (finite logits);
   a failure becomes that request's error and the row leaves the batch;
2. batched over the rest: frequency/presence penalties (over the request's
   OUTPUT tokens), then ``logit_bias``, then the grammar mask of constrained
   rows (tokens it forbids become -inf), raw logprobs, greedy argmax, and
   for sampled rows temperature, top-k and top-p (``Sequence.sampling``: the
   request's own, else the model's defaults, else OpenAI's) over a bounded
   set of candidates (below);
3. per request, guarded: draw one uniform number from the request's own
   generator (seeded requests) and invert the row's CDF, then assemble its
   logprobs.

If the batched part itself raises, every row is redone as a batch of one, so
the error still stays with the request that caused it. A seeded request draws
exactly one number per step from a ``numpy.random.Generator`` (PCG64) seeded
with ``params.seed`` and owned by that request alone, so its tokens do not
depend on its neighbours in the batch. Call :meth:`Sampler.release` when a
request ends.

numpy and the compiled kernels, never torch (the torch-free engine uses it
as the torch runner does). A sampled row whose candidates are most of its
vocabulary (Gemma 3's soft-capped logits keep most of its 262,144 tokens
within reach) gets their probabilities from one C pass
(``_sampling_kernels.c``), numpy's where the kernels are not built; a
temperature-only such row is drawn in C over the row itself, with no
vocab-long array. ``logits`` is anything ``numpy.asarray`` makes a float32 ``[N, V]``
array of without a copy (a numpy array, a CPU float32 torch tensor); rows a
penalty, bias or mask changes are copied one by one, the others are read in
place. A sampled row's exp runs only over its tokens at least ``2^-24 / V``
times as likely as its most likely one (the rest hold less mass than float32
resolves). Candidates of a top-k/top-p row: the tokens whose probability is
at least ``(1 - top_p) / (2 V)`` (the rest cannot reach the top-p prefix),
then its top 512 of those, else 4096, else all of them, whichever first
holds the top-p mass (``np.argpartition``); only their probabilities are
sorted, to find where top-p ends.

Logprobs are the model's RAW logprobs (log-softmax of the logits before
penalties, ``logit_bias``, the grammar mask, temperature, top-k and top-p),
as vLLM reports by default.

Test-only fault injection: when the environment variable
``TSERVE_TEST_FAULT_SAMPLER`` holds a regular expression when the sampler is
built, sampling any request whose id it matches (``re.search``) raises; the
error is reported as that request's. It is unset in production and there is
no way to set it over HTTP.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import math
import os
import re
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as SequenceOf
from typing import Any, Final, TypeAlias

import numpy as np
import numpy.typing as npt

from tserve.gpu.kernels._library import declare, kernel_library
from tserve.gpu.scheduling._sequence import Sequence
from tserve.protocol import Sampling, SamplingParams, TokenLogprob
from tserve.validity import GREEDY_BELOW, params_problem

__all__ = ["FAULT_ENV", "SampleResult", "Sampler", "SamplingFault"]

log = logging.getLogger(__name__)

FAULT_ENV: Final = "TSERVE_TEST_FAULT_SAMPLER"
# A top-k/top-p row draws from its top 512 candidates, or 4096, or all of them.
_CANDIDATE_WIDTHS: Final = (512, 4096)
# A sampled row's tokens less likely than 2^-24 / V times its most likely one
# are never drawn: together they hold under 2^-24 of its mass, less than
# float32 resolves in the sum, so they are left out before exp.
_NEGLIGIBLE: Final = math.log(2.0**-24)
# A row whose first _PROBE tokens are mostly candidates goes to the compiled
# pass, which counts them all (a row of few takes numpy's gather either way).
_PROBE: Final = 4096

_F32: TypeAlias = npt.NDArray[np.float32]
_Ids: TypeAlias = npt.NDArray[np.intp]
# (candidate token ids or None for "all, in id order", cumulative kept probabilities)
_Cdf: TypeAlias = tuple[_Ids | None, npt.NDArray[np.float64]]
# what a sampled row draws from: its candidates' running sums, or the whole row in C
_Candidates: TypeAlias = "_Cdf | _Whole"
# (candidate ids or None for all, their probabilities up to a factor, their running sums or None)
_Near: TypeAlias = tuple[_Ids | None, _F32, npt.NDArray[np.float64] | None]
_Top: TypeAlias = np.float32 | None  # a row's max logit, where known


class SamplingFault(RuntimeError):
    """Raised on purpose by the test-only fault-injection hook."""


@dataclasses.dataclass(frozen=True, slots=True)
class SampleResult:
    """One request's outcome: a token (and logprobs if asked), or an error."""

    token_id: int | None
    logprob: TokenLogprob | None = None
    error: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class _RawLogprobs:
    """A row's raw logprobs, ``logits - top - log_sum`` (float32), read on demand."""

    logits: _F32  # the step's row [V], never written
    top: np.float32  # its max
    log_sum: np.float32  # log(sum(exp(logits - top)))

    def at(self, ids: Any) -> _F32:
        return (self.logits[ids] - self.top) - self.log_sum  # type: ignore[no-any-return]


@dataclasses.dataclass(slots=True)
class _Batch:
    """The batched part's results for the rows that passed step 1."""

    rows: list[int]  # indices into the step's logits, in order
    greedy: dict[int, int]  # row -> argmax of its penalised logits
    candidates: dict[int, _Candidates]  # row -> what to draw from (sampled rows)
    logprobs: dict[int, _RawLogprobs]  # row -> its raw logprobs (rows that asked)


class Sampler:
    """Per-request sampling over a batch of logits. Not thread-safe.

    Holds one generator per seeded request, created on first use; memory is
    bounded by the number of live seeded requests as long as :meth:`release`
    is called when each request ends.
    """

    def __init__(self) -> None:
        self._generators: dict[str, np.random.Generator] = {}
        # Unseeded requests share this one (seeded from the OS); their draws are not reproducible.
        self._shared = np.random.default_rng()
        pattern = os.environ.get(FAULT_ENV)
        self._fault = re.compile(pattern) if pattern else None

    def release(self, request_id: str) -> None:
        """Forget a finished request's generator. Idempotent."""
        self._generators.pop(request_id, None)

    def sample(
        self,
        logits: npt.ArrayLike,
        seqs: SequenceOf[Sequence],
        allowed: Mapping[int, npt.NDArray[np.bool_]] | None = None,
    ) -> list[SampleResult]:
        """One result per row of ``logits [N, V]`` (float32), for ``seqs[i]`` at row i.

        ``logits`` is read in place, never written (``numpy.asarray``: a numpy
        array or a CPU torch tensor). ``allowed`` maps a constrained row to its
        grammar mask (bool ``[V]``, True = the grammar allows that token); a
        row of all False is that request's error. Never raises for a problem of
        one request; that request's result carries the error instead.
        """
        allowed = allowed or {}
        array: _F32 = np.asarray(logits, dtype=np.float32)
        assert array.ndim == 2 and array.shape[0] == len(seqs), "one logits row per sequence"
        results: list[SampleResult | None] = [None] * len(seqs)
        # One pass gives both: argmax stops at a NaN, so a row's top is NaN or
        # +inf exactly when its max is.
        argmax = array.argmax(axis=1)
        top = array[np.arange(len(seqs)), argmax]
        finite = np.isfinite(top).tolist()
        ok: list[int] = []
        for i, seq in enumerate(seqs):
            problem = _check(seq.params, array.shape[1], finite[i])
            if problem is None:
                ok.append(i)
            else:
                results[i] = _failed(seq, problem)
        step = _Step(array, argmax, top, seqs, allowed)
        try:
            batches = [step.batch(ok)]
        except Exception:
            log.exception("batched sampling failed; isolating the failing request")
            batches = []
            for row in ok:
                try:
                    batches.append(step.batch([row]))
                except Exception as exc:
                    results[row] = _failed(seqs[row], _describe(exc), exc)
        for batch in batches:
            for row in batch.rows:
                results[row] = self._finish(batch, row, seqs[row])
        return [r if r is not None else SampleResult(None, error="not sampled") for r in results]

    def _finish(self, batch: _Batch, row: int, seq: Sequence) -> SampleResult:
        """Step 3 for one request, guarded."""
        try:
            if self._fault is not None and self._fault.search(seq.request_id):
                raise SamplingFault(f"injected sampler fault for {seq.request_id!r}")
            token = self._choose(batch, row, seq)
            logprob = _token_logprob(batch.logprobs.get(row), token, seq.params.logprobs)
            return SampleResult(token, logprob)
        except Exception as exc:
            return _failed(seq, _describe(exc), exc)

    def _choose(self, batch: _Batch, row: int, seq: Sequence) -> int:
        candidates = batch.candidates.get(row)
        if candidates is None:
            return batch.greedy[row]
        u = self._generator(seq).random()  # exactly one draw per step
        if isinstance(candidates, _Whole):
            kernel = _candidate_kernel()
            assert kernel is not None, "only the compiled kernel makes a _Whole"
            return kernel.draw(candidates, u)
        ids, cdf = candidates
        k = min(int(np.searchsorted(cdf, u * float(cdf[-1]), side="right")), len(cdf) - 1)
        return k if ids is None else int(ids[k])

    def _generator(self, seq: Sequence) -> np.random.Generator:
        seed = seq.params.seed
        if seed is None:
            return self._shared
        generator = self._generators.get(seq.request_id)
        if generator is None:
            generator = np.random.Generator(np.random.PCG64(seed & 0xFFFF_FFFF_FFFF_FFFF))
            self._generators[seq.request_id] = generator
        return generator


@dataclasses.dataclass(slots=True)
class _Step:
    """One step's inputs to step 2; ``argmax``/``top`` are each row's argmax and max."""

    logits: _F32
    argmax: npt.NDArray[np.intp]
    top: _F32
    seqs: SequenceOf[Sequence]
    allowed: Mapping[int, npt.NDArray[np.bool_]]

    def batch(self, rows: list[int]) -> _Batch:
        """Step 2 over ``rows``: everything that vectorises. Rows that no penalty,
        bias or mask changes are read from ``logits`` in place; the others are
        copied, one row each."""
        edited: dict[int, _F32] = {}  # row -> its penalised, biased, masked copy
        for i in rows:
            seq = self.seqs[i]
            _apply_penalties(self.logits, i, seq, edited)
            _apply_bias(self.logits, i, seq.params, edited)
            mask = self.allowed.get(i)
            if mask is not None:
                _apply_mask(self.logits, i, mask, edited)
        logprobs = {
            i: _raw_logprobs(self.logits[i], self.top[i])
            for i in rows
            if self.seqs[i].params.logprobs is not None
        }
        greedy: dict[int, int] = {}
        sampled: list[int] = []
        for i in rows:
            if not _is_greedy(self.seqs[i].sampling):
                sampled.append(i)
            elif i in edited:
                greedy[i] = int(edited[i].argmax())
            else:
                greedy[i] = int(self.argmax[i])
        drawn = _candidates(
            [edited.get(i, self.logits[i]) for i in sampled],
            [self.seqs[i].sampling for i in sampled],
            [None if i in edited else self.top[i] for i in sampled],  # an edit moves the max
        )
        return _Batch(
            rows=rows,
            greedy=greedy,
            candidates=dict(zip(sampled, drawn, strict=True)),
            logprobs=logprobs,
        )


# ---------------------------------------------------------------------------- pieces


def _is_greedy(sampling: Sampling) -> bool:
    return sampling.temperature < GREEDY_BELOW or sampling.top_k == 1


def _check(params: SamplingParams, vocab: int, finite: bool) -> str | None:
    if not finite:
        return "the model produced non-finite logits for this request"
    problem = params_problem(params, vocab)
    return None if problem is None else problem.message


def _edited(logits: _F32, row: int, edited: dict[int, _F32]) -> _F32:
    """``row``'s own copy, made on its first change (``logits`` is never written)."""
    out = edited.get(row)
    if out is None:
        out = edited[row] = logits[row].copy()
    return out


def _apply_penalties(logits: _F32, row: int, seq: Sequence, edited: dict[int, _F32]) -> None:
    """``logits - frequency * count - presence * (count > 0)`` over output tokens.

    Raises ValueError for an output token outside the vocabulary."""
    params = seq.params
    if not (params.presence_penalty or params.frequency_penalty) or not seq.output_token_ids:
        return
    ids, counts = np.unique(np.asarray(seq.output_token_ids, dtype=np.int64), return_counts=True)
    if ids[0] < 0 or ids[-1] >= logits.shape[1]:
        raise ValueError("an output token id is outside the vocabulary")
    penalty = params.frequency_penalty * counts + params.presence_penalty
    _edited(logits, row, edited)[ids] -= penalty.astype(np.float32)


def _apply_bias(logits: _F32, row: int, params: SamplingParams, edited: dict[int, _F32]) -> None:
    """Add the row's ``logit_bias`` (a repeated id's biases add up)."""
    if not params.logit_bias:
        return
    ids, values = zip(*params.logit_bias, strict=True)
    np.add.at(_edited(logits, row, edited), np.asarray(ids), np.asarray(values, dtype=np.float32))


def _apply_mask(
    logits: _F32, row: int, allowed: npt.NDArray[np.bool_], edited: dict[int, _F32]
) -> None:
    """Set the logits the row's grammar forbids to -inf. Raises ValueError for a
    mask that allows no token (the caller's isolation makes it that request's error)."""
    allow = np.asarray(allowed, dtype=np.bool_)
    if not allow.any():
        raise ValueError("the grammar allows no token here")
    _edited(logits, row, edited)[~allow] = -np.inf


def _raw_logprobs(logits: _F32, top: np.float32) -> _RawLogprobs:
    """The log-softmax of one row, as its log-normaliser (float32, like torch's)."""
    total = np.exp(logits - top).sum()
    return _RawLogprobs(logits, top, np.log(total).astype(np.float32))


def _candidates(
    rows: Iterable[_F32], params: SequenceOf[Sampling], tops: Iterable[_Top] | None = None
) -> list[_Candidates]:
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
    out: list[_Candidates] = []
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
            self._sums = np.empty(vocab // 16 + 1, dtype=np.float64)
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
        sums = self._sums  # scratch: a row's block sums, vocab / 16 of them
        assert len(sums) > len(row) // 16, "a _Whole comes from a row this kernel has seen"
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


def _token_logprob(lp: _RawLogprobs | None, token: int, top_n: int | None) -> TokenLogprob | None:
    if lp is None or top_n is None:
        return None
    top: list[tuple[int, float]] = []
    if top_n > 0:
        vocab = len(lp.logits)
        n = min(top_n, vocab)
        best = np.argpartition(lp.logits, vocab - n)[vocab - n :]
        best = best[np.argsort(lp.logits[best], kind="stable")[::-1]]
        top = list(zip(best.tolist(), lp.at(best).tolist(), strict=True))
    return TokenLogprob(token, float(lp.at(token)), top)


def _describe(exc: BaseException) -> str:
    return f"sampling failed: {type(exc).__name__}: {exc}"


def _failed(seq: Sequence, message: str, exc: BaseException | None = None) -> SampleResult:
    if exc is not None:
        log.warning("request %s: %s", seq.request_id, message, exc_info=exc)
    return SampleResult(None, error=message)
