"""benchmarks.greedy_agreement's prompt set and its comparison with two llama.cpp builds."""

from __future__ import annotations

import pytest

from benchmarks.greedy_agreement import PROMPTS, against_builds, prompt_set, sign_test


def test_the_prompt_set_is_the_fixed_prompts_then_distinct_sonnet_openings() -> None:
    prompts = prompt_set(200)
    assert prompts[: len(PROMPTS)] == list(PROMPTS)
    assert len(set(prompts)) == 200
    assert all(4 <= len(p.split()) <= 8 for p in prompts[len(PROMPTS) :])
    assert prompt_set(200) == prompts  # the same texts on every run
    assert prompt_set(10) == list(PROMPTS[:10])
    with pytest.raises(SystemExit, match="--prompts: at most"):
        prompt_set(10_000)


def test_the_sign_test_is_the_binomial_tails() -> None:
    assert sign_test(0, 0) == 1.0
    assert sign_test(5, 5) == 1.0
    assert sign_test(0, 10) == pytest.approx(2 / 1024)
    assert sign_test(10, 0) == sign_test(0, 10)
    assert sign_test(1, 7) == pytest.approx(2 * (1 + 8) / 256)


def test_tserve_is_set_beside_the_two_builds_prompt_by_prompt() -> None:
    a, b, c = ["x"], ["y"], ["z"]
    completions = {
        "llama-server": [a, a, a, a],
        "llama-server-b": [a, a, b, b],
        "tserve": [a, c, a, c],
    }
    split = against_builds(completions)["tserve"]
    assert split["identical"] == 2 and split["builds_identical"] == 2
    assert split["only_this_pair"] == 1 and split["only_the_builds"] == 1
    assert split["sign_test_p"] == 1.0
    assert against_builds({k: v for k, v in completions.items() if k != "llama-server-b"}) == {}
