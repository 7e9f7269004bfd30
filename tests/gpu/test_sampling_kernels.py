"""The sampler's compiled candidate pass and draw (``_sampling_kernels.c``)
against the numpy form they replace, at every instruction-set variant."""

from __future__ import annotations

import collections

import numpy as np
import numpy.typing as npt
import pytest

from tserve.gpu.sampling import _candidates
from tserve.gpu.sampling._candidates import _candidate_kernel, _CandidateKernel, _Whole
from tserve.gpu.sampling._sampler import Sampler
from tserve.gpu.scheduling._sequence import Sequence
from tserve.protocol import Sampling, SamplingParams

# (vocabulary, logit scale): a tail past the 16-value blocks, and rows whose
# candidates are most of the vocabulary (scale 0.3) or a few (scale 12)
SHAPES = [(37, 0.3), (1000, 12.0), (49152, 0.3), (49152, 12.0), (262144, 0.3), (262144, 6.0)]


@pytest.fixture
def kernel(glue_isa: int) -> _CandidateKernel:
    compiled = _candidate_kernel()
    assert compiled is not None, "the package is installed, so its kernels are built"
    return compiled


def _row(vocab: int, scale: float, seed: int = 0) -> npt.NDArray[np.float32]:
    return np.random.default_rng(seed).standard_normal(vocab, dtype=np.float32) * scale


@pytest.mark.parametrize(("vocab", "scale"), SHAPES)
@pytest.mark.parametrize("temperature", [0.3, 1.0])
def test_candidates_are_numpys(
    kernel: _CandidateKernel, vocab: int, scale: float, temperature: float
) -> None:
    """The same candidate ids; probabilities and running sums to float32 rounding."""
    row = _row(vocab, scale)
    for plain in (True, False):
        ids, probs, cdf = _candidates._near_top(row, temperature, plain)
        got = kernel(row, temperature, plain)
        if isinstance(got, _Whole):  # a temperature-only row of mostly candidates
            assert plain and ids is None and got.logits is row
            continue
        got_ids, got_probs, got_cdf = got
        assert (got_ids is None) == (ids is None)
        if ids is not None:
            assert got_ids is not None and np.array_equal(got_ids, ids)
        if plain:
            assert cdf is not None and got_cdf is not None
            np.testing.assert_allclose(got_cdf, cdf, rtol=1e-6)
        else:
            assert got_cdf is None
            np.testing.assert_allclose(got_probs, probs, rtol=1e-6, atol=0)


@pytest.mark.parametrize(("vocab", "scale"), [s for s in SHAPES if s[1] < 1])
def test_whole_row_draws_are_a_search_of_numpys_sums(
    kernel: _CandidateKernel, vocab: int, scale: float
) -> None:
    """The token a draw picks is the first whose running sum exceeds u times the
    row's, as searching numpy's cumulative sums finds it, from u = 0 to just under 1."""
    row = _row(vocab, scale, seed=1)
    whole = kernel(row, 1.0, True)
    assert isinstance(whole, _Whole)
    _, _, cdf = _candidates._near_top(row, 1.0, True)
    assert cdf is not None
    draws = [0.0, float(np.nextafter(1.0, 0.0)), *np.random.default_rng(2).random(400)]
    for u in draws:
        want = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), vocab - 1)
        assert kernel.draw(whole, u) == want, u


def test_a_whole_row_never_draws_a_banned_token(kernel: _CandidateKernel) -> None:
    """Tokens at -inf (a grammar's or logit_bias's ban) weigh nothing, at the
    row's end too, where rounding might leave a draw near 1 past every sum."""
    row = _row(1000, 0.3, seed=3)
    row[::7] = -np.inf
    row[-40:] = -np.inf
    whole = kernel(row, 1.0, True)
    assert isinstance(whole, _Whole)
    allowed = np.flatnonzero(np.isfinite(row))
    for u in (0.0, 0.5, float(np.nextafter(1.0, 0.0))):
        assert kernel.draw(whole, u) in allowed
    assert kernel.draw(whole, float(np.nextafter(1.0, 0.0))) == allowed[-1]


