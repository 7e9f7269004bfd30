"""The paged block allocator: sizing, the paired verbs, free, sharing by prefix, and its
invariants."""

from __future__ import annotations

import random
import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tserve.gpu.scheduling._kv import NO_BLOCK, BlockManager, kv_budget_blocks
from tserve.gpu.scheduling._kv_groups import KVGroups
from tserve.gpu.scheduling._sequence import Sequence
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


def test_the_kv_budget_in_tokens_is_blocks_and_in_bytes_scales_with_the_dtype() -> None:
    def blocks(tokens: int, memory: int | None, per_token: int) -> int:
        return kv_budget_blocks(
            kv_cache_tokens=tokens,
            kv_cache_memory_bytes=memory,
            bytes_per_token=per_token,
            block_size=16,
        )

    assert blocks(1000, None, 512) == blocks(1000, None, 256) == 62  # whole blocks
    assert blocks(1000, 512 * 16 * 10 + 511, 512) == 10  # the tokens do not count
    assert blocks(1000, 512 * 16 * 10, 256) == 20  # half the bytes a token: twice the blocks
    with pytest.raises(ValueError, match=r"kv_cache_tokens \(15\) .* 16 tokens"):
        blocks(15, None, 512)
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes \(8191\) .* \(8192 bytes\)"):
        blocks(10**6, 8191, 512)


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


# -- the prefix cache ---------------------------------------------------------------


def computed(bm: BlockManager, seq: Sequence, n: int) -> None:
    """Allocate and compute the next ``n`` tokens of ``seq``, as a step would."""
    bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)


def admit(bm: BlockManager, seq: Sequence) -> int:
    """Share the cached prefix of ``seq``; returns the tokens it skips."""
    prefix = bm.find_prefix(seq)
    bm.share(seq, prefix)
    seq.num_computed_tokens = len(prefix) * bm.block_size
    return seq.num_computed_tokens


def with_prompt(request_id: str, prompt: list[int]) -> Sequence:
    return Sequence(request_id, list(prompt), SamplingParams())


def test_a_repeated_prompt_shares_its_full_blocks_and_computes_the_rest() -> None:
    bm = BlockManager(16, block_size=4)
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens
    a = with_prompt("a", prompt)
    assert admit(bm, a) == 0
    computed(bm, a, 10)
    assert bm.num_cached_blocks == 2  # the partial third block is not cached
    b = with_prompt("b", [*prompt, 99])
    assert admit(bm, b) == 8
    assert b.block_table == a.block_table[:2]
    assert [bm.ref_count(x) for x in a.block_table] == [2, 2, 1]
    computed(bm, b, 3)
    assert b.block_table[2] != a.block_table[2]
    bm.check([a, b])
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10 + 11, 8)


def test_the_last_token_is_always_computed() -> None:
    bm = BlockManager(16, block_size=4)
    a = with_prompt("a", list(range(1, 9)))  # exactly two full blocks
    admit(bm, a)
    computed(bm, a, 8)
    b = with_prompt("b", list(range(1, 9)))
    assert admit(bm, b) == 4  # the second block is recomputed, into a block of its own
    assert bm.num_allocatable_tokens(b) >= 4
    computed(bm, b, 4)
    assert b.block_table[1] != a.block_table[1] and not bm.is_cached(b.block_table[1])
    bm.check([a, b])


