"""KV-cache accounting: a paged block allocator with a prefix cache.

Plain Python: no torch. The KV cache is ``num_blocks`` physical blocks of
``block_size`` token slots each. A sequence holds the blocks listed in its
``block_table``, in position order; the model runner writes the K/V of position
``p`` to slot ``block_table[p // block_size] * block_size + p % block_size``.

Rules:

* Blocks are granted only through the paired verbs: ``can_allocate(seq, n)``
  says whether ``allocate(seq, n)`` would succeed; calling ``allocate`` when it
  would not is a bug in the caller (an assertion), not a runtime condition.
* ``allocate`` only ever appends; a sequence gives back all of its blocks at
  once with ``free`` (finish, abort, preemption). ``free`` is idempotent.
* A block is either free or held by one or more sequences; its reference
  count is the number of block tables that hold it. ``check`` verifies this
  in O(num_blocks) and the tests call it after every step.

The prefix cache (``enable_prefix_caching``), in the same terms:

* A block is *full* once all its positions are computed. A full block's key
  is a digest of its tokens and of the key of the block before it (a chain),
  so two equal keys stand for equal tokens from position 0 to the block's
  end, hence for equal K/V. The first sequence to fill a block offers it to
  the cache (``cache_full_blocks``, after each step); a block whose key is
  already cached stays a private copy.
* At admission, ``find_prefix`` names the cached blocks that hold the longest
  run of the sequence's leading full blocks, leaving at least its last token
  to compute (a step must run it to have logits to sample), and
  ``share(seq, prefix)`` puts them in its table, one more reference each.
  ``num_allocatable_tokens(seq, prefix)`` is the sizing that goes with it.
* Nothing writes into a cached block: a sequence writes only positions at or
  past its ``num_computed_tokens``, and a block is cached or shared only when
  all of its positions are before it.
* A block whose count drops to zero goes back to the free list and keeps its
  key, so a later request can still share it. The free list hands out blocks
  without a key first, then cached ones least recently freed first (the
  later blocks of one sequence before its earlier ones); handing out a cached
  block evicts it from the cache. Hence a cached block is evicted only when
  no other free block is left.

Keys are BLAKE2b digests rather than Python's ``hash``: requests from
different clients share this cache, and a key one client could collide on
purpose would let it read another's prompt.

Layer groups (:mod:`tserve.gpu.scheduling._kv_groups`; ``windows``, one per group). A
sequence holds one table per group in ``block_tables``, all of one length;
``block_table`` is the first. Every verb above acts on every group alike
(``allocate(seq, n)`` takes a block per group per new block of positions,
a cached block is keyed per group), with these additions for a group of
sliding ``window`` w:

* The next position a sequence computes is at least ``num_computed_tokens``
  = c, and a query at q reads keys ``q - w + 1 .. q``. So a block whose
  positions all lie before ``c - w + 1`` is never read again:
  ``reclaim(seq)`` (after each step) drops the sequence's reference and puts
  ``NO_BLOCK`` in its place in the table. Reclaimed entries are a leading
  run of the table; no kernel reads them (they map to block 0 where a table
  is handed over whole).
* ``find_prefix`` asks such a group only for the blocks within the window of
  the first position to compute; ``share`` puts ``NO_BLOCK`` before them.
* ``peak_blocks(n)`` is what a sequence of ``n`` positions may hold at once:
  a windowed group at most the blocks of one window plus one.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import hashlib
import sys
from collections.abc import Sequence as Seq
from typing import Any, Final

from tserve.gpu.scheduling._sequence import Sequence

__all__ = ["NO_BLOCK", "BlockManager", "Prefix", "kv_budget_blocks", "kv_shape", "kv_token_bytes"]

NO_BLOCK = -1
"""A block table's entry for a block reclaimed outside a sliding window."""


