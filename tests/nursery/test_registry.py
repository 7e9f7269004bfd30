"""The model registry with real engine processes on two tiny models: one load
for any number of first requests, cancelled loads that leave nothing, failed
loads that name the model and may be retried, one engine's death that touches
no other model."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

import tserve
from tests.guards import HANG_GUARD
from tests.nursery.conftest import ENGINE, eventually
from tests.nursery.registries import engine_registry
from tests.processes import child_pids, process_gone
from tserve import SamplingParams
from tserve.engine_config import EngineConfig
from tserve.nursery import EngineDeadError
from tserve.nursery._model_state import ModelState
from tserve.nursery._registry import (
    ModelLoadFailed,
    ModelNotServed,
    ModelSpec,
)

pytestmark = pytest.mark.anyio

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
_OPTIONS = {k: v for k, v in ENGINE.items() if k != "log_level"}


@pytest.fixture(scope="module")
def second_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second tiny model: other weights (another seed), same layout."""
    from tserve.gpu.models._directory import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-seed-1"), seed=1)


def _spec(name: str, model: Path | str) -> ModelSpec:
    return ModelSpec(name, EngineConfig(model=os.fspath(model), **_OPTIONS))


async def test_a_hundred_first_requests_cause_one_load(
    tiny_model_dir: Path, second_model_dir: Path
) -> None:
    """100 concurrent first requests for each of two models: one load each,
    100 answers each; the two models are two engines with their own weights."""
    answers: dict[str, list[tuple[int, ...]]] = {"a": [], "b": []}
    with anyio.fail_after(HANG_GUARD):
        async with engine_registry(
            [_spec("a", tiny_model_dir), _spec("b", second_model_dir)]
        ) as reg:
            assert reg.state("a") is ModelState.UNLOADED

            async def ask(name: str) -> None:
                llm = await reg.acquire(name)
                answers[name].append(tuple((await llm.complete("hello", PARAMS)).token_ids))

            async with anyio.create_task_group() as tg:
                for _ in range(100):
                    tg.start_soon(ask, "a")
                    tg.start_soon(ask, "b")
            for name in ("a", "b"):
                life = reg.lifecycle(name)
                assert (life.state, life.attempts, life.loads) == (ModelState.LOADED, 1, 1)
                assert len(answers[name]) == 100 and len(set(answers[name])) == 1
            a, b = reg.loaded("a"), reg.loaded("b")
            assert a is not None and b is not None and a.engine_pid != b.engine_pid
            assert answers["a"][0] != answers["b"][0]  # other weights, other greedy text
            pids = {a.engine_pid, b.engine_pid}
        assert all(process_gone(pid) for pid in pids)


async def test_a_load_cancelled_by_its_last_waiter_leaves_nothing(tiny_model_dir: Path) -> None:
    """Every request waiting for a load is cancelled while the engine starts:
    the load is cancelled, its process stopped, the model UNLOADED, and the
    next request loads it afresh."""
    with anyio.fail_after(HANG_GUARD):
        async with engine_registry([_spec("a", tiny_model_dir)]) as reg:
            before = child_pids()
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(reg.acquire, "a")
                await eventually(lambda: len(child_pids() - before) == 1, "the engine starts")
                assert reg.state("a") is ModelState.LOADING
                engine = (child_pids() - before).pop()
                tg.cancel_scope.cancel()
            await eventually(lambda: reg.state("a") is ModelState.UNLOADED, "the load ends")
            assert process_gone(engine) and child_pids() == before
            assert reg.lifecycle("a").loads == 0 and reg.loaded("a") is None
            llm = await reg.acquire("a")
            assert (await llm.complete("hi", PARAMS)).finish_reason == "length"
            assert reg.lifecycle("a").attempts == 2


async def test_leaving_the_registry_during_a_load_leaves_no_engine(tiny_model_dir: Path) -> None:
    """The block is left while a preload-like (pinned) load starts its engine:
    the load is cancelled and the process stopped before the block is left."""
    before = child_pids()
    with anyio.fail_after(HANG_GUARD):
        async with (
            anyio.create_task_group() as tg,
            engine_registry([_spec("a", tiny_model_dir)]) as reg,
        ):

            async def pinned() -> None:
                with pytest.raises(tserve.ShuttingDown):
                    await reg.acquire("a", pin=True)

            tg.start_soon(pinned)
            await eventually(lambda: len(child_pids() - before) == 1, "the engine starts")
            engine = (child_pids() - before).pop()
    assert process_gone(engine) and child_pids() == before
    assert reg.state("a") is ModelState.UNLOADED


async def test_a_failed_load_names_the_model_and_the_next_request_retries(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A bad file fails every request waiting for its one load with an error
    naming the model; another model is untouched; once the file is good, the
    next request loads it."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a GGUF file")
    with anyio.fail_after(HANG_GUARD):
        async with engine_registry([_spec("bad", bad), _spec("good", tiny_model_dir)]) as reg:
            errors: list[ModelLoadFailed] = []

            async def ask() -> None:
                with pytest.raises(ModelLoadFailed) as failed:
                    await reg.acquire("bad")
                errors.append(failed.value)

            async with anyio.create_task_group() as tg:
                for _ in range(5):
                    tg.start_soon(ask)
            assert len(errors) == 5 and {e.model for e in errors} == {"bad"}
            assert "'bad'" in str(errors[0]) and errors[0].reason
            life = reg.lifecycle("bad")
            assert (life.state, life.attempts, life.reason) == (
                ModelState.FAILED,
                1,
                errors[0].reason,
            )
            good = await reg.acquire("good")
            assert (await good.complete("hi", PARAMS)).finish_reason == "length"
            bad.unlink()
            bad.symlink_to(tiny_model_dir)
            fixed = await reg.acquire("bad")
            assert (await fixed.complete("hi", PARAMS)).finish_reason == "length"
            assert (life.state, life.attempts, life.loads) == (ModelState.LOADED, 2, 1)


