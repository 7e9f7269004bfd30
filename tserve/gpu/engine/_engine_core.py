"""The engine's step loop, in process and without sockets.

:class:`EngineCore` joins the scheduler (plain Python), the model runner and
the sampler. The runner is :class:`~tserve.gpu.forward._native.NativeRunner` (numpy
and the C kernels) for a GGUF file served as it is on CPU whose every layer
fuses, else :class:`~tserve.gpu.forward._runner.ModelRunner`: which one, and
loading it, is :mod:`tserve.gpu.forward._load`'s (torch is imported only for the second,
so an engine on the default model never imports it). One
:meth:`EngineCore.step` is one forward pass over every scheduled request.
Everything about ONE request — invalid parameters, token ids out of the
vocabulary, a prompt that can never fit, an error while sampling it — ends
that request alone with ``FinishReason.ERROR`` and frees its KV; only an
exception out of the batch itself (the forward pass, the device) escapes
``step()``, and the process treats that as fatal.

A request that leaves temperature, top_p or top_k unset samples with the
model's recommended value (read once at load, :mod:`tserve.gpu.models._sampling_defaults`),
else OpenAI's; the values are reported in ``EngineReady``.

It is a :class:`~tserve.gpu.engine._core.Core`; the bookkeeping it shares with the
other cores (aborts, counters, the test-only forward fault) is in ``_core.py``.

A constrained request (``params.constraint``) waits in :class:`Constraints`
until its grammar is compiled (off the step loop), then joins the scheduler;
each step masks its row before sampling, feeds its sampled token to its
matcher, and ends it with STOP once the grammar is complete (see
``_constraints.py``). A row whose mask is not ready when the forward pass
ends is held: its logits row is kept, it gets no token this step and is not
scheduled, and it is sampled at the start of a later step once its mask is
ready (no forward pass again). A token its grammar rejects, a grammar that
fails, times out or runs over its mask budget ends that request alone with
ERROR, its ``error_param`` "constraint".
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from tserve.gpu.engine._core import CoreBookkeeping, PeerOutput
from tserve.gpu.forward._load import Progress, load_engine_model
from tserve.gpu.models._sampling_defaults import read_sampling_defaults
from tserve.gpu.sampling._compiler import GrammarCompiler
from tserve.gpu.sampling._constraints import Constraints, Mask
from tserve.gpu.sampling._sampler import Sampler
from tserve.gpu.scheduling._kv import BlockManager, kv_budget_blocks, kv_token_bytes
from tserve.gpu.scheduling._kv_groups import KVGroups
from tserve.gpu.scheduling._scheduler import Scheduler
from tserve.gpu.scheduling._sequence import ScheduledChunk, Sequence, SequenceStatus
from tserve.protocol import (
    AddRequest,
    EngineConfig,
    EngineStats,
    FinishReason,
    RequestOutput,
    TokenLogprob,
)
from tserve.validity import generation_problem

__all__ = ["EngineCore"]


# A step with nothing to run but grammars compiling waits this long (s) for
# one, instead of spinning; new frames wait at most this long for the loop.
_IDLE_COMPILE_WAIT = 0.005


class EngineCore(CoreBookkeeping[Sequence]):
    """Continuous batching over one model. Not thread-safe; one owner calls it."""

    eos_token_ids: tuple[int, ...]

    def __init__(self, config: EngineConfig, progress: Progress = print) -> None:
        super().__init__()
        loaded = load_engine_model(config, progress)
        model_config = loaded.config
        self.model_path = loaded.model_path
        self.eos_token_ids = loaded.eos_token_ids
        self.model_name = loaded.model_name
        self.sampling_defaults = read_sampling_defaults(
            config.generation_config,
            model_dir=loaded.defaults_dir,
            gguf_metadata=loaded.gguf_sampling,
            default_model=loaded.bundled,
        )
        progress(self.sampling_defaults.describe())
        self.vocab_size = int(model_config.vocab_size)
        self.device = loaded.device
        groups = KVGroups.of(loaded.layer_windows)
        # K and V of one token in one layer group's layers (every layer's, in one group).
        group_bytes = kv_token_bytes(model_config, loaded.kv_itemsize) // groups.num_groups
        num_blocks = kv_budget_blocks(
            kv_cache_tokens=config.kv_cache_tokens,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes,
            bytes_per_token=group_bytes,
            block_size=config.block_size,
            num_groups=groups.num_groups,
        )
        self.blocks = BlockManager(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            windows=groups.windows,
        )
        model_len = int(getattr(model_config, "max_position_embeddings", 0) or 2048)
        # The context is capped by the model and by what one sequence may hold alone.
        self.max_model_len = min(
            config.max_model_len or model_len, model_len, self.blocks.max_positions
        )
        self.config = config
        self.runner = loaded.runner(num_blocks, groups)
        tokenizer = loaded.tokenizer
        self.sampler = Sampler()
        self.scheduler = Scheduler(
            self.blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            max_decode_slowdown=config.max_decode_slowdown,
        )
        compiler = GrammarCompiler(
            _tokenizer_json(tokenizer, self.model_path),
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            cache_size=config.grammar_cache_size,
        )
        self.constraints = Constraints(
            compiler,
            compile_timeout=config.grammar_compile_timeout,
            mask_budget=config.grammar_mask_budget,
            vocab_size=self.vocab_size,
            threads=config.threads,
        )
        # Logprobs of tokens sampled but not yet reported; one entry per token.
        self._logprobs: dict[str, list[TokenLogprob]] = {}
        # Rows whose forward pass ran but whose grammar mask was late: the
        # logits row (float32 [V], a copy) to sample once the mask is ready.
        # Bound: one per constrained request in the scheduler.
        self._held: dict[str, np.ndarray[Any, np.dtype[np.float32]]] = {}
        capacity = _capacity(self.blocks, groups, group_bytes, loaded.kv_dtype)
        progress(f"engine ready: {self.model_name}, {capacity}")

    # -- requests in ---------------------------------------------------------

    def add(self, request: AddRequest, peer: bytes) -> None:
        """Queue a request; a request that can never run is answered with an error.

        An id already live for the SAME peer is dropped (see ``_core.py``); the
        same id from another peer is rejected to that peer alone.
        """
        if self._is_duplicate(request.request_id, peer):
            return
        problem = self._check(request)
        if problem is None:
            seq = Sequence(
                request.request_id,
                list(request.prompt_token_ids),
                request.params,
                peer=peer,
                deadline=request.deadline,
                defaults=self.sampling_defaults,
            )
            problem = self._queue(seq)
        if problem is not None:
            self._reject(peer, request.request_id, problem)

    def _queue(self, seq: Sequence) -> str | None:
        """Hand ``seq`` (valid: ``_check``) to the scheduler, or to the grammar
        compiler first; the problem when it can never run: its id is live
        (another peer's, waiting for its grammar or scheduled). A grammar the
        compiler refuses ends its request later (``_take_compiled``)."""
        if self.scheduler.get(seq.request_id) or self.constraints.has(seq.request_id):
            return f"request id {seq.request_id!r} is already in use"
        if seq.params.constraint is None:
            self.scheduler.add(seq)
            return None
        problem = self.constraints.add(seq, time.time())
        if problem is not None:
            self._reject(seq.peer, seq.request_id, problem, param="constraint")
        return None

    # Aborts (abort, abort_peer, abort_all) are CoreBookkeeping's; they free KV at once.

    def _matching(self, request_id: str, peer: bytes | None) -> list[Sequence]:
        seq = self.scheduler.get(request_id) or self.constraints.get_waiting(request_id)
        return [] if seq is None or (peer is not None and seq.peer != peer) else [seq]

    def _live(self) -> Iterable[Sequence]:
        return self.scheduler.sequences() + self.constraints.waiting()

    def _end_aborted(self, records: list[Sequence]) -> None:
        for seq in records:
            if self.scheduler.abort(seq.request_id) is None:  # waiting for its grammar
                self._end_unscheduled(seq, FinishReason.ABORT)
            self._finished(seq)

    def _end_unscheduled(
        self, seq: Sequence, reason: FinishReason, error: str | None = None
    ) -> None:
        """Finish a request the scheduler never got (it waited for its grammar)."""
        self.constraints.release(seq.request_id)
        seq.finish_reason = reason
        seq.error = error
        seq.transition(SequenceStatus.FINISHED)

    # -- the step --------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._pending) or bool(self.constraints.num_waiting)

    def step(self, now: float | None = None) -> list[PeerOutput]:
        """One step of continuous batching; returns (peer, output) pairs.

        At most one output per request: its new tokens (and logprobs), and
        its finish reason when it ended. ``now`` is the wall-clock time that
        deadlines are checked against (default ``time.time()``). Blocks for
        one forward pass. Raises only for a failure of the whole batch (the
        forward pass, the device), which is fatal.
        """
        now = time.time() if now is None else now
        for seq in self.scheduler.expire(now):  # 1 end expired requests
            self._finished(seq)
        self._take_compiled(now)  # 1b compiled grammars join the queue
        news = self._sample_held()  # 1c rows whose late mask is ready get their token
        self._end_complete_grammars(news)
        chunks = self.scheduler.schedule()  # 2 schedule (allocates KV)
        if chunks:
            to_sample = [c.seq for c in chunks if c.sample]
            logits = self._forward(chunks)  # 3 ONE forward pass (fatal if it raises)
            sampled, failed = self._sample(to_sample, logits)  # 4 sample; late masks: held
            news += failed + self.scheduler.update(chunks, sampled, self._held)  # 5 update
        elif self.constraints.num_waiting or self._held:
            self.constraints.wait(_IDLE_COMPILE_WAIT)  # nothing to run: do not spin
        self._end_complete_grammars(news)
        outputs = self._take_pending()
        # One output per sequence: failed ones are skipped by update(); a row
        # sampled late in 1c may sample again in 4 (its output holds both tokens).
        outputs += [(seq.peer, self._output(seq)) for seq in dict.fromkeys(news)]  # 6 outputs
        return outputs

    def _forward(self, chunks: list[ScheduledChunk]) -> Any:
        """The sampled rows' logits: a numpy array (the native runner's) or a torch tensor."""
        self._count_step()
        return self.runner.execute(chunks)

    def _take_compiled(self, now: float) -> None:
        """Requests whose grammar is ready go to the scheduler; those whose grammar
        failed or timed out, or whose deadline passed while they waited, end."""
        ready, failed = self.constraints.take_ready(now)
        for seq in ready:
            self.scheduler.add(seq)  # valid, and its id unique: _queue
        for seq, error in failed:
            self._end_unscheduled(seq, FinishReason.ERROR, error)
            seq.error_param = "constraint"
            self._finished(seq)
        for seq in self.constraints.waiting():
            if seq.deadline is not None and seq.deadline <= now:
                self._end_unscheduled(seq, FinishReason.ABORT)
                self._finished(seq)

    def _end_complete_grammars(self, news: list[Sequence]) -> None:
        """End with STOP the requests whose grammar takes no more tokens."""
        for seq in news:
            if not seq.is_finished and self.constraints.finished(seq.request_id):
                self.scheduler.finish_stopped(seq.request_id)

    def _sample(
        self, to_sample: list[Sequence], logits: Any
    ) -> tuple[dict[str, int], list[Sequence]]:
        """Sampled token per request id, and the requests that failed alone (now finished).

        ``logits [N, V]``: a numpy array, or a torch tensor on any device in any
        float dtype (brought to a CPU float32 array: zero-copy when it is one
        already). A constrained row is masked by its grammar; one whose mask is
        not ready is held (``self._held``: its logits row kept) and gets no token.
        """
        if not isinstance(logits, np.ndarray) and hasattr(logits, "numpy"):
            logits = logits.float().cpu().numpy()  # a torch tensor, named without torch
        array = np.asarray(logits, dtype=np.float32)
        rows: list[int] = []
        masks: list[Mask | None] = []
        failed: list[Sequence] = []
        for row, seq in enumerate(to_sample):
            self._held.pop(seq.request_id, None)  # recomputed after a preemption: sampled now
            mask = None
            if self.constraints.constrained(seq.request_id):
                mask = self.constraints.mask(seq.request_id)
                if mask is None:
                    self._held[seq.request_id] = array[row].copy()
                    continue
                if mask.error is not None:
                    self._fail(seq, mask.error, "constraint")
                    failed.append(seq)
                    continue
            rows.append(row)
            masks.append(mask)
        if len(rows) < len(to_sample):
            array = array[rows]
        sampled, more = self._sample_rows([to_sample[r] for r in rows], array, masks)
        return sampled, failed + more

    def _sample_held(self) -> list[Sequence]:
        """Step 1c: sample the held rows whose mask is now ready (or failed), and
        record their tokens; the sequences with news."""
        news: list[Sequence] = []
        for request_id in list(self._held):
            seq = self.scheduler.get(request_id)
            assert seq is not None, "an ended request is never held (_fail, _output)"
            mask = self.constraints.mask(request_id)
            if mask is None:
                continue  # still computing: held on
            logits = self._held.pop(request_id)
            if mask.error is not None:
                self._fail(seq, mask.error, "constraint")
                news.append(seq)
                continue
            sampled, failed = self._sample_rows([seq], logits[None, :], [mask])
            news += failed
            if request_id in sampled:
                self.scheduler.append_token(request_id, sampled[request_id])
                news.append(seq)
        return news

    def _sample_rows(
        self, seqs: list[Sequence], logits: Any, masks: list[Mask | None]
    ) -> tuple[dict[str, int], list[Sequence]]:
        """Sample ``seqs`` (row i of ``logits`` is ``seqs[i]``'s) with their masks,
        and feed each constrained token to its matcher; a failing request ends."""
        allowed = {
            i: m.allowed for i, m in enumerate(masks) if m is not None and m.allowed is not None
        }
        results = self.sampler.sample(logits, seqs, allowed)
        sampled: dict[str, int] = {}
        failed: list[Sequence] = []
        for seq, result in zip(seqs, results, strict=True):
            error, param = result.error, None
            if error is None and result.token_id is not None:
                error = self.constraints.advance(seq.request_id, result.token_id)
                param = "constraint"
            if error is not None or result.token_id is None:
                self._fail(seq, error or "no token", param)
                failed.append(seq)
                continue
            sampled[seq.request_id] = result.token_id
            if result.logprob is not None:
                self._logprobs.setdefault(seq.request_id, []).append(result.logprob)
        return sampled, failed

    def _fail(self, seq: Sequence, error: str, param: str | None) -> None:
        """End one scheduled request with ERROR (``param``: what the error is about)."""
        self.scheduler.finish_with_error(seq.request_id, error)
        seq.error_param = param
        self._held.pop(seq.request_id, None)

    def prepare_grammars(self) -> None:
        """Build llguidance's tokenizer now (GrammarCompiler.prepare). Blocks."""
        self.constraints.compiler.prepare()

    def close(self) -> None:
        """Stop the grammar compile and mask threads: queued compiles are dropped;
        the interpreter's exit waits for the one compile in flight, if any."""
        self.constraints.close()

    def stats(self) -> EngineStats:
        return EngineStats(
            running=self.scheduler.num_running,
            waiting=self.scheduler.num_waiting + self.constraints.num_waiting,
            kv_tokens_used=self.blocks.tokens_used,
            kv_tokens_total=self.blocks.tokens_total,
            steps=self._steps,
            aborts_received=self._aborts_received,
            prefix_cache_queries=self.blocks.prefix_cache_queries,
            prefix_cache_hits=self.blocks.prefix_cache_hits,
        )

    def progress(self) -> int:
        """Steps begun and layers the runner finished (read by the pulse thread)."""
        return super().progress() + int(self.runner.progress[0])

    def _kv_tokens_total(self) -> int:
        return self.blocks.tokens_total

    def _kv_block_size(self) -> int:
        return self.blocks.block_size

    # -- internals -------------------------------------------------------------

    def _check(self, request: AddRequest) -> str | None:
        """The request's problem by the rule the API process applies first (``tserve.validity``)."""
        problem = generation_problem(
            request.prompt_token_ids,
            request.params,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
        )
        return None if problem is None else problem.message

    def _finished(self, seq: Sequence) -> None:
        """Report a sequence that ended outside update() (abort, expiry, error)."""
        self._report(seq.peer, self._output(seq))

    def _output(self, seq: Sequence) -> RequestOutput:
        new = seq.output_token_ids[seq.num_sent :]
        cached = seq.num_cached_prompt_tokens if new and seq.num_sent == 0 else None
        seq.num_sent = len(seq.output_token_ids)
        logprobs = None
        if seq.params.logprobs is not None:
            held = self._logprobs.pop(seq.request_id, [])
            logprobs = held[-len(new) :] if new else []
        if seq.is_finished:
            self._logprobs.pop(seq.request_id, None)
            self.sampler.release(seq.request_id)
            self.constraints.release(seq.request_id)
        if seq.is_finished:
            self._held.pop(seq.request_id, None)
        return RequestOutput(
            seq.request_id,
            new,
            seq.finish_reason,
            logprobs,
            seq.error,
            None,
            seq.error_param,
            cached,
        )


def _tokenizer_json(tokenizer: object, model_dir: Path) -> str:
    """The text of the model's ``tokenizer.json`` as its loaded tokenizer has it
    (the config's added tokens included), for llguidance; the file's when the
    tokenizer is not a fast one. Blocking file IO, once."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return str(backend.to_str())
    path = model_dir / "tokenizer.json"
    return path.read_text(encoding="utf-8") if path.is_file() else "{}"


def _capacity(blocks: BlockManager, groups: KVGroups, group_bytes: int, dtype: str) -> str:
    """The KV cache for the startup line: its tokens of every layer, its dtype
    and size, and with sliding-window groups the longest sequence it holds
    alone (their blocks behind the window go back to the pool)."""
    slots = blocks.num_blocks * blocks.block_size
    mib = slots * group_bytes / 2**20
    line = f"{slots // groups.num_groups} KV tokens ({dtype}, {mib:.0f} MiB"
    if not any(groups.windows):
        return line + ")"
    longest = blocks.max_positions
    reach = "any length" if longest == sys.maxsize else f"{longest} tokens"
    return f"{line}; {groups.describe()}: one sequence may reach {reach})"
