"""Automatic prefix caching in the engine, with the tiny model (fp32, CPU), in process.

The cache must never change a token: every run here is compared with the same
requests on an engine whose cache is off. A driver keeps a fixed number of
requests in flight (a new one joins as soon as one ends), steps the core until
it is idle, and checks the scheduler's invariants after every step.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.cores import small_core
from tserve.gpu.engine._engine_core import EngineCore
from tserve.protocol import AddRequest, FinishReason, SamplingParams

VOCAB = 512  # the tiny model's
PEER = b"api-1"


def _core(model_dir: Path, *, prefix_caching: bool, **config: Any) -> EngineCore:
    return small_core(model_dir, enable_prefix_caching=prefix_caching, **config)


def _run(core: EngineCore, requests: list[AddRequest], concurrency: int) -> dict[str, list[int]]:
    """Every request's tokens, with at most ``concurrency`` of them in flight."""
    queue = list(reversed(requests))
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    in_flight = 0
    for _ in range(100_000):  # a hang guard
        while queue and in_flight < concurrency:
            core.add(queue.pop(), PEER)
            in_flight += 1
        if not in_flight:
            return tokens
        for _, out in core.step():
            assert out.finish_reason in (None, FinishReason.LENGTH), out
            tokens[out.request_id] += out.token_ids
            in_flight -= out.finish_reason is not None
        core.scheduler.check()
    raise AssertionError("the engine did not finish")


def _idle(core: EngineCore) -> None:
    """Nothing held: every block is free (cached free blocks stay evictable)."""
    stats = core.stats()
    assert (stats.running, stats.waiting, stats.kv_tokens_used) == (0, 0, 0)
    blocks = core.blocks
    assert (blocks.num_used_blocks, blocks.num_free_blocks) == (0, blocks.num_blocks)
    assert all(blocks.ref_count(b) == 0 for b in range(blocks.num_blocks))
    blocks.check([])


def _mixed_requests(rng: random.Random, n: int) -> list[AddRequest]:
    """Prompts made of one of a few shared system prompts (or none) and a tail of
    their own; some are exact repeats of an earlier prompt."""
    systems = [[rng.randrange(VOCAB) for _ in range(k)] for k in (16, 40, 75, 130)]
    prompts: list[list[int]] = []
    for _ in range(n):
        if prompts and rng.random() < 0.15:
            prompts.append(list(rng.choice(prompts)))
            continue
        system = rng.choice([[], *systems])
        tail = [rng.randrange(VOCAB) for _ in range(rng.choice([1, 3, 9, 17, 33, 60]))]
        prompts.append(system + tail)
    return [
        AddRequest(
            f"m{i}",
            prompt,
            SamplingParams(max_tokens=rng.randint(2, 20), temperature=0, ignore_eos=True),
        )
        for i, prompt in enumerate(prompts)
    ]


def test_64_mixed_requests_at_concurrency_16_are_the_same_with_the_cache_on_and_off(
    tiny_model_dir: Path,
) -> None:
    requests = _mixed_requests(random.Random(1), 64)
    off = _core(tiny_model_dir, prefix_caching=False)
    on = _core(tiny_model_dir, prefix_caching=True)

    expected = _run(off, requests, concurrency=16)
    got = _run(on, requests, concurrency=16)

    for request in requests:
        rid = request.request_id
        assert len(got[rid]) == request.params.max_tokens
        assert got[rid] == expected[rid], f"{rid}, prompt of {len(request.prompt_token_ids)}"
    stats = on.stats()
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    assert stats.prefix_cache_queries == prompt_tokens  # no preemption with this budget
    assert stats.prefix_cache_hits > prompt_tokens // 4, "the shared prefixes were not shared"
    assert (off.stats().prefix_cache_queries, off.stats().prefix_cache_hits) == (0, 0)
    _idle(on)
    _idle(off)


def test_eviction_past_the_kv_budget_keeps_every_request_correct(tiny_model_dir: Path) -> None:
    """Distinct prefixes totalling several times the KV cache, each asked for twice
    (soon after, and much later): the cache fills, evicts least recently used
    blocks, still hits on recent prefixes, and no request changes by a token."""
    rng = random.Random(2)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(40, 120))] for _ in range(24)]
    order = [*range(24), *range(24)]
    for i in range(0, 24, 2):  # a prefix's second use, now and then, right after its first
        order.insert(order.index(i) + 1, i)
    prompts = [prefixes[i] + [rng.randrange(VOCAB) for _ in range(5)] for i in order]
    requests = [
        AddRequest(f"e{i}", p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    settings = {"kv_cache_tokens": 512, "max_num_seqs": 4}
    off = _core(tiny_model_dir, prefix_caching=False, **settings)
    on = _core(tiny_model_dir, prefix_caching=True, **settings)
    assert sum(len(p) for p in prefixes) > 3 * on.blocks.tokens_total

    expected = _run(off, requests, concurrency=4)
    got = _run(on, requests, concurrency=4)

    assert got == expected
    stats = on.stats()
    assert 0 < stats.prefix_cache_hits < stats.prefix_cache_queries
    _idle(on)
    # Cached blocks remain, evictable, and the cache holds no more than it has room for.
    assert 0 < on.blocks.num_cached_blocks <= on.blocks.num_blocks
    # The first prefixes were evicted long ago: asking again computes them in full.
    before = on.stats().prefix_cache_hits
    _run(on, [requests[0]], concurrency=1)
    assert on.stats().prefix_cache_hits == before


@pytest.mark.parametrize("chunk_budget", [16, 512])
def test_a_prefill_after_a_cached_prefix_attends_over_the_pool(
    tiny_model_dir: Path, tiny_model: tuple[Any, Any], chunk_budget: int
) -> None:
    """Against ``generate`` itself: a request that shares a cached prefix computes
    only its tail (in one chunk or several), attending over the shared blocks."""
    import torch

    reference, _ = tiny_model
    rng = random.Random(3)
    system = [rng.randrange(VOCAB) for _ in range(70)]
    prompts = [system + [rng.randrange(VOCAB) for _ in range(k)] for k in (1, 9, 40)]
    core = _core(tiny_model_dir, prefix_caching=True, max_num_batched_tokens=chunk_budget)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    got = _run(core, [AddRequest(f"p{i}", p, params) for i, p in enumerate(prompts)], 1)
    assert core.stats().prefix_cache_hits == 2 * 64  # 4 full blocks of the system prompt, twice
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = reference.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                eos_token_id=None,
            )  # fmt: skip
        assert got[f"p{i}"] == [int(t) for t in out[0, len(prompt) :]], f"p{i}"
    _idle(core)
