"""The sampler on synthetic logits: no model needed."""

from __future__ import annotations

import collections
import math

import numpy as np
import numpy.typing as npt
import pytest
import torch

from tests.gpu.torch_free import assert_runs_without_torch
from tserve.gpu.sampling._candidates import _Cdf, _Whole, find_candidates
from tserve.gpu.sampling._sampler import FAULT_ENV, Sampler, SampleResult
from tserve.gpu.scheduling._sequence import Sequence
from tserve.protocol import Sampling, SamplingParams

VOCAB = 50


def _seq(request_id: str, **params: object) -> Sequence:
    return Sequence(request_id, [1, 2, 3], SamplingParams(**params))  # type: ignore[arg-type]


def _logits(n: int, seed: int = 0) -> npt.NDArray[np.float32]:
    return np.random.default_rng(seed).standard_normal((n, VOCAB), dtype=np.float32) * 3


def _log_softmax(logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))  # type: ignore[no-any-return]


def _sums(rows: list[npt.NDArray[np.float32]], params: list[Sampling]) -> list[_Cdf]:
    """``find_candidates`` of rows that keep few tokens: their ids and running sums."""
    out = find_candidates(rows, params)
    assert not any(isinstance(c, _Whole) for c in out)
    return out  # type: ignore[return-value]


def _tokens(results: list[SampleResult]) -> list[int | None]:
    assert all(r.error is None for r in results), [r.error for r in results]
    return [r.token_id for r in results]


def test_greedy_is_argmax() -> None:
    logits = _logits(8)
    seqs = [_seq(f"g{i}", temperature=0) for i in range(8)]
    assert _tokens(Sampler().sample(logits, seqs)) == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    "params",
    [
        {"top_k": 1},
        {"top_p": 1e-6},
        {"temperature": 1e-6},
        {"temperature": 1e-300},  # underflows to 0 in float32: greedy, not NaNs
        {"temperature": 5e-324},
    ],
)
def test_degenerate_filters_are_greedy(params: dict[str, object]) -> None:
    logits = _logits(8, seed=1)
    seqs = [_seq(f"s{i}", seed=i, **params) for i in range(8)]
    assert _tokens(Sampler().sample(logits, seqs)) == logits.argmax(-1).tolist()


def _run_alone_and_batched(params: dict[str, object], steps: int = 30) -> None:
    """The same seeded request, alone vs among changing neighbours, each step."""
    logits = _logits(steps, seed=2)
    alone, batched = Sampler(), Sampler()
    got_alone, got_batched = [], []
    for step in range(steps):
        target = _seq("target", seed=1234, **params)
        got_alone += _tokens(alone.sample(logits[step : step + 1], [target]))
        neighbours = [_seq(f"n{step}-{j}", seed=step * 10 + j, **params) for j in range(step % 5)]
        neighbours += [_seq(f"u{step}", temperature=0.7)]  # unseeded, draws from the shared rng
        batch = [*neighbours[: step % 3], target, *neighbours[step % 3 :]]
        rows = _logits(len(batch), seed=100 + step)
        rows[batch.index(target)] = logits[step]
        got_batched.append(batched.sample(rows, batch)[batch.index(target)].token_id)
    assert got_alone == got_batched
    assert len(set(got_alone)) > 3, "the draws should not all be the same token"


@pytest.mark.parametrize(
    "params",
    [{}, {"temperature": 0.8}, {"top_k": 10}, {"top_p": 0.9, "temperature": 1.3}],
)
def test_seeded_sampling_is_independent_of_the_batch(params: dict[str, object]) -> None:
    _run_alone_and_batched(params)


def test_different_seeds_differ_and_release_restarts_the_stream() -> None:
    logits = _logits(1, seed=3)
    sampler = Sampler()

    def stream(request_id: str, seed: int) -> list[int | None]:
        return [
            sampler.sample(logits[:1], [_seq(request_id, seed=seed)])[0].token_id for _ in range(20)
        ]

    first = stream("a", 7)
    assert stream("b", 8) != first
    sampler.release("a")
    assert stream("a", 7) == first