def test_a_different_earlier_block_means_no_hit() -> None:
    """The key chains the blocks before it: equal tokens after a different prefix miss."""
    bm = BlockManager(16, block_size=4)
    a = with_prompt("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(bm, a)
    computed(bm, a, 9)
    b = with_prompt("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert admit(bm, b) == 0


def test_freed_blocks_stay_cached_until_evicted_oldest_first() -> None:
    bm = BlockManager(6, block_size=2)
    a = with_prompt("a", [1, 2, 3, 4, 5])
    admit(bm, a)
    computed(bm, a, 5)  # blocks: [1,2] [3,4] cached, [5] private
    bm.free(a)
    assert (bm.num_free_blocks, bm.num_used_blocks, bm.num_cached_blocks) == (6, 0, 2)
    assert bm.tokens_used == 0
    # A new sequence takes plain free blocks first: both cached ones survive.
    c = with_prompt("c", [7, 7, 7, 7, 7, 7, 7])
    admit(bm, c)
    bm.allocate(c, 8)  # 4 blocks: the 4 plain ones
    assert bm.num_cached_blocks == 2
    b = with_prompt("b", [1, 2, 3, 4, 9])
    assert len(bm.find_prefix(b)) == 2
    bm.allocate(c, 10)  # one more: evicts a's LATER block first
    assert len(bm.find_prefix(b)) == 1
    bm.allocate(c, 12)
    assert len(bm.find_prefix(b)) == 0 and bm.num_cached_blocks == 0
    bm.check([c])


def test_sizing_counts_the_shared_blocks_that_are_free() -> None:
    bm = BlockManager(4, block_size=2)
    a = with_prompt("a", [1, 2, 3, 4, 5])
    admit(bm, a)
    computed(bm, a, 5)
    bm.free(a)
    b = with_prompt("b", [1, 2, 3, 4, 6, 6, 6])
    prefix = bm.find_prefix(b)
    assert len(prefix) == 2
    # 4 free blocks, 2 of them are b's prefix: 2 blocks = 4 tokens past it.
    assert bm.num_allocatable_tokens(b, prefix) == 4
    bm.share(b, prefix)
    b.num_computed_tokens = 4
    assert bm.num_allocatable_tokens(b) == 4 and bm.can_allocate(b, 3)


def test_with_caching_off_nothing_is_shared_or_counted() -> None:
    bm = BlockManager(8, block_size=2, enable_prefix_caching=False)
    a, b = with_prompt("a", [1, 2, 3, 4, 5]), with_prompt("b", [1, 2, 3, 4, 5])
    admit(bm, a)
    computed(bm, a, 5)
    assert admit(bm, b) == 0
    assert (bm.num_cached_blocks, bm.prefix_cache_queries, bm.prefix_cache_hits) == (0, 0, 0)
    bm.check([a, b])


class SharedBlocks(RuleBasedStateMachine):
    """Sequences from a few shared stems are admitted, computed, preempted,
    aborted and finished in any order, against a shadow of the pool's slots.

    Every computed position of a live sequence must still hold what that
    sequence wrote there (or what an earlier sequence with the same tokens up
    to there wrote): a block freed or overwritten while referenced fails it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(12, block_size=2)
        self.stems = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5]]
        self.live: list[Sequence] = []  # holding blocks (running)
        self.waiting: list[Sequence] = []  # preempted: computed nothing, hold nothing
        self.slots: dict[int, tuple[int, ...]] = {}  # slot -> the tokens up to its position
        self.n = 0

    def _write(self, seq: Sequence, n: int) -> None:
        bs = self.bm.block_size
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            block = seq.block_table[p // bs]
            assert self.bm.ref_count(block) == 1 and not self.bm.is_cached(block)
            self.slots[block * bs + p % bs] = tuple(seq.token_slice(0, p + 1))

    @rule(stem=st.integers(0, 2), cut=st.integers(1, 8), tail=st.integers(0, 3))
    def add(self, stem: int, cut: int, tail: int) -> None:
        self.n += 1
        prompt = self.stems[stem][:cut] + [100 + self.n] * tail
        self.waiting.append(with_prompt(f"s{self.n}", prompt))

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 99), data=st.data())
    def admit(self, i: int, data: st.DataObject) -> None:
        seq = self.waiting[i % len(self.waiting)]
        prefix = self.bm.find_prefix(seq)
        room = min(
            self.bm.num_allocatable_tokens(seq, prefix),
            seq.num_tokens - len(prefix) * self.bm.block_size,
        )
        if room < 1:
            return
        self.waiting.remove(seq)
        self.bm.share(seq, prefix)
        seq.num_computed_tokens = len(prefix) * self.bm.block_size
        self.live.append(seq)
        self._compute(seq, data.draw(st.integers(1, room)))

    def _compute(self, seq: Sequence, n: int) -> None:
        assert self.bm.can_allocate(seq, n)
        self.bm.allocate(seq, n)
        self._write(seq, n)
        seq.num_computed_tokens += n
        self.bm.cache_full_blocks(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), n=st.integers(1, 5), decode=st.booleans())
    def compute(self, i: int, n: int, decode: bool) -> None:
        seq = self.live[i % len(self.live)]
        if decode and seq.num_uncomputed_tokens == 0:
            seq.output_token_ids.append(200 + len(seq.output_token_ids) % 3)
        n = min(n, seq.num_uncomputed_tokens, self.bm.num_allocatable_tokens(seq))
        if n:
            self._compute(seq, n)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), how=st.sampled_from(["finish", "abort", "preempt"]))
    def release(self, i: int, how: str) -> None:
        seq = self.live.pop(i % len(self.live))
        self.bm.free(seq)
        self.bm.free(seq)  # idempotent
        if how == "preempt":
            seq.num_computed_tokens = 0
            self.waiting.append(seq)

    @invariant()
    def pool_holds_what_each_sequence_computed(self) -> None:
        self.bm.check(self.live)
        bs = self.bm.block_size
        for seq in self.live:
            for p in range(seq.num_computed_tokens):
                slot = seq.block_table[p // bs] * bs + p % bs
                assert self.slots[slot] == tuple(seq.token_slice(0, p + 1)), (seq, p)
        held = {b for s in self.live for b in s.block_table}
        assert self.bm.num_used_blocks == len(held)
        assert self.bm.num_free_blocks == self.bm.num_blocks - len(held)

    def teardown(self) -> None:
        for seq in self.live:
            self.bm.free(seq)
        self.bm.check([])
        assert (self.bm.num_used_blocks, self.bm.num_free_blocks) == (0, self.bm.num_blocks)
        assert self.bm.tokens_used == 0


TestSharedBlocks = SharedBlocks.TestCase
TestSharedBlocks.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)


# -- layer groups with sliding windows -------------------------------------------------


def test_a_windowed_group_frees_the_blocks_behind_its_window_and_a_global_one_keeps_them() -> None:
    bm = BlockManager(32, block_size=4, windows=(6, 0))
    seq = with_prompt("a", list(range(1, 30)))
    computed(bm, seq, 10)  # positions 0..9: the next query reads 5..10
    assert bm.reclaim(seq) == 1  # block 0 (positions 0..3) is behind the window
    local, full = seq.block_tables
    assert local[0] == NO_BLOCK and NO_BLOCK not in local[1:] and NO_BLOCK not in full
    assert bm.num_used_blocks == 2 * 3 - 1
    computed(bm, seq, 14)  # 24 computed: reads 19.., blocks 0..3 gone
    assert bm.reclaim(seq) == 3 and bm.reclaim(seq) == 0
    assert local[:4] == [NO_BLOCK] * 4 and len(local) == len(full) == 6
    assert (bm.num_used_blocks, bm.num_free_blocks) == (6 + 2, 32 - 8)
    bm.check([seq])
    bm.free(seq)
    assert (bm.num_used_blocks, bm.num_free_blocks) == (0, 32)
    bm.check([])


def test_the_peak_of_a_windowed_group_is_one_window_of_blocks() -> None:
    bm = BlockManager(100, block_size=4, windows=(8, 8, 0))
    assert [bm.window_blocks(w) for w in (1, 4, 5, 8, 9)] == [1, 2, 2, 3, 3]
    assert bm.peak_blocks(400) == 3 + 3 + 100
    assert bm.max_positions == (100 - 6) * 4  # the global group takes the rest
    assert BlockManager(6, block_size=4, windows=(8, 8)).max_positions == sys.maxsize
    assert BlockManager(5, block_size=4, windows=(8, 8)).max_positions == 8  # 2 blocks each


def test_a_windowed_prefix_is_shared_from_its_window_on() -> None:
    bm = BlockManager(40, block_size=2, windows=(3, 0))
    prompt = list(range(1, 12))  # 5 full blocks + 1 token
    a = with_prompt("a", prompt)
    computed(bm, a, 11)
    bm.reclaim(a)  # the next query (11) reads 9..11: local blocks 0..3 go, still keyed
    assert a.block_tables[0][:4] == [NO_BLOCK] * 4
    bm.free(a)
    b = with_prompt("b", [*prompt[:10], 50, 51])
    prefix = bm.find_prefix(b)
    assert len(prefix) == 5  # b computes from position 10, reading 8.. locally
    local, full = prefix.tables
    assert local[:4] == (NO_BLOCK,) * 4 and NO_BLOCK not in local[4:] + full
    bm.share(b, prefix)
    b.num_computed_tokens = 10
    bm.check([b])
    computed(bm, b, 2)
    bm.reclaim(b)
    bm.check([b])


def test_a_windowed_prefix_whose_window_blocks_were_evicted_is_cut_short() -> None:
    bm = BlockManager(12, block_size=2, windows=(3, 0))
    a = with_prompt("a", list(range(1, 10)))
    computed(bm, a, 9)
    bm.reclaim(a)  # local blocks 0..2 go back to the free list first
    c = with_prompt("c", [90] * 5)
    computed(bm, c, 4)  # 2 blocks a group: the 2 plain free ones, then 2 cached ones
    bm.free(a)
    b = with_prompt("b", list(range(1, 10)))
    # Global blocks 0..3 are cached, local 0 and 1 evicted: a prefix of n blocks
    # needs local blocks from (2n - 2) // 2 = n - 1 on, so n = 4 still works.
    prefix = bm.find_prefix(b)
    assert len(prefix) == 4 and prefix.tables[0][:3] == (NO_BLOCK,) * 3
    bm.check([c])


def test_layer_groups_are_of_one_window_and_one_size() -> None:
    gemma3 = KVGroups.of([512 if (i + 1) % 6 else 0 for i in range(18)])  # 15 local, 3 global
    assert gemma3.windows == (512,) * 5 + (0,) and gemma3.group_size == 3
    assert gemma3.layers[0] == (0, 1, 2) and gemma3.layers[5] == (5, 11, 17)
    assert gemma3.place(11) == (5, 1) and gemma3.place(6) == (1, 2)
    gemma2 = KVGroups.of([4096, 0] * 13)
    assert (gemma2.windows, gemma2.group_size) == ((4096, 0), 13)
    assert KVGroups.of([0] * 30) == KVGroups.single(30)
    assert KVGroups.of([64] * 4).windows == (64,)  # every layer local: one group, reclaimed
    assert KVGroups.of([8, 8, 8, 0, 0]).group_size == 1  # gcd(3, 2)
    assert KVGroups.of([64] * 4).describe() == "1 KV group of 4 layers (1 of window 64)"
    assert gemma3.describe() == "6 KV groups of 3 layers (5 of window 512, 1 global)"
