"""The serving GC settings are applied for the block and restored after it."""

from __future__ import annotations

import gc

from tserve._gc import GEN0_THRESHOLD, serving_gc


def test_serving_gc_freezes_and_restores() -> None:
    before = gc.get_threshold()
    frozen_before = gc.get_freeze_count()
    keep = [object() for _ in range(10)]  # alive when the block starts: frozen
    with serving_gc():
        assert gc.get_threshold()[0] == max(GEN0_THRESHOLD, before[0])
        assert gc.get_threshold()[1:] == before[1:]
        assert gc.get_freeze_count() > frozen_before
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
    del keep


def test_cycles_made_while_serving_are_still_collected() -> None:
    class Node:
        other: object

    with serving_gc():
        a, b = Node(), Node()
        a.other, b.other = b, a
        del a, b
        assert gc.collect() >= 2
