"""The continuous-batching scheduler, driven by a fake model with a real paged KV pool.

No processes, no torch: ``PagedFakeModel`` stands in for the model runner and
sampler. It writes every scheduled token into the slot its block table names,
with a digest of every token up to it (as real K/V depends on the whole prefix),
and, to sample, reads back every earlier position of that sequence from the pool,
so a wrong block table, a skipped position, a block shared between sequences
whose prefixes differ or a shared block overwritten fails loudly. Its next token
is a hash of the tokens it read back, so a sequence that is preempted and
recomputed, or that skips a cached prefix, must produce exactly the tokens of an
uninterrupted run.
"""

from __future__ import annotations

import array
import random
import subprocess
import sys
import zlib
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tserve.gpu.scheduling._kv import NO_BLOCK, BlockManager
from tserve.gpu.scheduling._scheduler import Scheduler
from tserve.gpu.scheduling._sequence import ScheduledChunk, Sequence, SequenceStatus
from tserve.protocol import FinishReason, SamplingParams

EOS = 0


def next_token(tokens: list[int], vocab: int) -> int:
    """The fake model's greedy choice after ``tokens``."""
    return zlib.crc32(array.array("q", tokens).tobytes()) % vocab


def reference_output(seq: Sequence, vocab: int, eos: frozenset[int]) -> list[int]:
    """What ``seq`` generates when it runs alone and is never preempted."""
    tokens, out = list(seq.prompt_token_ids), list[int]()
    while len(out) < seq.params.max_tokens:
        token = next_token(tokens, vocab)
        tokens.append(token)
        out.append(token)
        if token in seq.params.stop_token_ids or (token in eos and not seq.params.ignore_eos):
            break
    return out


def prefix_digests(tokens: list[int]) -> list[tuple[int, int, int]]:
    """``(position, token, digest of tokens[: position + 1])`` for every position."""
    out, crc = [], 0
    for p, token in enumerate(tokens):
        crc = zlib.crc32(token.to_bytes(8, "little", signed=True), crc)
        out.append((p, token, crc))
    return out


