"""The Sequence record: its lifecycle and its token bookkeeping."""

from __future__ import annotations

import pytest

from tserve.gpu.scheduling._sequence import IllegalTransition, Sequence, SequenceStatus
from tserve.protocol import SamplingParams

W, R, F = SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.FINISHED


def make(prompt: list[int], output: list[int] = []) -> Sequence:  # noqa: B006 (never mutated)
    return Sequence("r", list(prompt), SamplingParams(), output_token_ids=list(output))


@pytest.mark.parametrize("path", [[R, W, R, F], [F], [R, F], [R, W, F]])
def test_legal_paths(path: list[SequenceStatus]) -> None:
    seq = make([1])
    for status in path:
        seq.transition(status)
    assert seq.status is path[-1]


@pytest.mark.parametrize(
    ("path", "bad"), [([], W), ([R], R), ([F], W), ([F], R), ([F], F), ([R, F], W)]
)
def test_illegal_transitions_raise(path: list[SequenceStatus], bad: SequenceStatus) -> None:
    seq = make([1])
    for status in path:
        seq.transition(status)
    with pytest.raises(IllegalTransition):
        seq.transition(bad)
    assert seq.status is (path[-1] if path else W)


def test_token_counts() -> None:
    seq = make([1, 2, 3], [4, 5])
    assert (seq.num_tokens, seq.num_output_tokens, seq.num_uncomputed_tokens) == (5, 2, 5)
    seq.num_computed_tokens = 4
    assert seq.num_uncomputed_tokens == 1


def test_token_slice_matches_all_token_ids() -> None:
    seq = make([1, 2, 3], [4, 5, 6])
    everything = seq.all_token_ids
    for start in range(7):
        for stop in range(start, 7):
            assert seq.token_slice(start, stop) == everything[start:stop]