def kv_shape(config: Any) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of a model config (a transformers one,
    its text config for a multimodal one, or a GGUF file's)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, kv_heads, head_dim


def kv_token_bytes(config: Any, itemsize: int) -> int:
    """Bytes of K plus V that one token occupies across all layers, at
    ``itemsize`` bytes a value."""
    layers, kv_heads, head_dim = kv_shape(config)
    return 2 * layers * kv_heads * head_dim * itemsize


def kv_budget_blocks(
    *,
    kv_cache_tokens: int,
    kv_cache_memory_bytes: int | None,
    bytes_per_token: int,
    block_size: int,
    num_groups: int = 1,
) -> int:
    """Blocks of ``block_size`` tokens in the KV budget.

    ``kv_cache_tokens // block_size`` blocks of every layer, that is that
    many times ``num_groups`` blocks of one layer group; or, when
    ``kv_cache_memory_bytes`` is set, as many blocks as fit in that many bytes
    at ``bytes_per_token`` (K and V of a group's layers in the cache's
    dtype), so a smaller dtype holds more. Raises ValueError when the budget
    holds no block.
    """
    if kv_cache_memory_bytes is None:
        blocks = kv_cache_tokens // block_size * num_groups
        budget = f"kv_cache_tokens ({kv_cache_tokens})"
    else:
        blocks = kv_cache_memory_bytes // (bytes_per_token * block_size)
        budget = f"kv_cache_memory_bytes ({kv_cache_memory_bytes})"
    if blocks < 1:
        raise ValueError(
            f"{budget} must hold at least one block of {block_size} tokens "
            f"({bytes_per_token * block_size} bytes)"
        )
    return blocks


@dataclasses.dataclass(frozen=True)
class Prefix:
    """Cached blocks a sequence may start with: one table per layer group, all
    of one length (its ``len``), ``NO_BLOCK`` where a windowed group needs none."""

    tables: tuple[tuple[int, ...], ...] = ()

    def __len__(self) -> int:
        return len(self.tables[0]) if self.tables else 0


NO_PREFIX: Final = Prefix()


class BlockManager:
    """A fixed pool of KV blocks handed out to sequences, shared by prefix.

    ``windows``: each layer group's sliding window (0: global), one group by
    default. Every call is O(blocks moved or looked up), never blocks, and
    never allocates beyond ``num_blocks``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        enable_prefix_caching: bool = True,
        windows: Seq[int] = (0,),
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not windows or min(windows) < 0:
            raise ValueError(f"windows must be one or more sizes >= 0, got {windows}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)
        # Invariant: _free and _refs partition range(num_blocks).
        # Free blocks in the order they are handed out: those without a key
        # first, then cached ones, least recently freed first.
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(
            range(num_blocks)
        )
        # block id -> number of block tables holding it (>= 1).
        self._refs: dict[int, int] = {}
        # Invariant: _cached and _key_of are inverse maps; a key is (group, digest).
        # Empty unless enable_prefix_caching. A keyed block may be free or held.
        self._cached: dict[tuple[int, bytes], int] = {}
        self._key_of: dict[int, tuple[int, bytes]] = {}
        # Prefix-cache counters, in tokens, counted once per admission (share):
        # every known token of the admitted sequence, and those found cached.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- stats ---------------------------------------------------------------

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds, cached (evictable) ones included."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return len(self._refs)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a prefix-cache key, free or held."""
        return len(self._cached)

    @property
    def tokens_total(self) -> int:
        """Token slots in the whole cache (of one layer group: a position of a
        sequence takes one in each group that holds it)."""
        return self.num_blocks * self.block_size

    @property
    def tokens_used(self) -> int:
        """Token slots held by sequences (whole blocks, partly filled or not)."""
        return self.num_used_blocks * self.block_size

    @property
    def max_positions(self) -> int:
        """The most positions one sequence alone may hold: the largest multiple
        of ``block_size`` whose ``peak_blocks`` fit the cache (``sys.maxsize``
        when every group has a window that fits)."""
        if all(self.windows) and self.peak_blocks(sys.maxsize) <= self.num_blocks:
            return sys.maxsize
        low, high = 0, self.num_blocks  # peak_blocks(low * bs) fits; high's may not
        while low < high:
            mid = (low + high + 1) // 2
            if self.peak_blocks(mid * self.block_size) <= self.num_blocks:
                low = mid
            else:
                high = mid - 1
        return low * self.block_size

    def ref_count(self, block: int) -> int:
        """How many block tables hold ``block`` (0: it is free)."""
        return self._refs.get(block, 0)

    def is_cached(self, block: int) -> bool:
        """Whether ``block`` has a prefix-cache key (it must not be written)."""
        return block in self._key_of

    # -- sizing --------------------------------------------------------------

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` positions."""
        return -(-num_tokens // self.block_size)

    def window_blocks(self, window: int) -> int:
        """The most blocks ``window`` consecutive positions touch."""
        return (window + self.block_size - 2) // self.block_size + 1

    def peak_blocks(self, num_positions: int) -> int:
        """The most blocks one sequence holds while it computes ``num_positions``
        positions a token at a time: every group's, a windowed group's capped
        at the blocks of one window."""
        n = self.blocks_for(num_positions)
        return sum(min(n, self.window_blocks(w)) if w else n for w in self.windows)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks ``allocate(seq, num_new_tokens)`` would take from the free list."""
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table)) * self.num_groups

    def num_allocatable_tokens(self, seq: Sequence, prefix: Prefix = NO_PREFIX) -> int:
        """The largest ``n`` for which ``can_allocate(seq, n)`` holds right now,
        or would hold after ``share(seq, prefix)`` (which takes ``prefix``'s
        free blocks off the free list)."""
        assert not prefix or not seq.block_table, "a prefix is shared only at admission"
        taken_from_free = sum(
            1
            for table in prefix.tables
            for block in table
            if block != NO_BLOCK and block not in self._refs
        )
        shared = len(prefix)
        held = len(seq.block_table) + shared
        spare = (len(self._free) - taken_from_free) // self.num_groups
        capacity = (held + spare) * self.block_size
        computed = seq.num_computed_tokens + shared * self.block_size
        return max(0, capacity - computed)

    # -- the paired verbs ------------------------------------------------------

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the free list can cover ``num_new_tokens`` more positions of ``seq``."""
        return self.num_new_blocks(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend ``seq``'s block tables to cover ``num_computed_tokens + num_new_tokens``.

        Takes blocks from the head of the free list, evicting the cached ones
        it takes. The caller must have checked ``can_allocate`` first.
        """
        n = self.num_new_blocks(seq, num_new_tokens)
        assert n <= len(self._free), f"{seq.request_id}: {n} blocks wanted, {len(self._free)} free"
        for table in self._tables(seq):
            for _ in range(n // self.num_groups):
                block, _ = self._free.popitem(last=False)
                key = self._key_of.pop(block, None)
                if key is not None:  # evicted: its K/V is about to be overwritten
                    del self._cached[key]
                self._refs[block] = 1
                table.append(block)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s reference to each of its blocks; its tables become empty.

        A block nobody else holds returns to the free list: at its head when
        it has no key, else at its tail (the most recently freed), the later
        blocks of ``seq`` ahead of its earlier ones. Idempotent: freeing a
        sequence that holds nothing does nothing.
        """
        for table in seq.block_tables:
            for block in reversed(table):
                self._release(block)
            table.clear()
        seq.num_cached_blocks = 0

    def reclaim(self, seq: Sequence) -> int:
        """Free the blocks of ``seq``'s windowed groups that no later position
        reads (all their positions before ``num_computed_tokens - window + 1``),
        ``NO_BLOCK`` in their place; how many. Call it after
        ``cache_full_blocks``: a reclaimed block keeps its key, so a later
        prompt may still share it. O(blocks freed)."""
        freed = 0
        for window, table in zip(self.windows, seq.block_tables, strict=False):
            if not window:
                continue
            i = max(0, seq.num_computed_tokens - window + 1) // self.block_size
            while i > 0 and table[i - 1] != NO_BLOCK:  # reclaimed ones are a leading run
                i -= 1
                self._release(table[i])
                table[i] = NO_BLOCK
                freed += 1
        return freed

    def _release(self, block: int) -> None:
        """One reference less to ``block`` (skipping ``NO_BLOCK``); to the free list at 0."""
        if block == NO_BLOCK:
            return
        refs = self._refs[block] - 1
        if refs:
            self._refs[block] = refs
            return
        del self._refs[block]
        self._free[block] = None
        if block not in self._key_of:
            self._free.move_to_end(block, last=False)

    def _tables(self, seq: Sequence) -> list[list[int]]:
        """``seq.block_tables``, one per group (a new sequence's made so)."""
        tables = seq.block_tables
        while len(tables) < self.num_groups:
            tables.append([])
        return tables

    # -- the prefix cache ------------------------------------------------------

    def find_prefix(self, seq: Sequence) -> Prefix:
        """The cached blocks that hold ``seq``'s leading full blocks, longest run:
        a table per group, all of one length, ``NO_BLOCK`` where a windowed
        group needs no block (before the window of the first position left to
        compute). Never covers the last known token. Changes nothing but
        ``seq``'s own ``block_hashes`` (computed once per block). Empty when
        nothing is cached or caching is off."""
        if not self.enable_prefix_caching:
            return NO_PREFIX
        limit = (seq.num_tokens - 1) // self.block_size
        keys = self._keys(seq, limit)[:limit]
        hits = [[self._cached.get((g, key)) for key in keys] for g in range(self.num_groups)]
        # The longest run every global group holds from block 0.
        run = limit
        for window, found in zip(self.windows, hits, strict=True):
            if not window:
                run = min(run, next((i for i, b in enumerate(found) if b is None), limit))
        # The longest n <= run for which each windowed group holds its window's blocks.
        for n in range(run, 0, -1):
            tables: list[tuple[int, ...]] = []
            for window, found in zip(self.windows, hits, strict=True):
                first = self._first_read(n, window)
                blocks = [b for b in found[first:n] if b is not None]
                if len(blocks) < n - first:
                    break
                tables.append((NO_BLOCK,) * first + tuple(blocks))
            else:
                return Prefix(tuple(tables))
        return NO_PREFIX

    def _first_read(self, num_blocks: int, window: int) -> int:
        """The first block a query at the start of block ``num_blocks`` reads
        with ``window`` (0: block 0)."""
        if not window:
            return 0
        return max(0, num_blocks * self.block_size - window + 1) // self.block_size

    def share(self, seq: Sequence, prefix: Prefix) -> None:
        """Start ``seq``'s tables with the cached blocks ``prefix`` (from ``find_prefix``).

        For a sequence that holds nothing; the caller then counts
        ``len(prefix) * block_size`` tokens as computed. Counts the query
        and its hits. The caller must have sized the rest of the chunk with
        ``num_allocatable_tokens(seq, prefix)``.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0, seq.request_id
        for table, blocks in zip(self._tables(seq), prefix.tables, strict=False):
            for block in blocks:
                if block != NO_BLOCK:
                    refs = self._refs.get(block, 0)
                    if refs == 0:
                        del self._free[block]
                    self._refs[block] = refs + 1
                table.append(block)
        shared = len(prefix)
        seq.num_cached_blocks = shared
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += shared * self.block_size

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Offer the blocks of ``seq`` that are now full to the cache.

        Call it after ``num_computed_tokens`` grows. O(1) when no block filled
        up; a block whose tokens are already cached elsewhere stays private.
        """
        full = seq.num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or full <= seq.num_cached_blocks:
            return
        keys = self._keys(seq, full)
        for g, table in enumerate(seq.block_tables):
            for i in range(seq.num_cached_blocks, full):
                block, key = table[i], (g, keys[i])
                assert block != NO_BLOCK, f"block {i} of {seq.request_id} reclaimed unkeyed"
                assert block not in self._key_of, f"block {block} of {seq.request_id} keyed twice"
                if key not in self._cached:
                    self._cached[key] = block
                    self._key_of[block] = key
        seq.num_cached_blocks = full

    def _keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """``seq.block_hashes``, extended to cover its first ``num_blocks`` blocks (all full)."""
        keys, size = seq.block_hashes, self.block_size
        for i in range(len(keys), num_blocks):
            tokens = array.array("q", seq.token_slice(i * size, (i + 1) * size)).tobytes()
            digest = hashlib.blake2b(keys[i - 1] if i else b"", digest_size=16)
            digest.update(tokens)
            keys.append(digest.digest())
        return keys

    # -- invariants ------------------------------------------------------------

    def check(self, live: list[Sequence] | None = None) -> None:
        """Assert the allocator's invariants, O(num_blocks).

        With ``live`` (every sequence that may hold blocks) also assert that the
        reference counts are exactly those sequences' block tables, that their
        tables are of one length with ``NO_BLOCK`` only in a windowed group's
        leading run outside its window, and that every cached block a sequence
        holds is fully computed in it and keyed by its own tokens.
        """
        assert self._free.keys().isdisjoint(self._refs), "a block is both free and held"
        assert len(self._free) + len(self._refs) == self.num_blocks, "blocks leaked"
        assert all(n >= 1 for n in self._refs.values()), "a held block with no holder"
        assert {b: k for k, b in self._cached.items()} == self._key_of, "cache maps disagree"
        assert self.enable_prefix_caching or not self._cached, "cached with caching off"
        keyed = [block in self._key_of for block in self._free]
        assert keyed == sorted(keyed), "a cached free block is handed out before a plain one"
        if live is None:
            return
        counts = collections.Counter(
            b for s in live for table in s.block_tables for b in table if b != NO_BLOCK
        )
        assert counts == self._refs, "block tables disagree with the reference counts"
        for s in live:
            held = [b for table in s.block_tables for b in table if b != NO_BLOCK]
            assert len(set(held)) == len(held), f"{s.request_id}: a block twice"
            assert len({len(t) for t in s.block_tables}) == 1, f"{s.request_id}: table lengths"
            assert s.num_cached_blocks <= len(s.block_table)
            for g, (window, table) in enumerate(zip(self.windows, s.block_tables, strict=False)):
                gone = next((i for i, b in enumerate(table) if b != NO_BLOCK), len(table))
                assert NO_BLOCK not in table[gone:], f"{s.request_id}: a gap in group {g}"
                first = max(0, s.num_computed_tokens - window + 1) // self.block_size
                assert not gone or (window and gone <= first), f"{s.request_id}: read, reclaimed"
                for i, block in enumerate(table):
                    key = self._key_of.get(block)
                    if key is not None:
                        assert (i + 1) * self.block_size <= s.num_computed_tokens, (
                            "cached, not full"
                        )
                        assert key == (g, s.block_hashes[i]), f"{s.request_id}: {i} not its tokens"