async def test_an_unknown_model_lists_the_served_names(tiny_model_dir: Path) -> None:
    async with engine_registry([_spec("a", tiny_model_dir), _spec("b", tiny_model_dir)]) as reg:
        with pytest.raises(ModelNotServed) as unknown:
            await reg.acquire("c")
        assert unknown.value.names == ("a", "b") and "'c'" in str(unknown.value)
        assert "a, b" in str(unknown.value) and reg.state("a") is ModelState.UNLOADED


async def test_one_engine_dying_fails_only_its_model(
    tiny_model_dir: Path, second_model_dir: Path
) -> None:
    """kill -9 of one model's engine mid-stream: its request fails, the model
    is FAILED then UNLOADED, the other model serves on, and the next request
    for the dead one loads it again. The echo engine at 10 steps a second is
    mid-stream at the kill."""
    echo = EngineConfig(
        model=os.fspath(tiny_model_dir), engine_kind="echo", echo_step_time=0.1, **_OPTIONS
    )
    slow = SamplingParams(max_tokens=400, ignore_eos=True)
    with anyio.fail_after(HANG_GUARD):
        async with engine_registry([ModelSpec("a", echo), _spec("b", second_model_dir)]) as reg:
            a, b = await reg.acquire("a"), await reg.acquire("b")
            async with a.generate("hi", slow) as stream:
                await stream.__anext__()
                a.kill_engine()
                with pytest.raises(EngineDeadError, match="killed"):
                    async for _ in stream:
                        pass
            await eventually(lambda: reg.state("a") is ModelState.UNLOADED, "a is reaped")
            life = reg.lifecycle("a")
            assert (life.loads, life.unloads) == (1, 1)
            assert (await b.complete("hi", PARAMS)).finish_reason == "length"
            again = await reg.acquire("a")
            assert again is not a and again.engine_alive
            assert reg.lifecycle("a").loads == 2


async def test_unload_stops_the_engine_and_the_next_request_reloads(tiny_model_dir: Path) -> None:
    with anyio.fail_after(HANG_GUARD):
        async with engine_registry([_spec("a", tiny_model_dir)]) as reg:
            pid = (await reg.acquire("a")).engine_pid
            await reg.unload("a")
            assert reg.state("a") is ModelState.UNLOADED and process_gone(pid)
            assert (await (await reg.acquire("a")).complete("x", PARAMS)).token_ids


async def test_a_model_in_flight_is_not_unloaded_under_its_request(tiny_model_dir: Path) -> None:
    """unload() while a request holds the model (the echo engine at 10 steps a
    second needs 40 s for it): the request keeps streaming from a live engine;
    once it is closed, the unload goes through and the process is gone."""
    echo = EngineConfig(
        model=os.fspath(tiny_model_dir), engine_kind="echo", echo_step_time=0.1, **_OPTIONS
    )
    slow = SamplingParams(max_tokens=400, ignore_eos=True)
    unloaded = anyio.Event()
    with anyio.fail_after(HANG_GUARD):
        async with engine_registry([ModelSpec("a", echo)]) as reg, anyio.create_task_group() as tg:
            async with reg.use("a") as llm, llm.generate("hi", slow) as stream:
                await stream.__anext__()
                assert reg.in_flight("a") == 1

                async def unload() -> None:
                    await reg.unload("a")
                    unloaded.set()

                tg.start_soon(unload)
                for _ in range(3):  # each delta is a step of a live engine
                    await stream.__anext__()
                assert reg.state("a") is ModelState.LOADED and not unloaded.is_set()
            await unloaded.wait()
            assert reg.state("a") is ModelState.UNLOADED and process_gone(llm.engine_pid)
            assert reg.in_flight("a") == 0


async def test_open_models_loads_each_model_on_first_use(
    tiny_model_dir: Path, second_model_dir: Path
) -> None:
    """The embeddable API for several models, on asyncio and trio: a preloaded
    model is loaded on entry, the other on its first use; an unknown name
    lists the served ones; leaving the block stops both engines."""
    models = {"a": tiny_model_dir, "b": second_model_dir}
    with anyio.fail_after(HANG_GUARD):
        async with tserve.open_models(models, preload=["b"], **ENGINE) as reg:
            assert (reg.state("a"), reg.state("b")) == (ModelState.UNLOADED, ModelState.LOADED)
            async with reg.use("a") as a, reg.use("b") as b:
                assert reg.state("a") is ModelState.LOADED
                texts = [(await llm.complete("hello", PARAMS)).text for llm in (a, b)]
                # A model loaded beside others leaves llguidance's tokenizer (its
                # build holds the API process's GIL) to its first constrained request.
                assert (a.constraints.prepared, b.constraints.prepared) == (None, None)
                choice = SamplingParams(max_tokens=8, constraint=tserve.Choice(("yes", "no")))
                assert (await a.complete("Is it?", choice)).text in {"yes", "no"}
            assert texts[0] != texts[1]
            with pytest.raises(tserve.ModelNotServed, match="a, b"):
                async with reg.use("c"):
                    pass
            pids = (a.engine_pid, b.engine_pid)
        assert all(process_gone(pid) for pid in pids)