def _seq(request_id: str, **params: object) -> Sequence:
    return Sequence(request_id, [1, 2, 3], SamplingParams(**params))  # type: ignore[arg-type]


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
def test_whole_row_draws_keep_the_odds(
    glue_isa: int, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the sampler, a row whose tokens are all candidates draws each as
    often as its probability says, compiled or on numpy alone (an install
    without the kernels), and a seeded request repeats its tokens."""
    if not compiled:
        monkeypatch.setattr(_candidates, "_candidate_kernel", lambda: None)
    logits = np.zeros((1, 64), dtype=np.float32)
    logits[0, :4] = np.log([8.0, 4.0, 2.0, 1.0])  # 60 more tokens of weight 1
    probs = np.exp(logits[0]) / np.exp(logits[0]).sum()
    sampler = Sampler()
    draws = collections.Counter(
        sampler.sample(logits, [_seq("odds", seed=5)])[0].token_id for _ in range(6000)
    )
    for token in (0, 1, 2, 3, 40):
        assert abs(draws[token] / 6000 - probs[token]) < 0.015, token
    first, second = Sampler(), Sampler()
    tokens = [first.sample(logits, [_seq("odds", seed=9)])[0].token_id for _ in range(50)]
    assert tokens == [second.sample(logits, [_seq("odds", seed=9)])[0].token_id for _ in range(50)]
    assert len(set(tokens)) > 5


@pytest.mark.parametrize("plain", [True, False])
def test_results_do_not_share_memory(kernel: _CandidateKernel, plain: bool) -> None:
    """A row's candidates stay as they were when the next row is computed (the
    kernel's scratch is reused)."""
    first_row, second_row = _row(1000, 12.0, seed=4), _row(1000, 12.0, seed=5)
    first = kernel(first_row, 1.0, plain)
    assert not isinstance(first, _Whole)  # few candidates: arrays of its own
    arrays = [a for a in first if a is not None]
    kept = [a.copy() for a in arrays]
    kernel(second_row, 1.0, plain)
    for before, now in zip(kept, arrays, strict=True):
        assert np.array_equal(before, now)


@pytest.mark.parametrize("scale", [0.3, 4.0])
def test_top_filters_keep_numpys_tokens(
    kernel: _CandidateKernel, scale: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """top-k / top-p over the compiled candidates keep the tokens they keep over
    numpy's, with the same running sums to float32 rounding."""
    rows = [_row(49152, scale, seed=6), _row(262144, scale, seed=7)]
    params = [Sampling(1.0, 0.9, 0), Sampling(0.7, 1.0, 40), Sampling(1.2, 0.95, 400)]
    compiled = [_candidates.find_candidates([row], [p])[0] for row in rows for p in params]
    monkeypatch.setattr(_candidates, "_candidate_kernel", lambda: None)
    numpys = [_candidates.find_candidates([row], [p])[0] for row in rows for p in params]
    for got, want in zip(compiled, numpys, strict=True):
        assert not isinstance(got, _Whole) and not isinstance(want, _Whole)
        assert want[0] is not None and got[0] is not None
        assert np.array_equal(got[0], want[0])
        np.testing.assert_allclose(got[1], want[1], rtol=1e-5)


def test_rows_the_probe_misjudges_get_numpys_candidates(kernel: _CandidateKernel) -> None:
    """The first 4,096 tokens only route a row: one whose many candidates all lie
    past them is numpy's (every token, no gather), and one whose few lie among
    them is counted whole and found few; either way the candidates are numpy's."""
    late = np.full(262144, -100.0, dtype=np.float32)
    late[8192:] = _row(262144 - 8192, 0.3)
    early = np.full(262144, -100.0, dtype=np.float32)
    early[:4096] = _row(4096, 0.3)
    for row in (late, early):
        got, (ids, _, cdf) = kernel(row, 1.0, True), _candidates._near_top(row, 1.0, True)
        assert not isinstance(got, _Whole) and cdf is not None and got[2] is not None
        assert (got[0] is None) == (ids is None) and (row is early) == (ids is not None)
        np.testing.assert_allclose(got[2], cdf, rtol=1e-6)
