"""KV-cache accounting: a paged block allocator.

Plain Python: no torch. The KV cache is ``num_blocks`` physical blocks of
``block_size`` token slots each. A sequence owns the blocks listed in its
``block_table``, in position order; the model runner writes the K/V of position
``p`` to slot ``block_table[p // block_size] * block_size + p % block_size``.

Rules:

* Blocks are granted only through the paired verbs: ``can_allocate(seq, n)``
  says whether ``allocate(seq, n)`` would succeed; calling ``allocate`` when it
  would not is a bug in the caller (an assertion), not a runtime condition.
* ``allocate`` only ever appends; a sequence gives back all of its blocks at
  once with ``free`` (finish, abort, preemption). ``free`` is idempotent.
* A block is either free or owned by exactly one sequence; ``check`` verifies
  this in O(num_blocks) and the tests call it after every step.
"""

from __future__ import annotations

import collections

from tserve.gpu._sequence import Sequence

__all__ = ["BlockManager"]


class BlockManager:
    """A fixed pool of KV blocks handed out to sequences.

    Every call is O(blocks moved), never blocks, and never allocates beyond
    ``num_blocks``.
    """

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Invariant: _free and _owner partition range(num_blocks):
        # len(_free) + len(_owner) == num_blocks, and no id is in both.
        self._free: collections.deque[int] = collections.deque(range(num_blocks))
        # block id -> request_id of the one sequence whose block_table holds it.
        self._owner: dict[int, str] = {}

    # -- stats ---------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self._owner)

    @property
    def tokens_total(self) -> int:
        """Token slots in the whole cache."""
        return self.num_blocks * self.block_size

    @property
    def tokens_used(self) -> int:
        """Token slots held by sequences (whole blocks, partly filled or not)."""
        return self.num_used_blocks * self.block_size

    # -- sizing --------------------------------------------------------------

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` positions."""
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks ``allocate(seq, num_new_tokens)`` would take from the free list."""
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def num_allocatable_tokens(self, seq: Sequence) -> int:
        """The largest ``n`` for which ``can_allocate(seq, n)`` holds right now."""
        capacity = (len(seq.block_table) + len(self._free)) * self.block_size
        return max(0, capacity - seq.num_computed_tokens)

    # -- the paired verbs ------------------------------------------------------

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the free list can cover ``num_new_tokens`` more positions of ``seq``."""
        return self.num_new_blocks(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend ``seq.block_table`` to cover ``num_computed_tokens + num_new_tokens``.

        The caller must have checked ``can_allocate`` first.
        """
        n = self.num_new_blocks(seq, num_new_tokens)
        assert n <= len(self._free), f"{seq.request_id}: {n} blocks wanted, {len(self._free)} free"
        for _ in range(n):
            block = self._free.popleft()
            assert block not in self._owner, f"block {block} is free and owned"
            self._owner[block] = seq.request_id
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Give back every block of ``seq``; ``seq.block_table`` becomes empty.

        Idempotent: freeing a sequence that holds nothing does nothing.
        """
        for block in seq.block_table:
            owner = self._owner.pop(block)
            assert owner == seq.request_id, f"block {block} of {owner!r} in {seq.request_id!r}"
            self._free.append(block)
        seq.block_table.clear()

    # -- invariants ------------------------------------------------------------

    def check(self, live: list[Sequence] | None = None) -> None:
        """Assert the allocator's invariants, O(num_blocks).

        With ``live`` (every sequence that may hold blocks) also assert that the
        owners recorded here are exactly those sequences' block tables.
        """
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert free.isdisjoint(self._owner), "a block is both free and owned"
        assert len(free) + len(self._owner) == self.num_blocks, "blocks leaked"
        if live is None:
            return
        tables = {b: s.request_id for s in live for b in s.block_table}
        assert sum(len(s.block_table) for s in live) == len(tables), "a block in two tables"
        assert tables == self._owner, "block tables disagree with the allocator"