def test_sampling_follows_the_filtered_distribution() -> None:
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], dtype=np.float32))
    sampler = Sampler()

    def counts(**params: object) -> collections.Counter[int | None]:
        seq = _seq("d", seed=5, **params)
        draws = [sampler.sample(logits, [seq])[0].token_id for _ in range(4000)]
        sampler.release("d")
        return collections.Counter(draws)

    plain = counts()
    for token, p in enumerate([0.5, 0.3, 0.15, 0.05]):
        assert abs(plain[token] / 4000 - p) < 0.03
    top_k = counts(top_k=2)
    assert set(top_k) == {0, 1} and abs(top_k[0] / 4000 - 0.5 / 0.8) < 0.03
    # top_p keeps the smallest prefix whose mass reaches p: 0.5 + 0.3 >= 0.7.
    assert set(counts(top_p=0.7)) == {0, 1}
    assert set(counts(top_p=0.81)) == {0, 1, 2}


def test_penalties_lower_the_logits_of_output_tokens() -> None:
    logits = np.zeros((1, VOCAB), dtype=np.float32)
    logits[0, 3] = 1.0
    logits[0, 4] = 0.5
    seq = _seq("p", temperature=0, frequency_penalty=0.3)
    seq.output_token_ids = [3, 3, 9]  # token 3: 1.0 - 2 * 0.3 = 0.4 < 0.5
    assert _tokens(Sampler().sample(logits, [seq])) == [4]
    seq = _seq("q", temperature=0, presence_penalty=0.6)
    seq.output_token_ids = [3]  # 1.0 - 0.6 = 0.4 < 0.5
    assert _tokens(Sampler().sample(logits, [seq])) == [4]
    seq = _seq("r", temperature=0, presence_penalty=-2.0)
    seq.output_token_ids = [7]  # a negative penalty favours repeats: 0 + 2 > 1
    assert _tokens(Sampler().sample(logits, [seq])) == [7]
    seq = _seq("s", temperature=0, frequency_penalty=1.0)  # prompt tokens do not count
    seq.prompt_token_ids = [3, 3, 3]
    assert _tokens(Sampler().sample(logits, [seq])) == [3]


def test_logprobs_are_raw_and_ranked() -> None:
    logits = _logits(3, seed=4)
    seqs = [
        _seq("none", seed=1),
        _seq("zero", seed=2, logprobs=0),
        _seq("five", seed=3, logprobs=5, temperature=0.5, frequency_penalty=1.0),
    ]
    seqs[2].output_token_ids = [int(logits[2].argmax())]
    results = Sampler().sample(logits, seqs)
    raw = _log_softmax(logits)
    assert results[0].logprob is None
    for row, result in ((1, results[1]), (2, results[2])):
        lp = result.logprob
        assert lp is not None and lp.token_id == result.token_id
        assert math.isclose(lp.logprob, float(raw[row, lp.token_id]), abs_tol=1e-6)
    assert results[1].logprob is not None and results[1].logprob.top == []
    top = results[2].logprob.top if results[2].logprob else []
    best = np.argsort(raw[2])[::-1][:5]
    assert [t for t, _ in top] == best.tolist()
    assert [v for _, v in top] == pytest.approx(raw[2][best].tolist(), abs=1e-6)


def test_fault_injection_fails_only_matching_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = _logits(6, seed=5)
    ids = ["bad-1", "ok-1", "bad-2", "ok-2", "ok-3", "xbad-3"]

    def batch() -> list[Sequence]:
        return [_seq(i, seed=n, temperature=0.9, logprobs=2) for n, i in enumerate(ids)]

    clean = Sampler().sample(logits, batch())
    monkeypatch.setenv(FAULT_ENV, "^bad-")
    faulty = Sampler().sample(logits, batch())
    for request_id, want, got in zip(ids, clean, faulty, strict=True):
        if request_id.startswith("bad-"):
            assert got.token_id is None and got.error and "injected" in got.error
        else:
            assert got == want


def test_fault_injection_is_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAULT_ENV, raising=False)
    assert all(r.error is None for r in Sampler().sample(_logits(2), [_seq("bad-1"), _seq("x")]))


def test_a_request_that_breaks_the_batch_fails_alone() -> None:
    """A corrupt output history raises inside the batched part; only its owner fails."""
    logits = _logits(4, seed=6)
    seqs = [_seq(f"r{i}", seed=i, frequency_penalty=0.5) for i in range(4)]
    for seq in seqs:
        seq.output_token_ids = [1, 2]
    seqs[2].output_token_ids = [-5]  # bincount rejects negative ids
    reference = Sampler().sample(logits[[0, 1, 3]], [seqs[0], seqs[1], seqs[3]])
    results = Sampler().sample(logits, seqs)
    assert results[2].token_id is None and results[2].error
    assert [results[0], results[1], results[3]] == reference


