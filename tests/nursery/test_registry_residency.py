"""Which models stay loaded, with real engine processes: keep-alive 0, a
duration and -1; the memory budget's least-recently-used unloading; a busy
model never unloaded, a load that waits for room and then gives up with
ModelsBusy; memory returned after an unload.

The keep-alive and busy tests run echo engines (a real engine process that
serves the tiny model's tokenizer and needs no torch, so it starts fast);
the budget and memory tests run the tiny model itself."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

import tserve
from tests.guards import HANG_GUARD
from tests.nursery.conftest import ENGINE, eventually
from tests.nursery.registries import engine_registry
from tests.processes import child_pids, process_gone
from tserve import SamplingParams
from tserve.engine_config import EngineConfig
from tserve.nursery import ModelsBusy
from tserve.nursery._memory import resident_bytes
from tserve.nursery._model_state import ModelState
from tserve.nursery._registry import ModelRegistry, ModelSpec

pytestmark = pytest.mark.anyio

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
SLOW_STEP = 1.0  # seconds per step of the echo engines that hold a model busy
ENDLESS = SamplingParams(max_tokens=500, ignore_eos=True)  # 500 s at SLOW_STEP: past HANG_GUARD
_OPTIONS = {k: v for k, v in ENGINE.items() if k != "log_level"}
LOADED, UNLOADED = ModelState.LOADED, ModelState.UNLOADED


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "trio"


@pytest.fixture(scope="module")
def more_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two more tiny models: other weights (other seeds), the same layout."""
    from tserve.gpu.models._directory import build_tiny_model

    return [build_tiny_model(tmp_path_factory.mktemp(f"tiny-seed-{s}"), seed=s) for s in (1, 2)]


def _spec(name: str, model: Path, **options: Any) -> ModelSpec:
    return ModelSpec(name, EngineConfig(model=os.fspath(model), **_OPTIONS, **options))


def _echo(name: str, model: Path, step: float = 0.1) -> ModelSpec:
    return _spec(name, model, engine_kind="echo", echo_step_time=step)


async def _answer(reg: ModelRegistry, name: str, **use: Any) -> None:
    async with reg.use(name, **use) as llm:
        assert (await llm.complete("hello", PARAMS)).finish_reason == "length"


async def _measured(spec: ModelSpec) -> int:
    """The RSS of ``spec``'s engine after one request, in a registry of its own."""
    async with engine_registry([spec], memory_budget=1 << 50) as reg:
        await _answer(reg, spec.name)
        return reg.figures(spec.name).resident_bytes


async def test_keep_alive_zero_a_duration_and_pinned(tiny_model_dir: Path) -> None:
    """With a default keep-alive of 0, a model is unloaded once its request
    ends; one asked for with a duration stays until it passes; a pinned one
    (-1) outlives both. The latest call's keep-alive wins: a pinned model
    that a later call gives 0 is unloaded when its last block ends, even
    though the pinning call's block was entered first."""
    specs = [_echo(name, tiny_model_dir) for name in ("zero", "short", "pinned")]
    with anyio.fail_after(HANG_GUARD):
        async with engine_registry(specs, keep_alive=0) as reg:
            async with reg.use("zero") as llm:
                assert (await llm.complete("hi", PARAMS)).finish_reason == "length"
                assert reg.state("zero") is LOADED  # not under its request
                zero = llm.engine_pid
            await eventually(lambda: reg.state("zero") is UNLOADED, "zero is unloaded")
            assert process_gone(zero) and reg.figures("zero").unloads == 1

            await _answer(reg, "pinned", keep_alive=-1)
            await _answer(reg, "short", keep_alive=0.5)
            short = reg.figures("short")
            assert short.state is LOADED and short.keep_alive == 0.5
            assert short.expires_at is not None and short.last_used is not None
            assert reg.figures("pinned").expires_at is None
            await eventually(lambda: reg.state("short") is UNLOADED, "short is unloaded")
            assert reg.state("pinned") is LOADED  # used before short, yet pinned

            async with reg.use("pinned", keep_alive=-1), reg.use("pinned", keep_alive=0):
                pass
            await eventually(lambda: reg.state("pinned") is UNLOADED, "pinned is unloaded")
            assert [reg.figures(n).loads for n in reg.names] == [1, 1, 1]


