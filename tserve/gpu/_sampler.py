"""Picks each request's next token from its logits, one request failing alone.

Pipeline for one step (``logits [N, V]``, one row per request):

1. per request, guarded: check its parameters and the row (finite logits);
   a failure becomes that request's error and the row leaves the batch;
2. batched over the rest: frequency/presence penalties (over the request's
   OUTPUT tokens), then ``logit_bias``, then the grammar mask of constrained
   rows (tokens it forbids become -inf), raw logprobs, greedy argmax, and
   for sampled rows temperature, top-k and top-p (``Sequence.sampling``: the
   request's own, else the model's defaults, else OpenAI's) on one sorted copy;
3. per request, guarded: draw one uniform number from the request's own
   generator (seeded requests) and invert the row's CDF, then assemble its
   logprobs.

If the batched part itself raises, every row is redone as a batch of one, so
the error still stays with the request that caused it. A seeded request draws
exactly one number per step from a ``torch.Generator`` seeded with
``params.seed`` and owned by that request alone, so its tokens do not depend on
its neighbours in the batch. Call :meth:`Sampler.release` when a request ends.

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
from typing import Final, TypeAlias

import torch

from tserve.gpu._sequence import Sequence
from tserve.protocol import Sampling, SamplingParams, TokenLogprob
from tserve.validity import GREEDY_BELOW, params_problem

__all__ = ["FAULT_ENV", "SampleResult", "Sampler", "SamplingFault"]

log = logging.getLogger(__name__)

FAULT_ENV: Final = "TSERVE_TEST_FAULT_SAMPLER"
# A top-k/top-p row draws from its top 512 tokens, or 4096, or a full sort.
_CANDIDATE_WIDTHS: Final = (512, 4096)

# (candidate token ids or None for "all, in id order", cumulative kept probabilities)
_Candidates: TypeAlias = tuple[torch.Tensor | None, torch.Tensor]


class SamplingFault(RuntimeError):
    """Raised on purpose by the test-only fault-injection hook."""


@dataclasses.dataclass(frozen=True, slots=True)
class SampleResult:
    """One request's outcome: a token (and logprobs if asked), or an error."""

    token_id: int | None
    logprob: TokenLogprob | None = None
    error: str | None = None


@dataclasses.dataclass(slots=True)
class _Batch:
    """The batched part's results for the rows that passed step 1."""

    rows: list[int]  # indices into the step's logits, in order
    greedy: dict[int, int]  # row -> argmax of its penalised logits
    candidates: dict[int, _Candidates]  # row -> what to draw from (sampled rows)
    logprobs: dict[int, torch.Tensor]  # row -> [V] raw logprobs (rows that asked)