def test_bad_rows_and_params_fail_alone() -> None:
    logits = _logits(4, seed=7)
    logits[1, 5] = float("nan")
    seqs = [_seq("a", seed=1), _seq("nan", seed=2), _seq("neg", temperature=-1.0), _seq("b")]
    results = Sampler().sample(logits, seqs)
    assert results[1].error and "non-finite" in results[1].error
    assert results[2].error and "temperature" in results[2].error
    assert results[0].error is None and results[3].error is None


@pytest.mark.parametrize("scale", [0.5, 12.0])  # most tokens near the top / most far below it
@pytest.mark.parametrize(
    ("top_p", "top_k"), [(0.5, 0), (0.95, 0), (0.999, 0), (0.95, 700), (1.0, 3000), (0.3, 5)]
)
def test_candidates_match_a_full_sort(top_p: float, top_k: int, scale: float) -> None:
    """Narrow top-w selections give exactly the kept set a full sort gives, less
    the tokens under 2^-24 / V times the top one's odds (never candidates)."""
    flat = np.random.default_rng(8).standard_normal((4, 20000), dtype=np.float32) * scale
    params = [Sampling(temperature=1.0, top_p=top_p, top_k=top_k)] * 4
    for row, (ids, cdf) in zip(flat, _sums(list(flat), params), strict=True):
        probs = np.exp(row.astype(np.float64) - row.max())
        near = int((probs >= 2.0**-24 / len(probs)).sum())
        probs /= probs.sum()
        order = np.argsort(probs)[::-1]
        before = np.cumsum(probs[order]) - probs[order]
        n = int(((before < top_p) & (np.arange(len(probs)) < (top_k or len(probs)))).sum())
        kept = np.flatnonzero(np.diff(cdf, prepend=0) > 0)
        assert ids is not None and len(kept) == min(n, near)
        assert set(ids[kept].tolist()) == set(order[: min(n, near)].tolist())


def test_top_p_ending_among_tied_tokens_keeps_the_first_of_them() -> None:
    """Token 0 holds 13% of the mass, 49 tied tokens 1.8% each: top-p 0.2 keeps 0 and 4 ties."""
    row = np.zeros(VOCAB, dtype=np.float32)
    row[0] = 2.0
    ids, cdf = _sums([row], [Sampling(temperature=1.0, top_p=0.2, top_k=0)])[0]
    assert ids is not None and ids.tolist() == [0, 1, 2, 3, 4]
    want = np.cumsum(np.exp([0.0, -2, -2, -2, -2]))
    assert cdf.tolist() == pytest.approx(want.tolist(), rel=1e-6)


def test_far_tokens_are_never_drawn_and_near_ones_keep_their_odds() -> None:
    """An unfiltered row whose tokens are mostly far below its top draws from the
    near ones in proportion to their probabilities."""
    logits = np.full((1, VOCAB), -1000.0, dtype=np.float32)
    logits[0, [3, 17, 40]] = np.log([0.5, 0.3, 0.2])
    ids, _ = _sums(list(logits), [Sampling(temperature=1.0, top_p=1.0, top_k=0)])[0]
    assert ids is not None and ids.tolist() == [3, 17, 40]
    sampler = Sampler()
    draws = collections.Counter(
        sampler.sample(logits, [_seq("near", seed=4)])[0].token_id for _ in range(4000)
    )
    assert set(draws) == {3, 17, 40}
    for token, p in ((3, 0.5), (17, 0.3), (40, 0.2)):
        assert abs(draws[token] / 4000 - p) < 0.03


# --------------------------------------------------------------- logit_bias and grammar masks


def test_logit_bias_plus_100_forces_and_minus_100_bans() -> None:
    logits = _logits(4, seed=7)
    best = logits.argmax(-1).tolist()
    seqs = [
        _seq("force-greedy", temperature=0, logit_bias=((11, 100.0),)),
        _seq("force-sampled", seed=3, temperature=1.0, logit_bias=((12, 100.0),)),
        _seq("ban", temperature=0, logit_bias=((best[2], -100.0),)),
        _seq("plain", temperature=0),
    ]
    sampler = Sampler()
    for _ in range(20):
        got = _tokens(sampler.sample(logits, seqs))
        assert got[:2] == [11, 12]
        assert got[2] != best[2]
        banned = logits[2].copy()
        banned[best[2]] = -1e9
        assert got[2] == banned.argmax()
        assert got[3] == best[3]