class PagedFakeModel:
    """A deterministic model runner + sampler over a paged KV pool (see module docstring).

    With ``blocks``, every write is also checked to land in a block that only
    its sequence holds and that is not in the prefix cache, in each of its
    layer groups; a group with a sliding window reads back only the positions
    its chunk's queries attend to (so a block reclaimed too early fails).
    """

    def __init__(self, block_size: int, vocab: int = 64, blocks: BlockManager | None = None):
        self.block_size = block_size
        self.vocab = vocab
        self.blocks = blocks
        self.windows = (0,) if blocks is None else blocks.windows
        # (group, slot) -> (position, token, digest)
        self.pool: dict[tuple[int, int], tuple[int, int, int]] = {}

    def slot(self, seq: Sequence, position: int, group: int = 0) -> tuple[int, int]:
        bs = self.block_size
        block = seq.block_tables[group][position // bs]
        assert block != NO_BLOCK, f"{seq.request_id}: position {position} was reclaimed"
        return group, block * bs + position % bs

    def step(self, chunks: list[ScheduledChunk]) -> dict[str, int]:
        for c in chunks:
            stop = c.start + len(c.token_ids)
            for p, token, digest in prefix_digests(c.seq.token_slice(0, stop))[c.start :]:
                for group in range(len(self.windows)):
                    if self.blocks is not None:
                        block = c.seq.block_tables[group][p // self.block_size]
                        assert self.blocks.ref_count(block) == 1, "a write to a shared block"
                        assert not self.blocks.is_cached(block), "a write to a cached block"
                    self.pool[self.slot(c.seq, p, group)] = (p, token, digest)
        return {c.seq.request_id: self.sample(c) for c in chunks if c.sample}

    def sample(self, chunk: ScheduledChunk) -> int:
        seq, end = chunk.seq, chunk.start + len(chunk.token_ids)
        expected = prefix_digests(seq.token_slice(0, end))
        for group, window in enumerate(self.windows):
            first = max(0, chunk.start - window + 1) if window else 0
            cached = [self.pool[self.slot(seq, p, group)] for p in range(first, end)]
            assert cached == expected[first:], seq.request_id
        return next_token([t for _, t, _ in expected], self.vocab)


def make(
    request_id: str,
    num_prompt: int,
    max_tokens: int,
    *,
    deadline: float | None = None,
    ignore_eos: bool = False,
    stop_token_ids: tuple[int, ...] = (),
) -> Sequence:
    base = zlib.crc32(request_id.encode())
    prompt = [(base + i) % 50 + 1 for i in range(num_prompt)]  # no EOS in prompts
    sampling = SamplingParams(
        max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids
    )
    return Sequence(request_id, prompt, sampling, deadline=deadline)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    max_model_len: int | None = None,
    prefix_caching: bool = True,
    max_decode_slowdown: float = 2.5,
    windows: tuple[int, ...] = (0,),
) -> Scheduler:
    """``max_model_len`` None: the longest context the KV cache holds (its
    last token is never fed back, so one more than the cache's tokens)."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching, windows=windows)
    return Scheduler(
        bm,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len or min(bm.max_positions, 10**6) + 1,
        eos_token_ids=[EOS],
        max_decode_slowdown=max_decode_slowdown,
    )


def check_step(
    sched: Scheduler, chunks: list[ScheduledChunk], preempted: bool, decoding: set[str]
) -> None:
    """The per-step guarantees of the policy, checked right after ``schedule()``;
    ``decoding`` holds the ids of the running sequences that were decoding before it."""
    bm = sched.block_manager
    by_seq = {c.seq.request_id: c for c in chunks}
    assert len(by_seq) == len(chunks), "a sequence scheduled twice in one step"
    assert sum(len(c.token_ids) for c in chunks) <= sched.max_num_batched_tokens
    assert sched.num_running <= sched.max_num_seqs
    for c in chunks:
        assert c.seq.status is SequenceStatus.RUNNING
        assert c.start == c.seq.num_computed_tokens and c.token_ids
        assert c.token_ids == c.seq.token_slice(c.start, c.start + len(c.token_ids))
        assert c.sample == (c.start + len(c.token_ids) == c.seq.num_tokens)
        assert len(c.seq.block_table) * bm.block_size >= c.start + len(c.token_ids)
    for seq in sched.running:  # decodes always run
        assert seq.num_uncomputed_tokens >= 1
        if seq.num_uncomputed_tokens == 1:
            assert seq.request_id in by_seq, f"decode of {seq.request_id} skipped"
    decodes = sum(1 for c in chunks if c.seq.request_id in decoding)
    prefill = sum(len(c.token_ids) for c in chunks) - decodes
    assert prefill <= sched.prefill_budget(decodes)
    if decodes and sched.max_decode_slowdown and prefill > 1:  # rule 4's cost bound
        overhead = sched.step_overhead_tokens
        assert overhead + decodes + prefill <= sched.max_decode_slowdown * (overhead + decodes)
    budget_left = sched.prefill_budget(decodes) - prefill
    for seq in sched.running:  # a prefill always gets the prefill budget left, if KV allows
        if seq.request_id not in by_seq:
            assert budget_left == 0 or bm.num_allocatable_tokens(seq) == 0
    waiting = sched.waiting
    if waiting and not preempted and sched.num_running < sched.max_num_seqs and budget_left:
        head = waiting[0]
        room = bm.num_allocatable_tokens(head, bm.find_prefix(head))
        assert room == 0, "the head could have been admitted"


def step(sched: Scheduler, model: PagedFakeModel) -> tuple[list[ScheduledChunk], list[Sequence]]:
    """One engine step with every invariant checked."""
    before = sched.num_preemptions
    decoding = {s.request_id for s in sched.running if s.num_uncomputed_tokens == 1}
    chunks = sched.schedule()
    check_step(sched, chunks, preempted=sched.num_preemptions > before, decoding=decoding)
    news = sched.update(chunks, model.step(chunks))
    sched.check()
    return chunks, news


def run_until_idle(sched: Scheduler, model: PagedFakeModel, max_steps: int = 10_000) -> int:
    for n in range(max_steps):
        if not sched.has_work:
            return n
        step(sched, model)
    raise AssertionError(f"still busy after {max_steps} steps")


def tokens_of(chunks: list[ScheduledChunk]) -> dict[str, int]:
    return {c.seq.request_id: len(c.token_ids) for c in chunks}


def test_the_bookkeeping_imports_no_torch_zmq_trio_or_numpy() -> None:
    code = (
        "import sys, tserve.gpu.scheduling._scheduler, tserve.gpu.scheduling._kv\n"
        "print(sorted({'torch', 'zmq', 'trio', 'numpy'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- validation ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_prompt", "max_tokens"),
    [(0, 4), (4, 0), (4, -1), (40, 10)],  # 50 > max_model_len 49
)
def test_add_asserts_what_the_engines_validity_check_guarantees(
    num_prompt: int, max_tokens: int
) -> None:
    """The engine adds only what ``tserve.validity`` passed; anything else is a bug."""
    sched = make_scheduler(num_blocks=12, block_size=4)
    with pytest.raises(AssertionError):
        sched.add(make("r", num_prompt, max_tokens))
    assert (sched.has_work, sched.num_waiting) == (False, 0)


def test_a_context_longer_than_the_kv_cache_is_a_configuration_error() -> None:
    with pytest.raises(ValueError, match="fit the KV cache"):
        make_scheduler(num_blocks=12, block_size=4, max_model_len=50)


def test_the_largest_request_that_fits_runs_to_completion() -> None:
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=8)
    seq = make("r", 40, 9, ignore_eos=True)  # peak 48 positions == 12 blocks exactly
    sched.add(seq)
    run_until_idle(sched, PagedFakeModel(4))
    assert (seq.finish_reason, seq.num_output_tokens) == (FinishReason.LENGTH, 9)


def test_a_live_id_added_again_is_a_bug() -> None:
    sched = make_scheduler()
    sched.add(make("r", 4, 4))
    with pytest.raises(AssertionError, match="is live"):
        sched.add(make("r", 4, 4))
    assert sched.num_waiting == 1


@pytest.mark.parametrize(
    ("seqs", "tokens"), [({"max_num_seqs": 0}, 8), ({"max_num_seqs": 9}, 8), ({}, 0)]
)
def test_bad_configuration_raises(seqs: dict[str, int], tokens: int) -> None:
    with pytest.raises(ValueError):
        Scheduler(
            BlockManager(8),
            max_num_seqs=seqs.get("max_num_seqs", 1),
            max_num_batched_tokens=tokens,
            max_model_len=16,
        )


# -- the shape of a step -----------------------------------------------------------


def test_chunked_prefill_splits_and_resumes() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    model = PagedFakeModel(4)
    seq = make("long", 40, 3, ignore_eos=True)
    sched.add(seq)
    shapes: list[tuple[int, int, bool]] = []
    while sched.has_work:
        chunks, _ = step(sched, model)
        shapes.extend((c.start, len(c.token_ids), c.sample) for c in chunks)
    assert shapes == [(0, 16, False), (16, 16, False), (32, 8, True), (40, 1, True), (41, 1, True)]
    assert seq.output_token_ids == reference_output(seq, model.vocab, frozenset({EOS}))


def test_prefill_shares_steps_with_decodes() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    model = PagedFakeModel(4)
    for i in range(3):
        sched.add(make(f"d{i}", 2, 50, ignore_eos=True))
    step(sched, model)  # all three prefills in one step
    sched.add(make("long", 40, 1))
    chunks, _ = step(sched, model)
    assert tokens_of(chunks) == {"d0": 1, "d1": 1, "d2": 1, "long": 13}
    chunks, _ = step(sched, model)
    assert tokens_of(chunks) == {"d0": 1, "d1": 1, "d2": 1, "long": 13}


def test_requests_join_and_leave_at_every_step() -> None:
    sched = make_scheduler(max_num_seqs=2)
    model = PagedFakeModel(4)
    a, b, c = make("a", 3, 2, ignore_eos=True), make("b", 3, 5, ignore_eos=True), make("c", 3, 1)
    for seq in (a, b, c):
        sched.add(seq)
    assert tokens_of(step(sched, model)[0]) == {"a": 3, "b": 3}
    chunks, news = step(sched, model)
    assert tokens_of(chunks) == {"a": 1, "b": 1}
    assert a.finish_reason is FinishReason.LENGTH and a in news
    assert tokens_of(step(sched, model)[0]) == {"b": 1, "c": 3}  # c joins as a leaves


def test_waiting_requests_are_admitted_as_memory_frees() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=4)
    model = PagedFakeModel(4)
    first = make("first", 13, 4, ignore_eos=True)  # peak 16 positions: the whole cache
    second = make("second", 8, 4, ignore_eos=True)
    sched.add(first)
    sched.add(second)
    admitted_at = None
    for n in range(20):
        chunks, _ = step(sched, model)
        if "second" in tokens_of(chunks) and admitted_at is None:
            admitted_at = n
        if n <= 3:
            assert second.status is SequenceStatus.WAITING  # the KV is full of `first`
    assert first.finish_reason is FinishReason.LENGTH
    assert admitted_at == 4  # the step right after `first` finished (steps 0..3)
    assert sched.block_manager.num_free_blocks == 4


def test_fcfs_the_head_is_never_overtaken() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    model = PagedFakeModel(4)
    sched.add(make("running", 13, 4, ignore_eos=True))  # peak 16 positions: the whole cache
    step(sched, model)
    sched.add(make("big", 16, 1))  # needs the whole cache too
    sched.add(make("small", 2, 1))  # would fit as soon as one block frees, but is behind `big`
    first_step: dict[str, int] = {}
    for n in range(20):
        for c in step(sched, model)[0]:
            first_step.setdefault(c.seq.request_id, n)
    assert first_step["running"] < first_step["big"] < first_step["small"]


# -- stop conditions -----------------------------------------------------------------


def scripted(tokens: list[int]) -> Callable[[list[ScheduledChunk]], dict[str, int]]:
    """A model that answers every sampling chunk with the next token of a script."""
    script = iter(tokens)
    return lambda chunks: {c.seq.request_id: next(script) for c in chunks if c.sample}


@pytest.mark.parametrize(
    ("ignore_eos", "stop", "script", "reason", "num_out"),
    [
        (False, (), [5, 6, EOS, 7], FinishReason.STOP, 3),
        (True, (), [5, EOS, 6, 7], FinishReason.LENGTH, 4),
        (False, (6,), [5, 6, 7, 8], FinishReason.STOP, 2),
        (True, (6,), [EOS, 6, 7, 8], FinishReason.STOP, 2),
        (False, (), [5, 5, 5, 5], FinishReason.LENGTH, 4),
    ],
)
def test_stop_conditions(
    ignore_eos: bool, stop: tuple[int, ...], script: list[int], reason: FinishReason, num_out: int
) -> None:
    sched = make_scheduler()
    seq = make("r", 3, 4, ignore_eos=ignore_eos, stop_token_ids=stop)
    sched.add(seq)
    model = scripted(script)
    while sched.has_work:
        chunks = sched.schedule()
        sched.update(chunks, model(chunks))
    assert (seq.finish_reason, seq.output_token_ids) == (reason, script[:num_out])
    assert seq.block_table == [] and sched.block_manager.num_free_blocks == 64


def test_update_reports_every_sequence_with_a_new_token() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add(make("a", 2, 3, ignore_eos=True))
    sched.add(make("b", 20, 3, ignore_eos=True))
    chunks = sched.schedule()
    assert [(c.seq.request_id, c.sample) for c in chunks] == [("a", True), ("b", False)]
    news = sched.update(chunks, {"a": 9})
    assert [s.request_id for s in news] == ["a"]


# -- abort, errors, deadlines --------------------------------------------------------


def test_abort_frees_kv_in_the_same_call_and_is_idempotent() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4)
    model = PagedFakeModel(4)
    a, b = make("a", 10, 8), make("b", 10, 8)
    sched.add(a)
    sched.add(b)
    step(sched, model)
    free_before = sched.block_manager.num_free_blocks
    assert sched.abort("a") is a
    assert sched.block_manager.num_free_blocks == free_before + 3
    assert (a.status, a.finish_reason, a.block_table) == (
        SequenceStatus.FINISHED,
        FinishReason.ABORT,
        [],
    )
    assert sched.abort("a") is None
    assert sched.abort("nobody") is None
    assert (sched.num_running, sched.block_manager.num_free_blocks) == (1, free_before + 3)
    sched.check()


def test_abort_of_a_waiting_request_removes_it_from_the_queue() -> None:
    sched = make_scheduler(max_num_seqs=1)
    model = PagedFakeModel(4)
    for rid in "abc":
        sched.add(make(rid, 4, 4))
    step(sched, model)
    assert sched.abort("b") is not None
    assert [s.request_id for s in sched.waiting] == ["c"]
    assert sched.get("b") is None and sched.get("c") is not None


def test_finish_with_error_ends_one_request_and_update_skips_it() -> None:
    sched = make_scheduler()
    a, b = make("a", 4, 4, ignore_eos=True), make("b", 4, 4, ignore_eos=True)
    sched.add(a)
    sched.add(b)
    chunks = sched.schedule()
    assert sched.finish_with_error("a", "sampler blew up") is a
    news = sched.update(chunks, {"b": 3})
    assert news == [b]
    assert (a.finish_reason, a.error, a.block_table) == (FinishReason.ERROR, "sampler blew up", [])
    assert a.num_computed_tokens == 0 and a.output_token_ids == []
    assert sched.finish_with_error("a", "again") is None
    sched.check()


def test_deadlines_abort_waiting_and_running_requests() -> None:
    sched = make_scheduler(max_num_seqs=1)
    model = PagedFakeModel(4)
    running, waiting = make("run", 4, 50, deadline=10.0), make("wait", 4, 50, deadline=20.0)
    forever = make("forever", 4, 5)
    for seq in (running, waiting, forever):
        sched.add(seq)
    step(sched, model)
    assert sched.expire(9.9) == []
    assert sched.expire(10.0) == [running]
    assert sched.block_manager.num_free_blocks == 64
    assert sched.expire(25.0) == [waiting]
    assert [s.finish_reason for s in (running, waiting)] == [FinishReason.ABORT] * 2
    run_until_idle(sched, model)
    assert forever.finish_reason is FinishReason.LENGTH


# -- preemption and starvation ---------------------------------------------------------


def test_preemption_takes_the_newest_and_recompute_keeps_outputs() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    model = PagedFakeModel(4)
    old, new = make("old", 6, 12, ignore_eos=True), make("new", 6, 12, ignore_eos=True)
    sched.add(old)
    sched.add(new)
    outputs_at_preemption: list[int] | None = None
    while sched.has_work:
        before = sched.num_preemptions
        step(sched, model)
        if sched.num_preemptions > before and outputs_at_preemption is None:
            assert (new.status, new.num_computed_tokens, new.block_table) == (
                SequenceStatus.WAITING,
                0,
                [],
            )
            assert old.status is SequenceStatus.RUNNING
            assert sched.waiting[0] is new
            outputs_at_preemption = list(new.output_token_ids)
    assert outputs_at_preemption  # it had generated tokens when it was preempted
    assert new.output_token_ids[: len(outputs_at_preemption)] == outputs_at_preemption
    eos = frozenset({EOS})
    for seq in (old, new):
        assert seq.output_token_ids == reference_output(seq, model.vocab, eos)


def test_preempted_requests_go_back_in_front_of_the_queue() -> None:
    sched = make_scheduler(num_blocks=4, block_size=2, max_num_batched_tokens=64)
    model = PagedFakeModel(2)
    a, b, c = (make(rid, 2, 6, ignore_eos=True) for rid in "abc")
    sched.add(a)
    sched.add(b)
    step(sched, model)  # a and b hold 2 of the 4 blocks... then grow
    sched.add(c)
    while b.status is SequenceStatus.RUNNING:
        step(sched, model)
    assert sched.waiting == [b, c]


def test_an_old_long_request_is_not_starved_by_a_stream_of_short_ones() -> None:
    sched = make_scheduler(num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    model = PagedFakeModel(4)
    n = 0
    for _ in range(4):
        sched.add(make(f"short{n}", 4, 6, ignore_eos=True))
        n += 1
    step(sched, model)
    old = make("old", 100, 20, ignore_eos=True)
    sched.add(old)
    steps = 0
    while not old.is_finished and steps < 200:
        steps += 1
        for _ in range(2):  # arrivals outpace the service rate: the queue keeps growing
            sched.add(make(f"short{n}", 4, 6, ignore_eos=True))
            n += 1
        step(sched, model)
    assert old.finish_reason is FinishReason.LENGTH
    # 5 steps for the running shorts to drain, ceil(100 / 16) = 7 prefill steps (the budget
    # is all its own: nobody behind it may be admitted) and 19 decodes: 31 steps.
    assert steps == 5 + 7 + 19
    assert sched.num_waiting > 40


# -- the prefill budget (rule 4) ----------------------------------------------------------


@pytest.mark.parametrize(
    ("slowdown", "decodes", "budget"),
    [
        (2.5, 0, 512),  # nothing decodes: the whole step budget
        (2.5, 1, 13),  # 1.5 * (8 + 1)
        (2.5, 16, 36),  # 1.5 * (8 + 16)
        (2.5, 64, 108),
        (2.5, 300, 212),  # capped by max_num_batched_tokens - decodes
        (1, 16, 1),  # no slowdown allowed: still one token a step, so nothing starves
        (0, 16, 496),  # the rule off
    ],
)
def test_the_prefill_budget_bounds_a_steps_cost(slowdown: float, decodes: int, budget: int) -> None:
    sched = make_scheduler(
        max_num_seqs=300, max_num_batched_tokens=512, max_decode_slowdown=slowdown
    )
    assert sched.step_overhead_tokens == 8
    assert sched.prefill_budget(decodes) == budget


@pytest.mark.parametrize("slowdown", [-1.0, 0.5])
def test_a_slowdown_below_one_is_refused(slowdown: float) -> None:
    with pytest.raises(ValueError, match="max_decode_slowdown"):
        make_scheduler(max_decode_slowdown=slowdown)


def test_a_long_prompt_arriving_mid_stream_is_spread_over_bounded_steps() -> None:
    sched = make_scheduler(
        num_blocks=1024, max_num_seqs=32, max_num_batched_tokens=512, max_model_len=2048
    )
    model = PagedFakeModel(4)
    streams = [make(f"s{i}", 8, 200, ignore_eos=True) for i in range(16)]
    for seq in streams:
        sched.add(seq)
    chunks, _ = step(sched, model)
    assert sum(len(c.token_ids) for c in chunks) == 16 * 8  # nobody decodes: all at once
    long = make("long", 550, 4, ignore_eos=True)
    sched.add(long)
    prefill_steps = 0
    while long.num_output_tokens == 0:
        chunks, _ = step(sched, model)
        sizes = tokens_of(chunks)
        assert all(sizes[s.request_id] == 1 for s in streams), "a stream skipped a step"
        assert sizes["long"] <= 36  # 1.5 * (8 + 16): at most 2.5x a decode-only step
        prefill_steps += 1
    assert prefill_steps == -(-550 // 36)


def test_with_the_tightest_bound_a_prompt_still_finishes_behind_endless_decodes() -> None:
    sched = make_scheduler(max_num_batched_tokens=32, max_decode_slowdown=1)
    model = PagedFakeModel(4)
    for i in range(3):
        sched.add(make(f"s{i}", 2, 50, ignore_eos=True))
    step(sched, model)
    late = make("late", 20, 1)
    sched.add(late)
    steps = 0
    while not late.is_finished:
        chunks, _ = step(sched, model)
        assert tokens_of(chunks)["late"] == 1
        steps += 1
    assert steps == 20


# -- the prefix cache ------------------------------------------------------------------


def test_a_cached_prefix_is_skipped_and_only_the_rest_counts_against_the_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    bm = sched.block_manager
    model = PagedFakeModel(4, blocks=bm)
    first = make("first", 22, 3, ignore_eos=True)
    sched.add(first)
    run_until_idle(sched, model)
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 6  # 24 computed positions
    again = make("again", 0, 3, ignore_eos=True)
    again.prompt_token_ids = [*first.prompt_token_ids, 7, 7]  # 24 tokens
    other = make("other", 6, 3, ignore_eos=True)
    sched.add(again)
    sched.add(other)
    chunks, _ = step(sched, model)
    # 5 full blocks cached (never the last token's): 4 tokens to compute, and the
    # budget of 8 leaves room for `other` in the same step.
    assert [(c.seq.request_id, c.start, len(c.token_ids)) for c in chunks] == [
        ("again", 20, 4),
        ("other", 0, 4),
    ]
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (22 + 24 + 6, 20)
    run_until_idle(sched, model)
    for seq in (first, again, other):
        assert seq.output_token_ids == reference_output(seq, model.vocab, frozenset({EOS}))
    assert (bm.num_used_blocks, bm.num_free_blocks) == (0, bm.num_blocks)


def test_identical_prompts_in_flight_together_share_once_cached() -> None:
    """Two at once compute their own copies; the third, later, shares the first's."""
    sched = make_scheduler(max_num_batched_tokens=64)
    bm = sched.block_manager
    model = PagedFakeModel(4, blocks=bm)
    seqs = [make(f"same{i}", 12, 20, ignore_eos=True) for i in range(3)]
    for seq in seqs[1:]:
        seq.prompt_token_ids = list(seqs[0].prompt_token_ids)
    sched.add(seqs[0])
    sched.add(seqs[1])
    step(sched, model)
    assert not set(seqs[0].block_table) & set(seqs[1].block_table)
    sched.add(seqs[2])
    chunks, _ = step(sched, model)
    assert [(c.start, len(c.token_ids)) for c in chunks if c.seq is seqs[2]] == [(8, 4)]
    assert seqs[2].block_table[:2] == seqs[0].block_table[:2]
    run_until_idle(sched, model)
    assert len({tuple(s.output_token_ids) for s in seqs}) == 1


def test_a_preempted_request_shares_its_own_blocks_when_readmitted() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    bm = sched.block_manager
    model = PagedFakeModel(4, blocks=bm)
    old, new = make("old", 6, 12, ignore_eos=True), make("new", 9, 12, ignore_eos=True)
    sched.add(old)
    sched.add(new)
    restarts: list[int] = []
    while sched.has_work:
        before = new.status
        chunks, _ = step(sched, model)
        if before is SequenceStatus.WAITING and new.status is SequenceStatus.RUNNING:
            restarts += [c.start for c in chunks if c.seq is new]
    assert sched.num_preemptions > 0 and restarts[0] == 0 and max(restarts[1:]) > 0
    eos = frozenset({EOS})
    for seq in (old, new):
        assert seq.output_token_ids == reference_output(seq, model.vocab, eos)
    assert (bm.num_used_blocks, bm.num_free_blocks) == (0, bm.num_blocks)


# -- the randomized simulation -----------------------------------------------------------


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    max_num_seqs = draw(st.integers(1, 8))
    num_blocks = draw(st.integers(2, 48))
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    windows = draw(st.sampled_from([(0,), (0,), (5,), (3, 0), (6, 6, 0), (2, 9)]))
    longest = BlockManager(num_blocks, block_size, windows=windows).max_positions
    return {
        "num_blocks": num_blocks,
        "block_size": block_size,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_seqs + draw(st.integers(0, 48)),
        "max_model_len": min(draw(st.integers(4, 160)), longest + 1),
        "max_decode_slowdown": draw(st.sampled_from([0, 1, 1.1, 2.5])),
        "windows": windows,
    }


MIDSIZE = {"block_size": 4, "max_num_seqs": 6, "max_num_batched_tokens": 24, "max_model_len": 120}


@settings(max_examples=200, deadline=None)
@given(config=configs(), seed=st.integers(0, 2**32 - 1), prefix_caching=st.booleans())
@example(config={**MIDSIZE, "num_blocks": 20, "max_model_len": 81}, seed=3, prefix_caching=True)
@example(config={**MIDSIZE, "num_blocks": 20, "max_model_len": 81}, seed=3, prefix_caching=False)
@example(config={"num_blocks": 40, **MIDSIZE}, seed=5, prefix_caching=True)
@example(
    config={**MIDSIZE, "num_blocks": 30, "max_model_len": 81, "windows": (6, 6, 0)},
    seed=7,
    prefix_caching=True,
)
@example(config={**MIDSIZE, "num_blocks": 9, "windows": (5,)}, seed=11, prefix_caching=True)
def test_random_simulation_keeps_every_invariant(
    config: dict[str, Any], seed: int, prefix_caching: bool
) -> None:
    """Random arrivals, lengths, shared prefixes, aborts, EOS and deadlines against
    a small KV cache, with the prefix cache on or off, its layers in one group
    or in groups of which some have a sliding window (their blocks reclaimed).

    After every step: the allocator's invariants (reference counts equal the block
    tables), the budget, decodes-always-run, FCFS admission, and no write into a
    shared or cached block. At the end: nothing left running or held (cached free
    blocks only), every request finished with the reason its tokens call for, and
    every output equals the output of the same request run alone (so preemption,
    chunking and prefix sharing never change a token).
    """
    rng = random.Random(seed)
    sched = make_scheduler(**config, prefix_caching=prefix_caching)
    bm = sched.block_manager
    model = PagedFakeModel(config["block_size"], vocab=rng.choice([3, 16, 64]), blocks=bm)
    assert bm.windows == config.get("windows", (0,))
    stems = [[rng.randint(1, 50) for _ in range(sched.max_model_len)] for _ in range(3)]
    eos = frozenset({EOS})
    added: list[Sequence] = []
    aborted: set[str] = set()
    first_scheduled: list[int] = []  # indexes into `added`, in order of first chunk
    seen: set[str] = set()
    now = 0.0
    attempts = 0
    for _ in range(20_000):
        now += 1.0
        if attempts < 50 and rng.random() < 0.5:
            attempts += 1
            seq = random_request(rng, f"r{attempts}", now, sched.max_model_len, stems)
            if cannot_run(seq, sched):  # the engine refuses it (tserve.validity)
                continue
            sched.add(seq)
            added.append(seq)
        live = sched.sequences()
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            assert sched.abort(victim.request_id) is victim
            aborted.add(victim.request_id)
        aborted.update(s.request_id for s in sched.expire(now))
        chunks, _ = step(sched, model)
        for c in chunks:
            if c.seq.request_id not in seen:
                seen.add(c.seq.request_id)
                first_scheduled.append(added.index(c.seq))
        if attempts == 50 and not sched.has_work:
            break
    assert not sched.has_work, "the simulation did not drain"
    assert (bm.num_free_blocks, bm.num_used_blocks, bm.tokens_used) == (bm.num_blocks, 0, 0)
    bm.check([])
    if not prefix_caching:
        assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (0, 0)
    assert first_scheduled == sorted(first_scheduled), "a request overtook an older one"
    for seq in added:
        expected = reference_output(seq, model.vocab, eos)
        assert seq.is_finished and not any(seq.block_tables)
        if seq.request_id in aborted:
            assert seq.finish_reason is FinishReason.ABORT
            assert seq.output_token_ids == expected[: seq.num_output_tokens]
        else:
            assert seq.output_token_ids == expected
            last, params = seq.output_token_ids[-1], seq.params
            stopped = last in params.stop_token_ids or (last in eos and not params.ignore_eos)
            assert seq.finish_reason is (FinishReason.STOP if stopped else FinishReason.LENGTH)


def random_request(
    rng: random.Random, request_id: str, now: float, max_len: int, stems: list[list[int]]
) -> Sequence:
    """Sized around ``max_len`` so that most, not all, requests are accepted; half of
    the prompts start with part of one of ``stems`` (a shared system prompt)."""
    deadline = now + rng.randint(1, 60) if rng.random() < 0.1 else None
    seq = make(
        request_id,
        rng.randint(0, max_len * 2 // 3),
        rng.randint(0, max_len // 2),
        deadline=deadline,
        ignore_eos=rng.random() < 0.5,
    )
    if rng.random() < 0.5:
        shared = rng.choice(stems)[: rng.randint(0, len(seq.prompt_token_ids))]
        seq.prompt_token_ids[: len(shared)] = shared
    return seq


def cannot_run(seq: Sequence, sched: Scheduler) -> bool:
    """What the engine refuses before ``add`` (``tserve.validity``'s length rules)."""
    n, m = len(seq.prompt_token_ids), seq.params.max_tokens
    return n == 0 or m < 1 or n + m > sched.max_model_len


# -- sliding windows -------------------------------------------------------------------


def test_an_8k_token_sequence_of_gemma3_s_layout_holds_one_window_in_its_local_groups() -> None:
    """Five groups of window 512 and one global (Gemma 3: 15 local layers to 3
    global, three a group), block 16: the local groups give back every block
    behind the window as the prefill moves on; the fake model reads each
    query's window back from the pool, so a block freed too early fails."""
    windows = (512,) * 5 + (0,)
    sched = make_scheduler(
        num_blocks=2048, block_size=16, max_num_batched_tokens=512, windows=windows
    )
    bm = sched.block_manager
    model = PagedFakeModel(16, blocks=bm)
    seq = make("long", 8192, 4, ignore_eos=True)
    sched.add(seq)
    during: list[int] = []  # blocks held while each step runs
    after: list[int] = []  # and once it has been recorded
    while sched.has_work:
        chunks = sched.schedule()
        during.append(bm.num_used_blocks)
        sched.update(chunks, model.step(chunks))
        sched.check()
        after.append(bm.num_used_blocks)
        if seq.num_computed_tokens == 8192:  # the prompt is in: 512 global blocks
            assert bm.num_used_blocks == 512 + 5 * 32  # 7681..8191 in the local ones
            assert bm.num_free_blocks == 2048 - 512 - 5 * 32
    # A 512-token chunk holds its own 32 blocks and the 32 of the window before it;
    # between steps a local group holds the 33 blocks that positions 7681..8195 touch.
    assert (max(during), max(after)) == (512 + 5 * 64, 513 + 5 * 33)
    # One group (every layer in a block) holds 513 blocks of six times the size.
    assert (513 * 6 / max(during), 513 * 6 / max(after)) == pytest.approx((3.70, 4.54), abs=0.01)
    assert seq.output_token_ids == reference_output(seq, model.vocab, frozenset({EOS}))
    assert (bm.num_used_blocks, bm.num_free_blocks) == (0, 2048)
