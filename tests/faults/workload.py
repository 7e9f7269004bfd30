"""Seeded request mixes for the fault-isolation tests, and how to run them.

A request here is a :class:`Spec`: an id, a token-id prompt and sampling
parameters that depend only on the request's index, so the same index gives
the same request (and, seeded, the same output) in any run, batch or order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import anyio

from tserve.nursery import LLM, Completion, LLMStats
from tserve.protocol import SamplingParams

MAX_TOKENS = 12
LOGPROB_NOISE = 1e-3  # see assert_same

# (token id, logprob, top alternatives) per generated token
Logprobs = list[tuple[int, float, list[tuple[int, float]]]]


@dataclasses.dataclass(frozen=True, slots=True)
class Spec:
    request_id: str
    prompt: list[int]
    params: SamplingParams


@dataclasses.dataclass(frozen=True, slots=True)
class Output:
    token_ids: list[int]
    finish_reason: str
    logprobs: Logprobs | None


def seeded_spec(index: int, *, prefix: str = "r", max_tokens: int = MAX_TOKENS) -> Spec:
    """Request ``index`` of the mix: its own seed and prompt; greedy or sampled,
    with or without top-p / top-k, logprobs on every odd index; EOS ignored so
    that every request yields exactly ``max_tokens`` tokens."""
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=(0.0, 0.7, 1.0, 1.3)[index % 4],
        top_p=(1.0, 0.9, 0.5)[index % 3],
        top_k=(0, 1, 5, 50, 0)[index % 5],
        seed=10_000 + index,
        logprobs=(0, 1, 3, 5)[index // 2 % 4] if index % 2 else None,
        ignore_eos=True,
    )
    prompt = [(7 * index + 13 * j) % 500 + 5 for j in range(3 + index % 23)]
    return Spec(f"{prefix}-{index}", prompt, params)


def noise_spec(index: int) -> Spec:
    """An unrelated, unseeded, longer request to change the batches around others."""
    params = SamplingParams(max_tokens=40, temperature=1.0, ignore_eos=True, logprobs=2)
    return Spec(f"noise-{index}", [(31 * index + j) % 400 + 50 for j in range(9)], params)


def output_of(completion: Completion) -> Output:
    logprobs = None
    if completion.logprobs is not None:
        logprobs = [(lp.token_id, lp.logprob, list(lp.top)) for lp in completion.logprobs]
    return Output(completion.token_ids, completion.finish_reason, logprobs)


async def run_one(llm: LLM, spec: Spec) -> Output:
    return output_of(await llm.complete(spec.prompt, spec.params, request_id=spec.request_id))


async def run_concurrently(llm: LLM, specs: Iterable[Spec]) -> dict[str, Output]:
    """Every spec at once; each result by request id. Any request's error propagates."""
    results: dict[str, Output] = {}

    async def one(spec: Spec) -> None:
        results[spec.request_id] = await run_one(llm, spec)

    async with anyio.create_task_group() as tg:
        for spec in specs:
            tg.start_soon(one, spec)
    return results


def assert_complete(spec: Spec, output: Output) -> None:
    """The request produced exactly its ``max_tokens`` tokens (EOS is ignored)."""
    assert output.finish_reason == "length", spec
    assert len(output.token_ids) == spec.params.max_tokens, spec
    assert all(0 <= t < 512 for t in output.token_ids)
    if spec.params.logprobs is None:
        assert output.logprobs is None
    else:
        assert output.logprobs is not None
        assert [lp[0] for lp in output.logprobs] == output.token_ids
        for _, logprob, top in output.logprobs:
            assert logprob <= 0 and math.isfinite(logprob)
            assert len(top) == spec.params.logprobs


def assert_same(expected: Output, actual: Output, what: str) -> None:
    """Same tokens; same logprobs up to float noise.

    Token ids must match exactly. Logprobs are computed by batched matmuls
    whose float rounding depends on the batch's shape, so they match across
    different batches up to float noise, not bit for bit. The tiny model's
    large random weights amplify that noise: over 12 steps it reaches about
    1.2e-4 (one request in 64; most stay under 4e-5), so the bound is 1e-3,
    still far below what a wrong position, KV block or sampler row would cause.
    """
    assert actual.token_ids == expected.token_ids, what
    assert actual.finish_reason == expected.finish_reason, what
    if expected.logprobs is None:
        assert actual.logprobs is None, what
        return
    assert actual.logprobs is not None, what
    for (tok_e, lp_e, top_e), (tok_a, lp_a, top_a) in zip(
        expected.logprobs, actual.logprobs, strict=True
    ):
        assert tok_a == tok_e, what
        assert math.isclose(lp_a, lp_e, abs_tol=LOGPROB_NOISE), what
        assert [t for t, _ in top_a] == [t for t, _ in top_e], what
        assert all(
            math.isclose(a, e, abs_tol=LOGPROB_NOISE)
            for (_, a), (_, e) in zip(top_a, top_e, strict=True)
        ), what


async def wait_until_idle(llm: LLM) -> LLMStats:
    """Poll until the engine reports nothing running or waiting and no KV in use.

    Stats arrive with the next step frame or heartbeat (every 0.5 s idle), so
    the last report may lag the last output a little.
    """
    while True:
        stats = llm.stats
        engine = stats.engine
        if engine.running == engine.waiting == engine.kv_tokens_used == 0:
            return stats
        await anyio.sleep(0.05)