async def test_least_recently_used_models_make_room_within_the_budget(
    tiny_model_dir: Path, more_model_dirs: list[Path]
) -> None:
    """A budget that holds two of three tiny models (from one engine's measured
    RSS), requests alternating across all three: each load unloads the least
    recently used model, every request answers, and the engines' total RSS,
    sampled whenever no load or unload is under way, never exceeds the budget."""
    specs = [_spec(n, d) for n, d in zip("abc", [tiny_model_dir, *more_model_dirs], strict=True)]
    with anyio.fail_after(HANG_GUARD * 2):
        budget = int(2.5 * await _measured(specs[0]))
        peak = 0
        before = child_pids()

        async def sample() -> None:
            """The peak while every model is loaded or unloaded: the budget bounds
            engines once loaded; one that is loading may briefly hold more."""
            nonlocal peak
            while True:
                if all(reg.state(n) in (LOADED, UNLOADED) for n in reg.names):
                    total = sum(resident_bytes(pid) for pid in child_pids() - before)
                    peak = max(peak, total)  # no checkpoint since the states were read
                await anyio.sleep(0.01)

        order = "abcab"
        async with (
            engine_registry(specs, memory_budget=budget) as reg,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(sample)
            for i, name in enumerate(order):
                await _answer(reg, name)
                loaded = {n for n in reg.names if reg.state(n) is LOADED}
                assert loaded == set(order[max(0, i - 1) : i + 1])
                assert sum(reg.figures(n).resident_bytes for n in loaded) <= budget
            tg.cancel_scope.cancel()
        assert 0 < peak <= budget
        figures = [reg.figures(n) for n in "abc"]
        assert [(f.loads, f.unloads) for f in figures] == [(2, 2), (2, 2), (1, 1)]
        assert all(f.load_seconds > 0 for f in figures)
        assert child_pids() == before


async def _hold(
    reg: ModelRegistry,
    name: str,
    seen: dict[str, int],
    release: anyio.Event,
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Hold ``name`` under a stream that cannot end on its own, counting its
    tokens in ``seen``, until ``release``; started once a token arrived."""
    async with reg.use(name) as llm, llm.generate("hi", ENDLESS) as stream:
        await stream.__anext__()
        task_status.started()
        async with anyio.create_task_group() as tg:

            async def read() -> None:
                async for _ in stream:
                    seen[name] += 1

            tg.start_soon(read)
            await release.wait()
            tg.cancel_scope.cancel()


async def test_a_busy_model_is_never_unloaded_and_a_load_gives_up_with_models_busy(
    tiny_model_dir: Path,
) -> None:
    """Two of three models fit, and both are busy under streams that cannot
    end on their own: a load of the third waits for room, unloads neither,
    and fails with ModelsBusy naming them after ``fit_timeout`` (a wait that
    is cancelled leaves nothing). A load that waits while one of them goes
    idle unloads that one and loads."""
    specs = [_echo(name, tiny_model_dir, SLOW_STEP) for name in "abc"]
    seen = {"a": 0, "b": 0}
    release = {"a": anyio.Event(), "b": anyio.Event()}
    with anyio.fail_after(HANG_GUARD):
        budget = int(2.5 * await _measured(specs[0]))
        rules = {"memory_budget": budget, "fit_timeout": 5}
        async with engine_registry(specs, **rules) as reg, anyio.create_task_group() as tg:
            for name in "ab":
                await tg.start(_hold, reg, name, seen, release[name])
            async with anyio.create_task_group() as waiting:  # cancelled: nothing left
                waiting.start_soon(reg.acquire, "c")
                await eventually(lambda: reg.waiting_for_room == 1, "c waits for room")
                waiting.cancel_scope.cancel()
            assert reg.waiting_for_room == 0 and reg.state("c") is UNLOADED
            with pytest.raises(ModelsBusy) as busy:
                await reg.acquire("c")
            assert (busy.value.model, busy.value.busy, busy.value.retry_after) == (
                "c",
                ("a", "b"),
                5,
            )
            assert "'c'" in str(busy.value) and isinstance(busy.value, tserve.Overloaded)
            assert [reg.state(n) for n in "abc"] == [LOADED, LOADED, UNLOADED]
            mark = dict(seen)
            await eventually(lambda: seen["a"] > mark["a"] and seen["b"] > mark["b"], "steps")

            a = reg.loaded("a")
            assert a is not None
            answered = anyio.Event()

            async def ask_c() -> None:
                await _answer(reg, "c")
                answered.set()

            tg.start_soon(ask_c)
            await eventually(lambda: reg.waiting_for_room == 1, "c waits for room")
            release["a"].set()
            await answered.wait()
            assert [reg.state(n) for n in "abc"] == [UNLOADED, LOADED, LOADED]
            assert process_gone(a.engine_pid) and reg.in_flight("b") == 1
            release["b"].set()


async def test_callers_of_one_unloaded_model_share_its_placement(tiny_model_dir: Path) -> None:
    """However many callers ask for an unloaded model, one of them waits for
    room and the others wait for that one, not in line behind other models'
    loads: a load queued between them cannot unload the model between its
    first caller's hold and the next one's (the thrash of a budget that fits
    one model, under requests for several)."""
    specs = [_echo(name, tiny_model_dir) for name in "abc"]
    entered = {name: anyio.Event() for name in ("a", "b1", "c", "b2")}
    leave = {name: anyio.Event() for name in ("a", "b1", "c", "b2")}
    b_loads: dict[str, int] = {}

    async def hold(who: str) -> None:
        async with reg.use(who[0]):
            b_loads[who] = reg.figures(who[0]).loads
            entered[who].set()
            await leave[who].wait()

    with anyio.fail_after(HANG_GUARD):
        rules = {"memory_budget": 1, "fit_timeout": HANG_GUARD}  # each model loads alone
        async with engine_registry(specs, **rules) as reg, anyio.create_task_group() as tg:
            tg.start_soon(hold, "a")
            await entered["a"].wait()
            tg.start_soon(hold, "b1")  # waits for room: a is busy
            await eventually(lambda: reg.waiting_for_room == 1, "b1 waits for room")
            tg.start_soon(hold, "c")  # in line behind b1
            await eventually(lambda: reg.waiting_for_room == 2, "c waits in line")
            tg.start_soon(hold, "b2")  # waits for b1's placement, not in line
            await anyio.wait_all_tasks_blocked()
            assert reg.waiting_for_room == 2
            leave["a"].set()  # b1 unloads a and loads b
            await entered["b1"].wait()
            leave["b1"].set()  # b2 still holds b: c waits
            await entered["b2"].wait()
            assert b_loads == {"a": 1, "b1": 1, "b2": 1}  # one load of b served both
            assert [reg.state(n) for n in "abc"] == [UNLOADED, LOADED, UNLOADED]
            leave["b2"].set()
            await entered["c"].wait()
            assert [reg.state(n) for n in "abc"] == [UNLOADED, UNLOADED, LOADED]
            leave["c"].set()


def _pages() -> int:
    """This process's resident pages (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1])


async def test_an_unload_returns_the_memory_and_leaves_no_process(tiny_model_dir: Path) -> None:
    """A load, a request and an unload: the engine process is gone, this
    process has no more children than before, and its resident pages are
    back within 5% of their level before the load (a first cycle warms up
    what any load leaves for good: imported modules, caches)."""
    before = child_pids()
    with anyio.fail_after(HANG_GUARD):
        async with engine_registry([_spec("a", tiny_model_dir)]) as reg:
            await _answer(reg, "a")
            await reg.unload("a")
            gc.collect()
            pages = _pages()
            async with reg.use("a") as llm:
                assert (await llm.complete("hello", PARAMS)).finish_reason == "length"
                pid = llm.engine_pid
                measured = reg.figures("a").resident_bytes  # the engine's, as read a moment apart
                assert measured > 0 and abs(measured - resident_bytes(pid)) <= 0.05 * measured
                assert child_pids() - before == {pid}
            await reg.unload("a")
            del llm
            gc.collect()
            assert abs(_pages() - pages) <= 0.05 * pages
            assert process_gone(pid) and child_pids() == before
            assert reg.figures("a").resident_bytes == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_open_models_unloads_by_budget_and_keep_alive_on_asyncio(
    tiny_model_dir: Path,
) -> None:
    """tserve.open_models on asyncio: with a budget smaller than any model,
    each loads alone, the other (idle) unloaded for it; pinned by the
    default keep-alive, a model goes only when a call gives it 0."""
    models = {"a": tiny_model_dir, "b": tiny_model_dir}
    options = {**ENGINE, "engine_kind": "echo", "echo_step_time": 0.1}
    with anyio.fail_after(HANG_GUARD):
        async with tserve.open_models(models, keep_alive=-1, memory_budget=1, **options) as reg:
            await _answer(reg, "a")
            await _answer(reg, "b")
            assert (reg.state("a"), reg.state("b")) == (UNLOADED, LOADED)
            assert reg.figures("b").expires_at is None
            await _answer(reg, "b", keep_alive=0)
            await eventually(lambda: reg.state("b") is UNLOADED, "b is unloaded")
            assert [reg.figures(n).loads for n in "ab"] == [1, 1]
