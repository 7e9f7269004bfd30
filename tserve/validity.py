"""What makes a request valid: one rule, checked in both processes.

The API process checks first, so that a client gets a 400 naming the field;
the engine checks the same rule again when a request arrives (a peer on the
wire may have skipped the API's checks) and fails that one request. Each
check returns a :class:`Problem` (the field and a message) or None; the
caller turns it into its own error type.

A leaf beside :mod:`tserve.protocol`: it imports only the standard library
and :mod:`tserve.sampling`, so both processes import it without pulling in
torch, zmq or trio.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final, NamedTuple

from tserve.sampling import SamplingParams

__all__ = [
    "GREEDY_BELOW",
    "MAX_LOGIT_BIAS",
    "MAX_LOGPROBS",
    "Problem",
    "embedding_problem",
    "generation_problem",
    "logit_bias_problem",
    "params_problem",
    "tokens_problem",
]

MAX_LOGPROBS: Final = 20
"""The most alternatives per token a request may ask for (``logprobs``, ``top_logprobs``)."""

MAX_LOGIT_BIAS: Final = 1024
"""The most (token id, bias) entries a request's ``logit_bias`` may hold."""

LOGIT_BIAS_RANGE: Final = 100.0
"""A bias is a finite number in [-LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE]."""

GREEDY_BELOW: Final = 1e-5
"""Temperatures below this sample greedily: dividing float32 logits by a
smaller one overflows to infinities and NaNs instead of approaching argmax."""


class Problem(NamedTuple):
    """Why a request is invalid: ``param`` names the request field."""

    param: str
    message: str


def tokens_problem(
    ids: Sequence[int], vocab_size: int, param: str, *, label: str | None = None
) -> Problem | None:
    """A token id in ``ids`` outside ``[0, vocab_size)``, for field ``param``
    (``label``, default ``param``, names the ids in the message)."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is None:
        return None
    what = label or param
    return Problem(param, f"{what}: token id {bad} is outside the vocabulary [0, {vocab_size})")


def generation_problem(
    prompt: Sequence[int], params: SamplingParams, *, vocab_size: int, max_model_len: int
) -> Problem | None:
    """The first problem with generating from ``prompt`` with ``params``, or None.

    O(len(prompt) + len(stop_token_ids)); the prompt's ids are scanned once.
    """
    if not prompt:
        return Problem("prompt", "prompt is empty")
    problem = params_problem(params, vocab_size)
    if problem is not None:
        return problem
    if len(prompt) + params.max_tokens > max_model_len:
        return Problem(
            "max_tokens" if len(prompt) < max_model_len else "prompt",
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"the context length of {max_model_len} tokens",
        )
    return tokens_problem(prompt, vocab_size, "prompt")


def params_problem(params: SamplingParams, vocab_size: int) -> Problem | None:
    """The first field of ``params`` out of its range, or None (an unset field is fine)."""
    most_logprobs = min(MAX_LOGPROBS, vocab_size)
    checks: tuple[tuple[bool, str, str], ...] = (
        (params.max_tokens >= 1, "max_tokens", "must be at least 1"),
        (
            params.temperature is None
            or (math.isfinite(params.temperature) and params.temperature >= 0),
            "temperature",
            "must be a finite number >= 0",
        ),
        (
            params.top_p is None or (math.isfinite(params.top_p) and 0 < params.top_p <= 1),
            "top_p",
            "must be in (0, 1]",
        ),
        (params.top_k is None or params.top_k >= -1, "top_k", "must be -1, 0 or positive"),
        (
            params.logprobs is None or 0 <= params.logprobs <= most_logprobs,
            "logprobs",
            f"must be between 0 and {most_logprobs}",
        ),
        (
            math.isfinite(params.presence_penalty) and -2 <= params.presence_penalty <= 2,
            "presence_penalty",
            "must be in [-2, 2]",
        ),
        (
            math.isfinite(params.frequency_penalty) and -2 <= params.frequency_penalty <= 2,
            "frequency_penalty",
            "must be in [-2, 2]",
        ),
    )
    for ok, param, message in checks:
        if not ok:
            return Problem(param, f"{param} {message}")
    problem = tokens_problem(params.stop_token_ids, vocab_size, "stop_token_ids")
    return problem or logit_bias_problem(params.logit_bias, vocab_size)


def logit_bias_problem(bias: Sequence[tuple[int, float]], vocab_size: int) -> Problem | None:
    """The first bad entry of ``logit_bias`` (at most MAX_LOGIT_BIAS entries; ids in
    the vocabulary; finite biases in [-100, 100]), or None. O(len(bias))."""
    if len(bias) > MAX_LOGIT_BIAS:
        return Problem(
            "logit_bias", f"logit_bias holds {len(bias)} entries; at most {MAX_LOGIT_BIAS}"
        )
    problem = tokens_problem([token for token, _ in bias], vocab_size, "logit_bias")
    if problem is not None:
        return problem
    for token, value in bias:
        if not (math.isfinite(value) and -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE):
            return Problem(
                "logit_bias",
                f"logit_bias: the bias of token {token} must be a finite number in [-100, 100]",
            )
    return None


def embedding_problem(
    ids: Sequence[int], *, vocab_size: int, max_len: int, label: str = "input"
) -> Problem | None:
    """The problem with embedding ``ids`` (one input, ``label`` in the message), or None."""
    if not ids:
        return Problem("input", f"{label} is empty")
    if len(ids) > max_len:
        return Problem(
            "input", f"{label} is {len(ids)} tokens; the model takes at most {max_len} per input"
        )
    return tokens_problem(ids, vocab_size, "input", label=label)
