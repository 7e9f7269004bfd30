"""The one validity rule both processes apply (``tserve.validity``)."""

from __future__ import annotations

from typing import Any

import pytest

from tserve.protocol import SamplingParams
from tserve.validity import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    Problem,
    embedding_problem,
    generation_problem,
    params_problem,
)

VOCAB = 100


def problem(prompt: list[int], **params: Any) -> Problem | None:
    return generation_problem(prompt, SamplingParams(**params), vocab_size=VOCAB, max_model_len=64)


def test_a_valid_request_has_no_problem() -> None:
    assert problem([1, 2, 3], max_tokens=61, logprobs=MAX_LOGPROBS, stop_token_ids=(99,)) is None


@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        ([], {}, "prompt"),
        ([1], {"max_tokens": 0}, "max_tokens"),
        ([1], {"temperature": -0.5}, "temperature"),
        ([1], {"temperature": float("nan")}, "temperature"),
        ([1], {"top_p": 0.0}, "top_p"),
        ([1], {"top_k": -2}, "top_k"),
        ([1], {"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ([1], {"presence_penalty": 2.5}, "presence_penalty"),
        ([1], {"frequency_penalty": float("inf")}, "frequency_penalty"),
        ([1], {"stop_token_ids": (5, VOCAB)}, "stop_token_ids"),
        ([1, VOCAB], {}, "prompt"),
        ([1, -1], {}, "prompt"),
        ([1] * 10, {"max_tokens": 55}, "max_tokens"),
        ([1] * 64, {"max_tokens": 1}, "prompt"),
        ([1], {"logit_bias": ((VOCAB, 1.0),)}, "logit_bias"),
        ([1], {"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ([1], {"logit_bias": ((3, 100.5),)}, "logit_bias"),
        ([1], {"logit_bias": ((3, float("nan")),)}, "logit_bias"),
        (
            [1],
            {"logit_bias": tuple((i % VOCAB, 0.0) for i in range(MAX_LOGIT_BIAS + 1))},
            "logit_bias",
        ),
    ],
)
def test_each_field_out_of_range_is_named(
    prompt: list[int], params: dict[str, Any], param: str
) -> None:
    found = problem(prompt, **params)
    assert found is not None
    assert found.param == param
    assert param.split("_")[0] in found.message


def test_logit_bias_in_range_is_valid() -> None:
    bias = tuple((i % VOCAB, -100.0 if i % 2 else 100.0) for i in range(MAX_LOGIT_BIAS))
    assert problem([1], logit_bias=bias) is None
    found = problem([1], logit_bias=((7, -101.0),))
    assert found == Problem(
        "logit_bias", "logit_bias: the bias of token 7 must be a finite number in [-100, 100]"
    )


def test_logprobs_never_exceed_the_vocabulary() -> None:
    found = params_problem(SamplingParams(logprobs=5), vocab_size=4)
    assert found is not None and found.param == "logprobs"


def test_embedding_inputs_are_named_in_the_message() -> None:
    assert embedding_problem([1, 2], vocab_size=VOCAB, max_len=2) is None
    empty = embedding_problem([], vocab_size=VOCAB, max_len=2, label="input[3]")
    assert empty == Problem("input", "input[3] is empty")
    long = embedding_problem([1, 2, 3], vocab_size=VOCAB, max_len=2, label="input[0]")
    assert long is not None and "3 tokens" in long.message and long.param == "input"
    bad = embedding_problem([1, VOCAB], vocab_size=VOCAB, max_len=2, label="input[1]")
    assert bad is not None and bad.message.startswith("input[1]: token id 100")
