"""A request whose sampling raises fails alone (issue 7, test 2).

The hook: ``TSERVE_TEST_FAULT_SAMPLER``, a regular expression read from the
environment when the engine's sampler is built (at engine start; the engine
process inherits the API process's environment). Sampling a request whose id
it matches raises. Nothing else can turn it on: it is not an engine option,
not a request field, and the web layer never touches the environment.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from tests.faults.workload import (
    Output,
    Spec,
    assert_complete,
    assert_same,
    run_concurrently,
    run_one,
    seeded_spec,
    wait_until_idle,
)
from tests.guards import HANG_GUARD
from tserve.gpu.sampling._sampler import FAULT_ENV
from tserve.nursery import LLM, RequestFailed, open_llm

POISON = r"^poison-"


def _mix() -> list[Spec]:
    """64 seeded requests; every 8th (from index 3) is named ``poison-<i>``."""
    specs = []
    for i in range(64):
        spec = seeded_spec(i)
        if i % 8 == 3:
            spec = Spec(f"poison-{i}", spec.prompt, spec.params)
        specs.append(spec)
    return specs


def _poisoned(spec: Spec) -> bool:
    return spec.request_id.startswith("poison-")


@pytest.fixture(scope="module")
def clean_run(tiny_model_dir: Path) -> Iterator[dict[str, Output]]:
    """The mix on an engine started WITHOUT the hook: every request's output."""

    async def run() -> dict[str, Output]:
        with anyio.fail_after(HANG_GUARD):
            async with open_llm(tiny_model_dir, log_level="WARNING") as llm:
                return await run_concurrently(llm, _mix())

    with pytest.MonkeyPatch.context() as env:
        env.delenv(FAULT_ENV, raising=False)
        yield anyio.run(run, backend="trio")


def test_the_hook_is_off_by_default(clean_run: dict[str, Output]) -> None:
    """Without the variable, ids that look like poison are served normally."""
    specs = _mix()
    assert sum(_poisoned(s) for s in specs) == 8
    for spec in specs:
        assert_complete(spec, clean_run[spec.request_id])


def test_only_an_environment_variable_at_engine_start_reaches_the_hook() -> None:
    """Only the sampler names the hook and only the engine package names any
    test hook, so no request field, engine option, CLI flag or HTTP route can
    turn one on."""
    root = Path(__file__).resolve().parents[2] / "tserve"
    sources = {str(p.relative_to(root)): p.read_text() for p in root.rglob("*.py")}
    names_the_hook = re.compile(rf"{FAULT_ENV}|\bFAULT_ENV\b")
    assert sorted(p for p, text in sources.items() if names_the_hook.search(text)) == [
        "gpu/sampling/_sampler.py"
    ]
    assert not [p for p, text in sources.items() if "TSERVE_TEST_" in text and p[:4] != "gpu/"]


async def _failure_of(llm: LLM, spec: Spec) -> str:
    """Run a poisoned spec, streaming; return the error it ended with."""
    tokens: list[int] = []
    with pytest.raises(RequestFailed) as failed:
        async with llm.generate(spec.prompt, spec.params, request_id=spec.request_id) as stream:
            async for delta in stream:
                tokens += delta.token_ids
    assert tokens == []  # it fails at its first sampled token
    return str(failed.value)


@pytest.mark.anyio
async def test_injected_sampler_faults_fail_alone_and_free_their_kv(
    tiny_model_dir: Path, clean_run: dict[str, Output], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAULT_ENV, POISON)
    specs = _mix()
    with anyio.fail_after(HANG_GUARD):
        async with open_llm(tiny_model_dir, log_level="ERROR") as llm:
            outputs: dict[str, Output] = {}
            errors: dict[str, str] = {}

            async def one(spec: Spec) -> None:
                if _poisoned(spec):
                    errors[spec.request_id] = await _failure_of(llm, spec)
                else:
                    outputs[spec.request_id] = await run_one(llm, spec)

            # All 64 at once: the poisoned requests share every batch with the others.
            async with anyio.create_task_group() as tg:
                for spec in specs:
                    tg.start_soon(one, spec)

            for spec in specs:
                if _poisoned(spec):
                    message = errors[spec.request_id]
                    assert "injected sampler fault" in message
                    assert spec.request_id in message
                else:
                    clean = clean_run[spec.request_id]
                    assert_same(clean, outputs[spec.request_id], spec.request_id)

            stats = await wait_until_idle(llm)
            assert stats.live_requests == 0
            assert stats.engine.kv_tokens_total > 0
            assert llm.engine_alive

            # The engine still serves, poisoned ids still fail, and it is
            # still idle afterwards.
            after = seeded_spec(5, prefix="after")
            assert_same(clean_run[seeded_spec(5).request_id], await run_one(llm, after), "after")
            assert "injected" in await _failure_of(llm, Spec("poison-again", [5, 6], after.params))
            await wait_until_idle(llm)
            assert llm.engine_alive
            assert os.environ[FAULT_ENV] == POISON