def test_biased_rows_leave_their_neighbours_and_logprobs_alone() -> None:
    """Biases change only their own row's choice; logprobs stay the raw model's."""
    logits = _logits(3, seed=8)
    plain = [_seq(f"p{i}", temperature=0, logprobs=1) for i in range(3)]
    mixed = [
        plain[0],
        _seq("b1", temperature=0, logprobs=1, logit_bias=((5, 100.0), (5, -100.0), (6, 100.0))),
        plain[2],
    ]
    before = Sampler().sample(logits, plain)
    after = Sampler().sample(logits, mixed)
    assert after[1].token_id == 6  # a repeated id's biases add up: 5 ends at +0
    assert [after[0], after[2]] == [before[0], before[2]]
    assert after[1].logprob is not None and before[1].logprob is not None
    raw = _log_softmax(logits)[1]
    assert after[1].logprob.logprob == pytest.approx(float(raw[6]))


def test_a_mask_limits_a_row_to_its_allowed_tokens() -> None:
    logits = _logits(3, seed=9)
    allowed = np.zeros(VOCAB, dtype=np.bool_)
    allowed[[4, 9, 30]] = True
    seqs = [
        _seq("m-greedy", temperature=0),
        _seq("m-sampled", seed=1),
        _seq("plain", temperature=0),
    ]
    sampler = Sampler()
    masks = {0: allowed, 1: allowed}
    for _ in range(30):
        got = _tokens(sampler.sample(logits, seqs, masks))
        assert got[0] == max((4, 9, 30), key=lambda t: float(logits[0, t]))
        assert got[1] in (4, 9, 30)
        assert got[2] == logits[2].argmax()


def test_the_mask_applies_after_logit_bias() -> None:
    """+100 on a token the grammar forbids cannot force it."""
    logits = _logits(1, seed=10)
    allowed = np.zeros(VOCAB, dtype=np.bool_)
    allowed[[3, 8]] = True
    seq = _seq("x", temperature=0, logit_bias=((20, 100.0), (8, 50.0)))
    assert _tokens(Sampler().sample(logits, [seq], {0: allowed})) == [8]


def test_a_mask_that_allows_nothing_fails_that_request_alone() -> None:
    logits = _logits(2, seed=11)
    nothing = np.zeros(VOCAB, dtype=np.bool_)
    results = Sampler().sample(logits, [_seq("dead"), _seq("ok", temperature=0)], {0: nothing})
    assert results[0].token_id is None and results[0].error is not None
    assert "allows no token" in results[0].error
    assert results[1].token_id == logits[1].argmax()


# ------------------------------------------------------------------------ inputs and imports


def test_a_cpu_torch_tensor_samples_as_its_numpy_array_does() -> None:
    """The torch runner hands its CPU float32 logits over as they are (read in place)."""
    logits = _logits(6, seed=12)
    mask = np.zeros(VOCAB, dtype=np.bool_)
    mask[[1, 2, 3]] = True

    def batch() -> list[Sequence]:
        return [
            _seq("greedy", temperature=0, logprobs=3),
            _seq("seeded", seed=5, top_p=0.8, temperature=0.9, logprobs=1),
            _seq("penalised", seed=6, frequency_penalty=1.0, logit_bias=((7, 5.0),)),
            _seq("top-k", seed=7, top_k=4),
            _seq("masked", seed=8),
            _seq("plain", seed=9),
        ]

    seqs = batch()
    seqs[2].output_token_ids = [int(logits[2].argmax())] * 3
    tensor = torch.from_numpy(logits.copy())
    want = Sampler().sample(logits, seqs, {4: mask})
    seqs = batch()
    seqs[2].output_token_ids = [int(logits[2].argmax())] * 3
    assert Sampler().sample(tensor, seqs, {4: mask}) == want
    assert torch.equal(tensor, torch.from_numpy(logits)), "the sampler never writes its input"


def test_the_sampler_and_the_masks_import_without_torch() -> None:
    """The torch-free engine samples with them: neither pulls torch in, directly or not."""
    assert_runs_without_torch(
        "import tserve.gpu.sampling._sampler, tserve.gpu.sampling._constraints"
    )
