"""Many concurrent seeded requests: all complete, and each one's output does not
depend on what else was in its batches (issue 7, test 1).

The failure this guards against: a server whose CPU engine died whole when 64
concurrent completions each carried a ``seed`` (an exception in per-request
sampling bookkeeping), failing every request in flight.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from msgspec.structs import replace

from tests.faults.workload import (
    Output,
    Spec,
    assert_complete,
    assert_same,
    noise_spec,
    run_concurrently,
    run_one,
    seeded_spec,
    wait_until_idle,
)
from tests.guards import HANG_GUARD
from tserve.nursery import LLM, open_llm

pytestmark = pytest.mark.anyio


async def _in_batches_of_7_with_noise(llm: LLM, specs: list[Spec]) -> dict[str, Output]:
    """The specs seven at a time while unrelated noise requests keep running."""
    results: dict[str, Output] = {}
    async with anyio.create_task_group() as noise:
        for start in range(0, len(specs), 7):
            noise.start_soon(run_one, llm, noise_spec(start))
            results |= await run_concurrently(llm, specs[start : start + 7])
    return results


async def test_64_then_256_seeded_requests_complete_and_reproduce_at_any_concurrency(
    tiny_model_dir: Path,
) -> None:
    with anyio.fail_after(HANG_GUARD):
        async with open_llm(tiny_model_dir, log_level="WARNING") as llm:
            specs_64 = [seeded_spec(i, prefix="a") for i in range(64)]
            first = await run_concurrently(llm, specs_64)
            for spec in specs_64:
                assert_complete(spec, first[spec.request_id])
            reference = {i: first[spec.request_id] for i, spec in enumerate(specs_64)}

            # Request i is the same request in every run below: same prompt,
            # same parameters, same seed; only its id and its neighbours change.
            runs: dict[str, list[Spec]] = {
                "256 concurrent": [seeded_spec(i, prefix="b") for i in range(256)],
                "one by one": [seeded_spec(i, prefix="c") for i in range(64)],
                "7 at a time amid noise": [seeded_spec(i, prefix="d") for i in range(64)],
            }
            for how, specs in runs.items():
                if how == "256 concurrent":
                    results = await run_concurrently(llm, specs)
                elif how == "one by one":
                    results = {s.request_id: await run_one(llm, s) for s in specs}
                else:
                    results = await _in_batches_of_7_with_noise(llm, specs)
                for i, spec in enumerate(specs):
                    output = results[spec.request_id]
                    assert_complete(spec, output)
                    if i in reference:
                        assert_same(reference[i], output, f"{how}: request {i}")

            # The seeds are what make sampled requests agree: another seed
            # gives another output (it is not greedy decoding in disguise).
            sampled = [s for s in specs_64 if s.params.temperature and s.params.top_k != 1]
            reseeded = await run_concurrently(
                llm,
                [
                    Spec(f"e-{s.request_id}", s.prompt, replace(s.params, seed=s.params.seed + 1))
                    for s in sampled
                    if s.params.seed is not None
                ],
            )
            changed = [
                s
                for s in sampled
                if reseeded[f"e-{s.request_id}"].token_ids != first[s.request_id].token_ids
            ]
            assert len(changed) >= len(sampled) * 3 // 4

            stats = await wait_until_idle(llm)
            assert stats.live_requests == 0
            assert stats.engine_alive
