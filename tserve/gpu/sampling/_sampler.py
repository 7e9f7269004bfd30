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
as the torch runner does). ``logits`` is anything ``numpy.asarray`` makes a
float32 ``[N, V]`` array of without a copy (a numpy array, a CPU float32
torch tensor); rows a penalty, bias or mask changes are copied one by one,
the others are read in place. A sampled row's candidates under
temperature, top-k and top-p, and the draw among them, are
:mod:`tserve.gpu.sampling._candidates`'.

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

import dataclasses
import logging
import os
import re
from collections.abc import Mapping
from collections.abc import Sequence as SequenceOf
from typing import Any, Final, TypeAlias

import numpy as np
import numpy.typing as npt

from tserve.gpu.sampling._candidates import Candidates, draw, find_candidates
from tserve.gpu.scheduling._sequence import Sequence
from tserve.protocol import Sampling, SamplingParams, TokenLogprob
from tserve.validity import GREEDY_BELOW, params_problem

__all__ = ["FAULT_ENV", "SampleResult", "Sampler", "SamplingFault"]

log = logging.getLogger(__name__)

FAULT_ENV: Final = "TSERVE_TEST_FAULT_SAMPLER"

_F32: TypeAlias = npt.NDArray[np.float32]


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
    candidates: dict[int, Candidates]  # row -> what to draw from (sampled rows)
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
        return draw(candidates, self._generator(seq).random())  # exactly one draw per step

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
        drawn = find_candidates(
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
