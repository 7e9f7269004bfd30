"""A model's load states, without processes: the legal moves, and only those."""

from __future__ import annotations

import pytest

from tserve.nursery._model_state import IllegalModelTransition, ModelLifecycle, ModelState


def _state(life: ModelLifecycle) -> ModelState:
    """The state now (a call, so that a type checker does not narrow it across moves)."""
    return life.state


def test_load_serve_unload() -> None:
    life = ModelLifecycle("m")
    life.load()
    assert _state(life) is ModelState.LOADING and life.attempts == 1
    life.loaded()
    life.unload()
    assert _state(life) is ModelState.UNLOADING
    life.unloaded()
    assert _state(life) is ModelState.UNLOADED
    assert (life.attempts, life.loads, life.unloads) == (1, 1, 1)


def test_a_failed_load_keeps_its_reason_until_the_retry() -> None:
    life = ModelLifecycle("m")
    life.load()
    life.fail("no such file")
    assert _state(life) is ModelState.FAILED and life.reason == "no such file"
    assert life.unloads == 0
    life.load()
    assert _state(life) is ModelState.LOADING and life.reason is None and life.attempts == 2


def test_a_dead_engine_is_failed_then_unloaded() -> None:
    life = ModelLifecycle("m")
    life.load()
    life.loaded()
    life.fail("killed by SIGKILL")
    assert _state(life) is ModelState.FAILED and life.unloads == 1
    life.unloaded()
    assert _state(life) is ModelState.UNLOADED


def test_a_cancelled_load_is_unloaded() -> None:
    life = ModelLifecycle("m")
    life.load()
    life.cancel()
    assert _state(life) is ModelState.UNLOADED and life.loads == 0


@pytest.mark.parametrize(
    ("steps", "illegal"),
    [
        ([], "loaded"),
        ([], "unload"),
        (["load"], "load"),  # one load at a time
        (["load"], "unload"),
        (["load", "loaded"], "load"),
        (["load", "loaded"], "cancel"),
        (["load", "loaded", "unload"], "load"),
        (["load", "loaded", "unload"], "fail"),
        ([], "unloaded"),
    ],
)
def test_illegal_moves_raise(steps: list[str], illegal: str) -> None:
    life = ModelLifecycle("m")
    for step in steps:
        getattr(life, step)()
    before = life.state
    with pytest.raises(IllegalModelTransition, match="'m'"):
        getattr(life, illegal)(*(["why"] if illegal == "fail" else []))
    assert life.state is before
