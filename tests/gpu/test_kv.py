"""The paged block allocator: sizing, the paired verbs, free, and its invariants."""

from __future__ import annotations

import random

import pytest

from tserve.gpu._kv import BlockManager
from tserve.gpu._sequence import Sequence
from tserve.protocol import SamplingParams


def make(request_id: str, num_prompt: int = 1) -> Sequence:
    return Sequence(request_id, [1] * num_prompt, SamplingParams())


def slots(bm: BlockManager, seq: Sequence, num_positions: int) -> list[int]:
    """The KV slots the model runner would use for positions 0 .. num_positions - 1."""
    bs = bm.block_size
    return [seq.block_table[p // bs] * bs + p % bs for p in range(num_positions)]


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 16), (4, 0), (-1, 1)])
def test_rejects_bad_sizes(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


def test_allocate_covers_positions_and_counts() -> None:
    bm = BlockManager(8, block_size=4)
    seq = make("a", 10)
    assert (bm.tokens_total, bm.tokens_used, bm.num_free_blocks) == (32, 0, 8)
    assert bm.num_new_blocks(seq, 10) == 3
    bm.allocate(seq, 10)
    assert len(seq.block_table) == 3
    assert (bm.tokens_used, bm.num_free_blocks, bm.num_used_blocks) == (12, 5, 3)
    seq.num_computed_tokens = 10
    assert bm.num_new_blocks(seq, 2) == 0  # the third block still has two free slots
    bm.allocate(seq, 2)
    assert len(seq.block_table) == 3
    assert bm.num_new_blocks(seq, 3) == 1
    bm.check([seq])


def test_blocks_for() -> None:
    bm = BlockManager(8, block_size=16)
    assert [bm.blocks_for(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_can_allocate_and_allocatable_tokens_agree() -> None:
    bm = BlockManager(4, block_size=4)
    a, b = make("a"), make("b")
    bm.allocate(a, 6)  # 2 blocks, 2 spare slots in the second
    a.num_computed_tokens = 6
    assert bm.num_allocatable_tokens(a) == 2 + 2 * 4
    assert bm.num_allocatable_tokens(b) == 2 * 4
    for seq in (a, b):
        n = bm.num_allocatable_tokens(seq)
        assert bm.can_allocate(seq, n)
        assert not bm.can_allocate(seq, n + 1)


def test_free_returns_every_block_and_is_idempotent() -> None:
    bm = BlockManager(4, block_size=2)
    a, b = make("a"), make("b")
    bm.allocate(a, 3)
    bm.allocate(b, 4)
    assert bm.num_free_blocks == 0
    bm.free(a)
    assert (a.block_table, bm.num_free_blocks) == ([], 2)
    bm.free(a)
    assert bm.num_free_blocks == 2
    bm.check([a, b])
    bm.free(b)
    assert (bm.num_free_blocks, bm.tokens_used) == (4, 0)
    bm.check([])


def test_random_allocations_never_share_a_block_or_a_slot() -> None:
    rng = random.Random(7)
    bm = BlockManager(32, block_size=4)
    live: list[Sequence] = []
    for i in range(2000):
        if live and rng.random() < 0.3:
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            seq = live[rng.randrange(len(live))] if live and rng.random() < 0.7 else make(f"s{i}")
            n = rng.randint(1, 9)
            if bm.can_allocate(seq, n):
                bm.allocate(seq, n)
                seq.num_computed_tokens += n
                if seq not in live:
                    live.append(seq)
        bm.check(live)
        used = [s for seq in live for s in slots(bm, seq, seq.num_computed_tokens)]
        assert len(used) == len(set(used))
        assert all(0 <= s < bm.tokens_total for s in used)
        assert bm.num_free_blocks + sum(len(s.block_table) for s in live) == bm.num_blocks


def test_check_catches_a_table_the_allocator_does_not_know() -> None:
    bm = BlockManager(4, block_size=2)
    a, b = make("a"), make("b")
    bm.allocate(a, 2)
    b.block_table.append(a.block_table[0])
    with pytest.raises(AssertionError):
        bm.check([a, b])