class Sampler:
    """Per-request sampling over a batch of logits. Not thread-safe.

    Holds one generator per seeded request, created on first use; memory is
    bounded by the number of live seeded requests as long as :meth:`release`
    is called when each request ends.
    """

    def __init__(self, *, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._generators: dict[str, torch.Generator] = {}
        # Unseeded requests share this one; their draws are not reproducible.
        self._shared = torch.Generator(device=self.device)
        self._shared.seed()
        pattern = os.environ.get(FAULT_ENV)
        self._fault = re.compile(pattern) if pattern else None

    def release(self, request_id: str) -> None:
        """Forget a finished request's generator. Idempotent."""
        self._generators.pop(request_id, None)

    def sample(
        self,
        logits: torch.Tensor,
        seqs: SequenceOf[Sequence],
        allowed: Mapping[int, torch.Tensor] | None = None,
    ) -> list[SampleResult]:
        """One result per row of ``logits [N, V]`` (fp32), for ``seqs[i]`` at row i.

        ``allowed`` maps a constrained row to its grammar mask (bool ``[V]``,
        True = the grammar allows that token); a row of all False is that
        request's error. Never raises for a problem of one request; that
        request's result carries the error instead.
        """
        allowed = allowed or {}
        assert logits.shape[0] == len(seqs), "one logits row per sequence"
        results: list[SampleResult | None] = [None] * len(seqs)
        ok: list[int] = []
        with torch.inference_mode():
            # One pass gives both: each row's max (NaN and +inf propagate) and its argmax.
            top, argmax = logits.max(dim=-1)
            finite = torch.isfinite(top).tolist()
            for i, seq in enumerate(seqs):
                problem = _check(seq.params, logits.shape[1], finite[i])
                if problem is None:
                    ok.append(i)
                else:
                    results[i] = _failed(seq, problem)
            try:
                batches = [self._batch(logits, argmax, seqs, ok, allowed)]
            except Exception:
                log.exception("batched sampling failed; isolating the failing request")
                batches = self._one_by_one(logits, argmax, seqs, ok, results, allowed)
            for batch in batches:
                for row in batch.rows:
                    results[row] = self._finish(batch, row, seqs[row])
        return [r if r is not None else SampleResult(None, error="not sampled") for r in results]

    def _one_by_one(
        self,
        logits: torch.Tensor,
        argmax: torch.Tensor,
        seqs: SequenceOf[Sequence],
        rows: list[int],
        results: list[SampleResult | None],
        allowed: Mapping[int, torch.Tensor],
    ) -> list[_Batch]:
        batches = []
        for row in rows:
            try:
                batches.append(self._batch(logits, argmax, seqs, [row], allowed))
            except Exception as exc:
                results[row] = _failed(seqs[row], _describe(exc), exc)
        return batches

    def _batch(
        self,
        logits: torch.Tensor,
        argmax: torch.Tensor,
        seqs: SequenceOf[Sequence],
        rows: list[int],
        allowed: Mapping[int, torch.Tensor],
    ) -> _Batch:
        """Step 2 over ``rows``: everything that vectorises. ``argmax [N]`` is each
        row's argmax of ``logits``."""
        params = [seqs[i].params for i in rows]
        sampling = [seqs[i].sampling for i in rows]
        # ``rows`` is increasing: all of them means the whole tensor, no copy.
        raw = logits if len(rows) == logits.shape[0] else logits[rows]
        processed = _apply_penalties(raw, [seqs[i] for i in rows])
        processed = _apply_bias(processed, raw, params)
        processed = _apply_masks(processed, raw, [allowed.get(i) for i in rows])
        want_lp = [j for j, p in enumerate(params) if p.logprobs is not None]
        logprobs: dict[int, torch.Tensor] = {}
        if want_lp:
            lp = torch.log_softmax(raw[want_lp], dim=-1)
            logprobs = {rows[j]: lp[k] for k, j in enumerate(want_lp)}
        # Without penalties, bias or masks the rows' argmax is the one sample()
        # took with the max; otherwise only the greedy rows need theirs.
        greedy_at = [j for j, s in enumerate(sampling) if _is_greedy(s)]
        if processed is raw:
            greedy = dict(zip(rows, argmax[rows].tolist(), strict=True))
        elif greedy_at:
            best = processed[greedy_at].argmax(dim=-1).tolist()
            greedy = {rows[j]: b for j, b in zip(greedy_at, best, strict=True)}
        else:
            greedy = {}
        sampled = [j for j, s in enumerate(sampling) if not _is_greedy(s)]
        candidates: dict[int, _Candidates] = {}
        if sampled:
            drawn = _candidates(processed[sampled], [sampling[j] for j in sampled])
            candidates = {rows[j]: c for j, c in zip(sampled, drawn, strict=True)}
        return _Batch(
            rows=rows,
            greedy=greedy,
            candidates=candidates,
            logprobs=logprobs,
        )

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
        ids, cdf = candidates
        u = torch.rand((), generator=self._generator(seq), device=self.device)
        k = min(int(torch.searchsorted(cdf, u.to(cdf.device) * cdf[-1], right=True)), len(cdf) - 1)
        return k if ids is None else int(ids[k])

    def _generator(self, seq: Sequence) -> torch.Generator:
        seed = seq.params.seed
        if seed is None:
            return self._shared
        generator = self._generators.get(seq.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
            self._generators[seq.request_id] = generator
        return generator


# ---------------------------------------------------------------------------- pieces


def _is_greedy(sampling: Sampling) -> bool:
    return sampling.temperature < GREEDY_BELOW or sampling.top_k == 1


def _check(params: SamplingParams, vocab: int, finite: bool) -> str | None:
    if not finite:
        return "the model produced non-finite logits for this request"
    problem = params_problem(params, vocab)
    return None if problem is None else problem.message


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """``logits - frequency * count - presence * (count > 0)`` over output tokens.

    Returns ``logits`` itself when no request has a penalty, else a copy.
    """
    penalised = [
        j
        for j, s in enumerate(seqs)
        if (s.params.presence_penalty or s.params.frequency_penalty) and s.output_token_ids
    ]
    if not penalised:
        return logits
    out = logits.clone()
    vocab = logits.shape[1]
    for j in penalised:
        params = seqs[j].params
        ids = torch.tensor(seqs[j].output_token_ids, device=logits.device)
        counts = torch.bincount(ids, minlength=vocab)[:vocab].to(logits.dtype)
        out[j] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return out


def _apply_bias(
    logits: torch.Tensor, raw: torch.Tensor, params: list[SamplingParams]
) -> torch.Tensor:
    """Add each row's ``logit_bias`` (a repeated id's biases add up).

    Returns ``logits`` itself when no row has a bias; copies it first when it
    is still ``raw`` (the step's logits, which logprobs read)."""
    biased = [j for j, p in enumerate(params) if p.logit_bias]
    if not biased:
        return logits
    out = logits.clone() if logits is raw else logits
    for j in biased:
        ids, values = zip(*params[j].logit_bias, strict=True)
        index = torch.tensor(ids, device=logits.device)
        out[j].index_add_(0, index, torch.tensor(values, dtype=logits.dtype, device=logits.device))
    return out


def _apply_masks(
    logits: torch.Tensor, raw: torch.Tensor, masks: list[torch.Tensor | None]
) -> torch.Tensor:
    """Set the logits a row's grammar forbids to -inf (rows with a mask only).

    Returns ``logits`` itself when no row has a mask; copies it first when it
    is still ``raw``. Raises ValueError for a mask that allows no token (the
    caller's isolation makes it that request's error)."""
    masked = [(j, m) for j, m in enumerate(masks) if m is not None]
    if not masked:
        return logits
    out = logits.clone() if logits is raw else logits
    for j, allow in masked:  # in place, row by row: no gather or scatter of rows
        if not bool(allow.any()):
            raise ValueError("the grammar allows no token here")
        out[j].masked_fill_(~allow.to(out.device), float("-inf"))
    return out


def _candidates(logits: torch.Tensor, params: list[Sampling]) -> list[_Candidates]:
    """Temperature, then top-k, then top-p, for each row of ``logits [S, V]``.

    A row's ``(ids, cdf)``: ``cdf`` is the unnormalised cumulative sum of the
    kept probabilities over the candidate tokens ``ids`` (None = all tokens in
    id order, when nothing is filtered); a draw is the first index where
    ``cdf > u * cdf[-1]``. Filtered rows take their candidates from a top-512
    selection, widening only when top-p needs more mass than it holds; the
    most likely token is always kept.
    What a row gets depends on that row alone, never on its neighbours.
    """
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    out: list[_Candidates | None] = [None] * len(params)
    plain = [j for j, p in enumerate(params) if p.top_k <= 0 and p.top_p >= 1]
    if plain:
        for j, cdf in zip(plain, torch.cumsum(probs[plain], dim=-1), strict=True):
            out[j] = (None, cdf)
    filtered = [j for j, p in enumerate(params) if j not in set(plain)]
    if filtered:
        found = _top_candidates(probs[filtered], [params[j] for j in filtered])
        for j, c in zip(filtered, found, strict=True):
            out[j] = c
    return [c for c in out if c is not None]


def _top_candidates(probs: torch.Tensor, params: list[Sampling]) -> list[_Candidates]:
    """Candidates of filtered rows from the narrowest top-w selection that holds them.

    Widths are tried in ``_CANDIDATE_WIDTHS`` order, then the whole vocabulary;
    a row moves on only if top-p needs more mass than its top-w holds. Which
    width a row ends at depends on that row alone.
    """
    vocab = probs.shape[1]
    result: list[_Candidates | None] = [None] * len(params)
    pending = list(range(len(params)))
    for width in (*_CANDIDATE_WIDTHS, vocab):
        width = min(width, vocab)
        values, ids = probs[pending].topk(width, dim=-1)
        mass = values.sum(dim=-1).tolist()
        still = []
        for k, j in enumerate(pending):
            p = params[j]
            if width < vocab and (p.top_k <= 0 or p.top_k > width) and mass[k] < p.top_p:
                still.append(j)
            else:
                result[j] = (ids[k], _kept_cdf(values[k], p))
        if not still:
            break
        pending = still
    return [c for c in result if c is not None]


def _kept_cdf(values: torch.Tensor, params: Sampling) -> torch.Tensor:
    """Cumulative probabilities of ``values`` (falling) with top-k/top-p drops as 0."""
    rank = torch.arange(len(values), device=values.device)
    before = torch.cumsum(values, dim=0) - values  # mass strictly above each token
    keep = (before < params.top_p) | (rank == 0)
    if params.top_k > 0:
        keep &= rank < params.top_k
    return torch.cumsum(torch.where(keep, values, 0.0), dim=0)


def _token_logprob(lp: torch.Tensor | None, token: int, top_n: int | None) -> TokenLogprob | None:
    if lp is None or top_n is None:
        return None
    top: list[tuple[int, float]] = []
    if top_n > 0:
        values, ids = lp.topk(top_n)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(lp[token]), top)


def _describe(exc: BaseException) -> str:
    return f"sampling failed: {type(exc).__name__}: {exc}"


def _failed(seq: Sequence, message: str, exc: BaseException | None = None) -> SampleResult:
    if exc is not None:
        log.warning("request %s: %s", seq.request_id, message, exc_info=exc)
    return SampleResult(None, error=message)
