"""The residency rules without processes: Ollama's keep_alive forms, expiry,
which idle models the memory budget unloads for a load; memory as /proc
reports it."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tserve.nursery import parse_keep_alive
from tserve.nursery._memory import (
    DEFAULT_BUDGET_FRACTION,
    default_memory_budget,
    machine_memory,
    resident_bytes,
    weight_bytes,
)
from tserve.nursery._residency import Occupant, expiry, plan_room


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (300, 300.0),
        (2.5, 2.5),
        (0, 0.0),
        ("0", 0.0),
        ("300", 300.0),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("30s", 30.0),
        ("1h30m", 5400.0),
        ("1.5s", 1.5),
        (".5h", 1800.0),
        ("250ms", 0.25),
        (" 2m ", 120.0),
        ("+10s", 10.0),
        (-1, -1.0),
        ("-1", -1.0),
        ("-5m", -1.0),
        (-0.5, -1.0),
    ],
)
def test_keep_alive_forms(value: object, seconds: float) -> None:
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize(
    "value",
    [True, None, "", "5 min", "m", "5x", "1m1", "--1", math.nan, math.inf, "inf", [5], "1e3"],
)
def test_bad_keep_alive_names_the_forms(value: object) -> None:
    with pytest.raises(ValueError, match="keep_alive must be a duration") as bad:
        parse_keep_alive(value)
    assert repr(value) in str(bad.value)


def test_expiry() -> None:
    assert expiry(10.0, 5.0) == 15.0
    assert expiry(10.0, 0.0) == 10.0
    assert expiry(10.0, -1.0) is None


def _occ(name: str, size: int, last_used: float, *, idle: bool = True) -> Occupant:
    return Occupant(name, size, idle, last_used)


def test_a_load_that_fits_unloads_nothing() -> None:
    assert plan_room(30, 100, [_occ("a", 30, 1), _occ("b", 40, 2)]) == ()


def test_room_is_made_least_recently_used_first_and_no_more() -> None:
    others = [_occ("a", 30, 3), _occ("b", 30, 1), _occ("c", 30, 2)]
    assert plan_room(30, 70, others) == ["b", "c"]
    assert plan_room(10, 70, others) == ["b"]


def test_a_busy_model_is_never_chosen_and_nothing_is_unloaded_in_vain() -> None:
    others = [_occ("a", 50, 1, idle=False), _occ("b", 30, 2)]
    assert plan_room(40, 100, others) == ["b"]
    assert plan_room(60, 100, others) is None  # unloading b alone would not make it fit


def test_a_model_larger_than_the_budget_loads_alone() -> None:
    assert plan_room(500, 100, []) == ()
    assert plan_room(500, 100, [_occ("a", 0, 1)]) == ()  # nothing resident
    assert plan_room(500, 100, [_occ("a", 30, 2), _occ("b", 30, 1)]) == ["b", "a"]
    assert plan_room(500, 100, [_occ("a", 30, 2, idle=False)]) is None


@given(
    st.integers(0, 200),
    st.integers(1, 200),
    st.lists(st.tuples(st.integers(0, 100), st.booleans(), st.floats(0, 100)), max_size=6),
)
def test_a_plan_keeps_the_rules(
    need: int, budget: int, models: list[tuple[int, bool, float]]
) -> None:
    """Whatever the models: only idle ones, oldest first, as few as make room;
    after the plan the load fits or nothing else is resident; None only when
    even every idle one would not do."""
    others = [Occupant(f"m{i}", size, idle, used) for i, (size, idle, used) in enumerate(models)]
    plan = plan_room(need, budget, others)
    by_name = {o.name: o for o in others}
    candidates = sorted(
        (o for o in others if o.evictable and o.resident_bytes > 0), key=lambda o: o.last_used
    )
    if plan is None:
        left = [o for o in others if not o.evictable and o.resident_bytes > 0]
        assert left and sum(o.resident_bytes for o in left) + need > budget
        return
    assert [by_name[n] for n in plan] == candidates[: len(plan)]
    left = [o for o in others if o.name not in plan and o.resident_bytes > 0]
    assert not left or sum(o.resident_bytes for o in left) + need <= budget
    if plan:  # one fewer would not have done
        fewer = [*left, by_name[plan[-1]]]
        assert sum(o.resident_bytes for o in fewer) + need > budget


def test_memory_as_the_host_reports_it(tmp_path: Path) -> None:
    """RSS from statm (this process's, and 0 for a pid that is gone), the
    default budget as 75% of MemTotal, weights as a file's or a directory's
    bytes (0 for a name that is no path)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    assert abs(resident_bytes(os.getpid()) - pages * os.sysconf("SC_PAGE_SIZE")) < 64 << 20
    assert resident_bytes(2**22 + 1) == 0  # past pid_max: no such process
    with open("/proc/meminfo") as f:
        total_kib = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    assert machine_memory() == total_kib * 1024
    assert default_memory_budget() == int(total_kib * 1024 * DEFAULT_BUDGET_FRACTION)
    (tmp_path / "model.gguf").write_bytes(b"x" * 1000)
    (tmp_path / "config.json").write_bytes(b"{}")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "ignored.bin").write_bytes(b"y" * 500)
    assert weight_bytes(os.fspath(tmp_path / "model.gguf")) == 1000
    assert weight_bytes(os.fspath(tmp_path)) == 1002
    assert weight_bytes(os.fspath(tmp_path / "missing")) == 0
