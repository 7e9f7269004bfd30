"""The continuous-batching scheduler: which tokens of which requests run in a step.

Plain Python and sans-IO (no torch, zmq or trio). The engine loop calls
``add``/``abort``/``expire`` with what it drained from its inbox, ``schedule()``
once per step, runs the model on the chunks, and hands the sampled token ids to
``update()``. Each call is O(live requests) and never blocks.

Policy, for one ``schedule()`` call (one step, at most ``max_num_batched_tokens``
tokens and ``max_num_seqs`` running sequences; passes 2 and 3 share the
*prefill budget* of rule 4):

1. **Decodes first.** Every RUNNING sequence with one uncomputed token gets a
   1-token chunk, oldest admission first. When it needs a KV block and none is
   free, the most recently admitted running sequence is PREEMPTED: its blocks
   are freed, ``num_computed_tokens`` drops to 0 and it goes back to the FRONT
   of the waiting queue with its outputs kept, to be recomputed later as a
   prefill of prompt + outputs (its full blocks stay in the prefix cache until
   evicted, so the recompute may share them). A sequence that is itself the
   most recent preempts itself. ``max_num_batched_tokens >= max_num_seqs``, so
   decodes always fit the token budget.
2. **The unfinished prefill next.** A RUNNING sequence admitted with a partial
   chunk gets its next chunk, as large as the budget and the free blocks allow.
   It never preempts.
3. **Admissions last, and only in a step that preempted nothing.** The head of
   the waiting queue is admitted while there is a sequence slot, budget and KV
   room; its chunk is cut to fit (CHUNKED prefill). The queue is strictly FCFS:
   when the head does not fit, nobody behind it runs. With the prefix cache,
   an admitted sequence first shares the cached blocks that hold its leading
   full blocks (``BlockManager.find_prefix``) and starts computing after them;
   only the tokens it computes count against the budget.
4. **Prefill never starves decodes.** A step with D decodes gives prefill
   chunks at most ``prefill_budget(D)`` tokens (``_budget.py``). A step's cost
   is modelled as ``step_overhead_tokens + its tokens``, and a step that
   prefills may cost ``max_decode_slowdown`` times a decode-only step:
   ``P <= (max_decode_slowdown - 1) * (step_overhead_tokens + D)``, at least 1.
   With no decodes it is the whole ``max_num_batched_tokens``: nobody waits on
   the step then. So a stream's next token always comes after a step of
   bounded cost; a long prompt is spread over more steps instead. The bound
   grows with D (a bigger decode batch hides more prefill), so admissions keep
   pace with a full batch. ``max_decode_slowdown == 0`` turns the rule off.

After each step ``update`` hands back the blocks of sliding-window layer groups
that no later position reads (``BlockManager.reclaim``), so a long sequence of a
model with local layers holds their window, not its length, in those groups.

A chunk samples (``sample=True``) only when it reaches the sequence's last known
token, so a prefill split over several steps samples once, at its end.

Why nothing starves: decodes run every step; the prefill budget is at least one
token a step and goes to the unfinished prefill, then to the oldest waiting
request; a preemption victim is always the most recently admitted sequence, so
the oldest running one is never preempted by another; and every request
``add`` takes has a peak KV that fits the whole cache. So the oldest request
progresses.

The price, under KV pressure: a request admitted with a partial chunk is the
first victim when a decode next needs a block, so it may be admitted and
preempted repeatedly; each time wastes at most the tokens it had computed.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Collection, Iterable, Mapping

from tserve.gpu.scheduling._budget import STEP_OVERHEAD_TOKENS, check_budget, prefill_budget
from tserve.gpu.scheduling._kv import BlockManager
from tserve.gpu.scheduling._sequence import ScheduledChunk, Sequence, SequenceStatus
from tserve.protocol import FinishReason

__all__ = ["Scheduler"]

_RUNNING = SequenceStatus.RUNNING
_WAITING = SequenceStatus.WAITING
_FINISHED = SequenceStatus.FINISHED


class Scheduler:
    """Owns every live ``Sequence`` and the KV blocks they hold.

    Invariants (``check`` asserts them; the tests call it after every step):

    * a live sequence is in exactly one of ``_waiting`` / ``_running``, and in
      ``_live``; a FINISHED one is in none and holds no blocks;
    * ``len(_running) <= max_num_seqs``;
    * a RUNNING sequence has at least one uncomputed token (the next to feed),
      except one whose sampled chunk ran but whose token waits for its
      grammar's mask (``update``'s ``held``; ``append_token`` gives it one):
      it has none, so no pass schedules it meanwhile.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        max_decode_slowdown: float = 2.5,
        step_overhead_tokens: int = STEP_OVERHEAD_TOKENS,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({max_num_seqs}) so that every decode fits a step"
            )
        # The last sampled token is never fed back, so a full context holds
        # max_model_len - 1 positions of KV: they must fit the cache.
        longest = min(block_manager.max_positions, sys.maxsize - 1) + 1
        if not 1 <= max_model_len <= longest:
            raise ValueError(
                f"max_model_len must be in [1, {longest}] (a context must "
                f"fit the KV cache), got {max_model_len}"
            )
        check_budget(max_decode_slowdown, step_overhead_tokens)
        self.max_decode_slowdown = max_decode_slowdown
        self.step_overhead_tokens = step_overhead_tokens
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.num_preemptions = 0
        # Every unfinished sequence by id. Bound: none here; the API's admission
        # control (--max-pending) caps how many requests are live at once.
        self._live: dict[str, Sequence] = {}
        # FCFS; preempted sequences return to the front.
        self._waiting: collections.deque[Sequence] = collections.deque()
        # RUNNING sequences by id in admission order (last = most recent).
        self._running: dict[str, Sequence] = {}

    # -- stats -----------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_work(self) -> bool:
        return bool(self._live)

    @property
    def kv_tokens_used(self) -> int:
        return self.block_manager.tokens_used

    @property
    def kv_tokens_total(self) -> int:
        return self.block_manager.tokens_total

    @property
    def running(self) -> list[Sequence]:
        """A copy, in admission order."""
        return list(self._running.values())

    @property
    def waiting(self) -> list[Sequence]:
        """A copy, in queue order (next to admit first)."""
        return list(self._waiting)

    def sequences(self) -> list[Sequence]:
        """Every live (unfinished) sequence, a copy."""
        return list(self._live.values())

    def get(self, request_id: str) -> Sequence | None:
        """The live sequence with this id, or None."""
        return self._live.get(request_id)

    def check(self) -> None:
        """Assert the invariants of the class docstring and the allocator's.

        O(live requests + blocks): for tests, after every step.
        """
        assert len(self._running) <= self.max_num_seqs
        for seq in self._waiting:
            assert seq.status is _WAITING and seq.num_computed_tokens == 0
        for seq in self._running.values():
            assert seq.status is _RUNNING and seq.num_uncomputed_tokens >= 0
        assert len(self._waiting) + len(self._running) == len(self._live)
        waiting = {seq.request_id for seq in self._waiting}
        assert waiting | self._running.keys() == self._live.keys()
        self.block_manager.check(list(self._live.values()))

    # -- requests in -----------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new request at the back of the waiting queue.

        The engine adds only requests that :mod:`tserve.validity` passed and
        whose id is not live; so a request is never refused here, and what
        that rule guarantees is asserted: its prompt is not empty, it asks
        for a token, and prompt + max_tokens fit ``max_model_len``, hence its
        peak KV fits the whole cache (``max_model_len`` does: ``__init__``).
        """
        assert seq.status is _WAITING and seq.num_computed_tokens == 0 and not seq.block_table
        assert seq.request_id not in self._live, f"request id {seq.request_id!r} is live"
        assert seq.prompt_token_ids and seq.params.max_tokens >= 1
        assert len(seq.prompt_token_ids) + seq.params.max_tokens <= self.max_model_len
        self._live[seq.request_id] = seq
        self._waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a live request with ``FinishReason.ABORT`` and free its KV now.

        Idempotent: an unknown or finished id returns None and changes nothing.
        """
        return self._finish_by_id(request_id, FinishReason.ABORT)

    def finish_with_error(self, request_id: str, message: str) -> Sequence | None:
        """Finish one live request with ``FinishReason.ERROR``; the others go on.

        For a per-request failure found after ``schedule()`` (sampling or its
        grammar failed): ``update`` then skips its chunk. Unknown or finished
        id: None, nothing happens."""
        return self._finish_by_id(request_id, FinishReason.ERROR, message)

    def finish_stopped(self, request_id: str) -> Sequence | None:
        """Finish one live request with STOP: complete by a rule not seen here (its grammar)."""
        return self._finish_by_id(request_id, FinishReason.STOP)

    def expire(self, now: float) -> list[Sequence]:
        """Abort every live request whose ``deadline`` is at or before ``now``.

        O(live requests); the engine calls it once per step.
        """
        expired = [
            seq for seq in self._live.values() if seq.deadline is not None and seq.deadline <= now
        ]
        for seq in expired:
            self._finish(seq, FinishReason.ABORT)
        return expired

    # -- one step --------------------------------------------------------------

    def schedule(self) -> list[ScheduledChunk]:
        """Pick this step's chunks (see the policy at the top of this module).

        Allocates the KV blocks the chunks write to; may preempt. The chunks of
        one sequence never repeat within a step, and their token counts sum to at
        most ``max_num_batched_tokens``; those of prefill chunks to at most
        ``prefill_budget(decodes)``.
        """
        preemptions_before = self.num_preemptions
        chunks = self._schedule_decodes()
        budget = self.prefill_budget(len(chunks))
        for chunk in self._schedule_prefills(budget):
            budget -= len(chunk.token_ids)
            chunks.append(chunk)
        if self.num_preemptions == preemptions_before:
            chunks += self._admit_waiting(budget)
        return chunks

    def update(
        self,
        chunks: list[ScheduledChunk],
        sampled: Mapping[str, int],
        held: Collection[str] = (),
    ) -> list[Sequence]:
        """Record a finished forward pass; return the sequences with news.

        Advances ``num_computed_tokens`` of every chunk, appends the sampled token
        of every ``sample=True`` chunk and finishes the sequences that hit a stop
        condition, freeing their KV in this call. ``sampled`` maps request id to
        token id and must hold every sampling chunk's request that is still live,
        except those in ``held``: their token comes later (``append_token``).
        Returns every sequence that got a token (finished or not), in chunk order.
        """
        news: list[Sequence] = []
        for chunk in chunks:
            seq = chunk.seq
            if seq.is_finished:  # failed alone after schedule(); nothing to record
                continue
            assert seq.status is _RUNNING and chunk.start == seq.num_computed_tokens
            seq.num_computed_tokens += len(chunk.token_ids)
            self.block_manager.cache_full_blocks(seq)
            self.block_manager.reclaim(seq)
            if not chunk.sample:
                continue
            token = sampled.get(seq.request_id)
            if token is None:
                assert seq.request_id in held, f"no sampled token for {seq.request_id!r}"
                continue
            self._append(seq, token)
            news.append(seq)
        return news

    def append_token(self, request_id: str, token: int) -> Sequence | None:
        """Record the token of a sequence held by ``update`` (sampled in a later
        step, once its grammar's mask was ready), finishing it on a stop
        condition; the sequence, or None when it is no longer live. Whatever its
        state (a preempted one recomputes the token with the rest)."""
        seq = self._live.get(request_id)
        if seq is not None:
            self._append(seq, token)
        return seq

    def prefill_budget(self, num_decodes: int) -> int:
        """Prefill tokens a step with ``num_decodes`` decodes may run (rule 4)."""
        slowdown, overhead = self.max_decode_slowdown, self.step_overhead_tokens
        return prefill_budget(self.max_num_batched_tokens, num_decodes, slowdown, overhead)

    # -- scheduling passes -----------------------------------------------------

    def _schedule_decodes(self) -> list[ScheduledChunk]:
        """Pass 1: a 1-token chunk for every running decode, oldest first."""
        chunks: list[ScheduledChunk] = []
        for seq in list(self._running.values()):
            # Skip those preempted earlier in this loop, and unfinished prefills.
            if seq.status is not _RUNNING or seq.num_uncomputed_tokens != 1:
                continue
            if self._make_room_for_decode(seq):
                chunks.append(self._chunk(seq, 1))
        return chunks

    def _make_room_for_decode(self, seq: Sequence) -> bool:
        """Preempt the most recent running sequences until ``seq`` gets its slot.

        Returns False when ``seq`` had to preempt itself. Victims are never
        sequences scheduled earlier in this step: those are older than ``seq``.
        """
        while not self.block_manager.can_allocate(seq, 1):
            victim = next(reversed(self._running.values()))
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _schedule_prefills(self, budget: int) -> list[ScheduledChunk]:
        """Pass 2: the next chunk of running prefills, within budget and free KV."""
        chunks: list[ScheduledChunk] = []
        for seq in self._running.values():
            if budget <= 0:
                break
            if seq.num_uncomputed_tokens > 1:
                n = self._chunk_size(seq, budget)
                if n > 0:
                    chunks.append(self._chunk(seq, n))
                    budget -= n
        return chunks

    def _admit_waiting(self, budget: int) -> list[ScheduledChunk]:
        """Pass 3: admit from the head of the waiting queue while it fits (FCFS)."""
        chunks: list[ScheduledChunk] = []
        bm = self.block_manager
        while self._waiting and budget > 0 and len(self._running) < self.max_num_seqs:
            seq = self._waiting[0]
            prefix = bm.find_prefix(seq)
            cached = len(prefix) * bm.block_size
            n = min(seq.num_tokens - cached, budget, bm.num_allocatable_tokens(seq, prefix))
            if n == 0:
                break
            self._waiting.popleft()
            seq.transition(_RUNNING)
            self._running[seq.request_id] = seq
            bm.share(seq, prefix)
            seq.num_computed_tokens = cached
            if not seq.output_token_ids:
                seq.num_cached_prompt_tokens = min(cached, len(seq.prompt_token_ids))
            chunks.append(self._chunk(seq, n))
            budget -= n
        return chunks

    # -- small steps -------------------------------------------------------------

    def _chunk_size(self, seq: Sequence, budget: int) -> int:
        """The most tokens of ``seq`` that fit the budget and the free KV now."""
        allocatable = self.block_manager.num_allocatable_tokens(seq)
        return min(seq.num_uncomputed_tokens, budget, allocatable)

    def _chunk(self, seq: Sequence, n: int) -> ScheduledChunk:
        """Allocate KV for the next ``n`` tokens of ``seq`` and describe them."""
        self.block_manager.allocate(seq, n)
        start = seq.num_computed_tokens
        stop = start + n
        last = stop == seq.num_tokens  # it reaches the last known token: it samples
        return ScheduledChunk(seq, start, seq.token_slice(start, stop), last)

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s KV and put it back at the front of the waiting queue."""
        del self._running[seq.request_id]
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.transition(_WAITING)
        self._waiting.appendleft(seq)
        self.num_preemptions += 1

    def _append(self, seq: Sequence, token: int) -> None:
        seq.output_token_ids.append(token)
        reason = self._stop_reason(seq)
        if reason is not None:
            self._finish(seq, reason)

    def _stop_reason(self, seq: Sequence) -> FinishReason | None:
        """Why ``seq`` ends after its newest token, or None to go on."""
        token = seq.output_token_ids[-1]
        params = seq.params
        if token in params.stop_token_ids:
            return FinishReason.STOP
        if token in self.eos_token_ids and not params.ignore_eos:
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.max_model_len:  # the context is full
            return FinishReason.LENGTH
        return None

    def _finish_by_id(
        self, request_id: str, reason: FinishReason, error: str | None = None
    ) -> Sequence | None:
        seq = self._live.get(request_id)
        if seq is not None:
            self._finish(seq, reason, error)
        return seq

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """Take ``seq`` out of its queue, free its KV, and mark it FINISHED."""
        if seq.status is _RUNNING:
            del self._running[seq.request_id]
        else:
            self._waiting.remove(seq)
        del self._live[seq.request_id]
        self.block_manager.free(seq)
        seq.finish_reason = reason
        seq.error = error
        seq.transition(_FINISHED)
