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
"""

from __future__ import annotations

import array
import collections
import hashlib
from collections.abc import Sequence as Seq
from typing import Any

from tserve.gpu._sequence import Sequence

__all__ = ["BlockManager", "kv_budget_blocks", "kv_shape", "kv_token_bytes"]


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
) -> int:
    """Blocks of ``block_size`` tokens in the KV budget.

    ``kv_cache_tokens // block_size``, or, when ``kv_cache_memory_bytes`` is
    set, as many blocks as fit in that many bytes at ``bytes_per_token`` (K
    and V of every layer in the cache's dtype), so a smaller dtype holds more.
    Raises ValueError when the budget holds no block.
    """
    if kv_cache_memory_bytes is None:
        blocks = kv_cache_tokens // block_size
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


class BlockManager:
    """A fixed pool of KV blocks handed out to sequences, shared by prefix.

    Every call is O(blocks moved or looked up), never blocks, and never
    allocates beyond ``num_blocks``.
    """

    def __init__(
        self, num_blocks: int, block_size: int = 16, *, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Invariant: _free and _refs partition range(num_blocks).
        # Free blocks in the order they are handed out: those without a key
        # first, then cached ones, least recently freed first.
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(
            range(num_blocks)
        )
        # block id -> number of block tables holding it (>= 1).
        self._refs: dict[int, int] = {}
        # Invariant: _cached and _key_of are inverse maps. Empty unless
        # enable_prefix_caching. A keyed block may be free or held.
        self._cached: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        # Prefix-cache counters, in tokens, counted once per admission (share):
        # every known token of the admitted sequence, and those found cached.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- stats ---------------------------------------------------------------

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
        """Token slots in the whole cache."""
        return self.num_blocks * self.block_size

    @property
    def tokens_used(self) -> int:
        """Token slots held by sequences (whole blocks, partly filled or not)."""
        return self.num_used_blocks * self.block_size

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

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks ``allocate(seq, num_new_tokens)`` would take from the free list."""
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def num_allocatable_tokens(self, seq: Sequence, prefix: Seq[int] = ()) -> int:
        """The largest ``n`` for which ``can_allocate(seq, n)`` holds right now,
        or would hold after ``share(seq, prefix)`` (which takes ``prefix``'s
        free blocks off the free list)."""
        assert not prefix or not seq.block_table, "a prefix is shared only at admission"
        taken_from_free = sum(1 for block in prefix if block not in self._refs)
        held = len(seq.block_table) + len(prefix)
        capacity = (held + len(self._free) - taken_from_free) * self.block_size
        computed = seq.num_computed_tokens + len(prefix) * self.block_size
        return max(0, capacity - computed)

    # -- the paired verbs ------------------------------------------------------

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the free list can cover ``num_new_tokens`` more positions of ``seq``."""
        return self.num_new_blocks(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend ``seq.block_table`` to cover ``num_computed_tokens + num_new_tokens``.

        Takes blocks from the head of the free list, evicting the cached ones
        it takes. The caller must have checked ``can_allocate`` first.
        """
        n = self.num_new_blocks(seq, num_new_tokens)
        assert n <= len(self._free), f"{seq.request_id}: {n} blocks wanted, {len(self._free)} free"
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            key = self._key_of.pop(block, None)
            if key is not None:  # evicted: its K/V is about to be overwritten
                del self._cached[key]
            self._refs[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s reference to each of its blocks; its table becomes empty.

        A block nobody else holds returns to the free list: at its head when
        it has no key, else at its tail (the most recently freed), the later
        blocks of ``seq`` ahead of its earlier ones. Idempotent: freeing a
        sequence that holds nothing does nothing.
        """
        for block in reversed(seq.block_table):
            refs = self._refs[block] - 1
            if refs:
                self._refs[block] = refs
                continue
            del self._refs[block]
            self._free[block] = None
            if block not in self._key_of:
                self._free.move_to_end(block, last=False)
        seq.block_table.clear()
        seq.num_cached_blocks = 0

    # -- the prefix cache ------------------------------------------------------

    def find_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks that hold ``seq``'s leading full blocks, longest run.

        Never covers the last known token. Changes nothing but ``seq``'s own
        ``block_hashes`` (computed once per block). Empty when caching is off.
        """
        if not self.enable_prefix_caching:
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        keys = self._keys(seq, limit)
        blocks: list[int] = []
        for key in keys[:limit]:
            block = self._cached.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def share(self, seq: Sequence, prefix: Seq[int]) -> None:
        """Start ``seq``'s table with the cached blocks ``prefix`` (from ``find_prefix``).

        For a sequence that holds nothing; the caller then counts
        ``len(prefix) * block_size`` tokens as computed. Counts the query and
        its hits. The caller must have sized the rest of the chunk with
        ``num_allocatable_tokens(seq, prefix)``.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0, seq.request_id
        for block in prefix:
            refs = self._refs.get(block, 0)
            if refs == 0:
                del self._free[block]
            self._refs[block] = refs + 1
            seq.block_table.append(block)
        seq.num_cached_blocks = len(prefix)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += len(prefix) * self.block_size

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Offer the blocks of ``seq`` that are now full to the cache.

        Call it after ``num_computed_tokens`` grows. O(1) when no block filled
        up; a block whose tokens are already cached elsewhere stays private.
        """
        full = seq.num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or full <= seq.num_cached_blocks:
            return
        keys = self._keys(seq, full)
        for i in range(seq.num_cached_blocks, full):
            block = seq.block_table[i]
            assert block not in self._key_of, f"block {block} of {seq.request_id} keyed twice"
            if keys[i] not in self._cached:
                self._cached[keys[i]] = block
                self._key_of[block] = keys[i]
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
        reference counts are exactly those sequences' block tables, and that
        every cached block a sequence holds is fully computed in it and keyed
        by its own tokens.
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
        counts = collections.Counter(b for s in live for b in s.block_table)
        assert counts == self._refs, "block tables disagree with the reference counts"
        for s in live:
            assert len(set(s.block_table)) == len(s.block_table), f"{s.request_id}: a block twice"
            assert s.num_cached_blocks <= len(s.block_table)
            for i, block in enumerate(s.block_table):
                key = self._key_of.get(block)
                if key is not None:
                    assert (i + 1) * self.block_size <= s.num_computed_tokens, "cached, not full"
                    assert s.block_hashes[i] == key, f"{s.request_id}: block {i} is not its tokens"
