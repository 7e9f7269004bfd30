"""Structured outputs in the engine: grammars compiled off the step loop, masks, matchers.

:class:`GrammarCompiler` compiles llguidance grammars in ONE worker thread and
keeps the compiled ones in a bounded LRU cache keyed by the grammar text
(``tserve.grammar.grammar_text``). :class:`Constraints` holds each
constrained request's matcher and answers the step loop's three questions:
which requests are ready to run, each constrained row's mask, and whether a
sampled token is accepted and ends the grammar.

Rules:

* A constrained request is not scheduled until its matcher is ready; it waits
  here, not in the scheduler, so it never holds back anyone's step. The
  grammar text is compiled once however many requests (``n > 1`` choices) ask
  for it; each request gets its own copy of the compiled matcher.
* A grammar that fails to compile, or is not compiled ``compile_timeout``
  seconds after its request arrived, ends that request with an error. The
  thread cannot be stopped: a compile that runs late finishes and is cached
  (llguidance's own limits bound its work), and the compiles behind it wait.
* A matcher has consumed exactly its sequence's output tokens. Preemption
  keeps a sequence's outputs (it is recomputed as a prefill of prompt +
  outputs), so the matcher stays in step with no rollback.
* Each step's masks are filled in one mask thread while the model runs
  (llguidance's parallel fill, the GIL released), and waited for before
  sampling; meanwhile the step loop touches no matcher.
* The mask of a row allows only token ids below the tokenizer's vocabulary;
  the model's padding rows (logits wider than the vocabulary) are never
  allowed. A matcher in its error state, or a mask that allows nothing,
  ends that request with an error; nothing here fails a step.

Test-only fault injection: when the environment variable
``TSERVE_TEST_FAULT_MASK`` holds a regular expression when a
:class:`Constraints` is built, the rows of requests whose id it matches
(``re.search``) get no mask, so their tokens reach the matcher unchecked.
It is unset in production and nothing over HTTP or the wire can set it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import os
import re
from collections.abc import Callable, Sequence
from typing import Final

import llguidance
import numpy as np
import numpy.typing as npt

from tserve.gpu._heap import trim_heap
from tserve.gpu._sequence import Sequence as Seq
from tserve.grammar import grammar_text, llg_tokenizer

__all__ = ["MASK_FAULT_ENV", "Constraints", "GrammarCompiler"]

log = logging.getLogger(__name__)

MASK_FAULT_ENV: Final = "TSERVE_TEST_FAULT_MASK"

Compiled = llguidance.LLMatcher | str
"""A compiled grammar's matcher at its start, or why it did not compile."""

MaskResult = tuple[dict[int, npt.NDArray[np.bool_]], dict[int, str]]
"""Row -> allowed tokens (numpy bool ``[vocab]``), and row -> why its grammar cannot go on."""


class GrammarCompiler:
    """Grammar texts to matchers, compiled in one worker thread. Not thread-safe:
    one owner (the step loop) calls it; only the compile runs in the thread.

    The llguidance tokenizer is built in the same thread first (a fraction of
    a second for a 50k vocabulary), so neither start-up nor a step waits for it.
    """

    def __init__(
        self,
        tokenizer_json: str,
        *,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int,
    ) -> None:
        if cache_size < 1:
            raise ValueError(f"grammar_cache_size must be >= 1, got {cache_size}")
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tserve-grammar")
        self._tokenizer = self._pool.submit(
            llg_tokenizer, tokenizer_json, vocab_size=vocab_size, eos_token_ids=eos_token_ids
        )
        # What building it freed (its parse: tens of MB for a 50k vocabulary) goes
        # back to the kernel, as the engine's own load garbage does (_heap.py).
        self._pool.submit(trim_heap)
        # Compiled grammars by text, least recently used first. Bound:
        # cache_size entries; at the bound the least recently used is dropped
        # (a later request for it compiles it again).
        self._cache: collections.OrderedDict[str, Compiled] = collections.OrderedDict()
        self._cache_size = cache_size
        # Compiles queued or running, by text. Bound: the distinct grammars of
        # the requests waiting here (the API's admission caps those).
        self._running: dict[str, concurrent.futures.Future[Compiled]] = {}

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer. Blocks until it is built; raises ValueError if it cannot be."""
        return self._tokenizer.result()

    def start(self, text: str) -> None:
        """Queue the compile of ``text`` unless it is cached or queued. Never blocks."""
        if text in self._cache:
            self._cache.move_to_end(text)
        elif text not in self._running:
            self._running[text] = self._pool.submit(self._compile, text)

    def result(self, text: str) -> Compiled | None:
        """``text``'s matcher (a fresh copy, at its start) or its error; None while
        it compiles. Never blocks. ``start`` it first."""
        future = self._running.get(text)
        if future is not None:
            if not future.done():
                return None
            del self._running[text]
            self._remember(text, future.result())
        compiled = self._cache.get(text)
        if compiled is None:  # dropped from the cache since: compile it again
            self.start(text)
            return None
        self._cache.move_to_end(text)
        return compiled if isinstance(compiled, str) else compiled.deep_copy()

    def wait(self, timeout: float) -> None:
        """Block until a queued compile finishes, or ``timeout`` s pass."""
        if self._running:
            concurrent.futures.wait(
                self._running.values(), timeout, return_when=concurrent.futures.FIRST_COMPLETED
            )

    def close(self) -> None:
        """Stop the worker thread once its current compile ends; queued ones are dropped."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _remember(self, text: str, compiled: Compiled) -> None:
        self._cache[text] = compiled
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def _compile(self, text: str) -> Compiled:
        """In the worker thread: the matcher of ``text`` or why it cannot be built."""
        try:
            matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        except Exception as exc:  # llguidance's or the tokenizer's error, whatever its type
            return f"{type(exc).__name__}: {exc}"
        error = matcher.get_error()
        return f"the grammar does not compile: {error}" if error else matcher


@dataclasses.dataclass(slots=True)
class _Waiting:
    seq: Seq
    text: str
    since: float  # wall-clock time of its arrival (the clock deadlines use)


class Constraints:
    """The matchers of the constrained requests, and those still waiting for one.

    Not thread-safe; the step loop owns it. Every request it holds is released
    with :meth:`release` when it ends (idempotent).
    """

    def __init__(
        self,
        compiler: GrammarCompiler,
        *,
        compile_timeout: float,
        vocab_size: int,
        threads: int = 1,
    ) -> None:
        self.compiler = compiler
        self.compile_timeout = compile_timeout
        self.vocab_size = vocab_size  # the model's: the width of its logits
        # Requests waiting for their grammar, in arrival order. Bound: the
        # constrained requests the API processes have live (admission).
        self._waiting: dict[str, _Waiting] = {}
        # The matcher of every constrained request in the scheduler. Bound: the same.
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._executor = llguidance.LLExecutor(num_threads=max(1, threads))
        # One fill at a time (one step's); bound: one queued job.
        self._mask_thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="tserve-masks"
        )
        pattern = os.environ.get(MASK_FAULT_ENV)
        self._fault = re.compile(pattern) if pattern else None

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def waiting(self) -> list[Seq]:
        """The requests waiting for their grammar, a copy, oldest first."""
        return [w.seq for w in self._waiting.values()]

    def get_waiting(self, request_id: str) -> Seq | None:
        """The request with this id waiting for its grammar, or None."""
        waiting = self._waiting.get(request_id)
        return None if waiting is None else waiting.seq

    def has(self, request_id: str) -> bool:
        """Whether ``request_id`` waits here or has a matcher."""
        return request_id in self._waiting or request_id in self._matchers

    def add(self, seq: Seq, now: float) -> str | None:
        """Start on ``seq``'s grammar; it becomes ready in a later :meth:`take_ready`.

        Returns an error (nothing is kept) when the constraint cannot become a
        grammar at all. ``seq.params.constraint`` is set. Never blocks.
        """
        assert seq.params.constraint is not None
        try:
            text = grammar_text(seq.params.constraint)
        except (ValueError, RecursionError) as exc:
            return f"the constraint is invalid: {exc}"
        self.compiler.start(text)
        self._waiting[seq.request_id] = _Waiting(seq, text, now)
        return None

    def take_ready(self, now: float) -> tuple[list[Seq], list[tuple[Seq, str]]]:
        """The waiting requests whose matcher is ready (now holding it), and those
        that failed (compile error, or still compiling ``compile_timeout`` s after
        they arrived) with why; both leave the waiting list. Never blocks."""
        ready: list[Seq] = []
        failed: list[tuple[Seq, str]] = []
        for request_id, waiting in list(self._waiting.items()):
            compiled = self.compiler.result(waiting.text)
            if compiled is None:
                if now - waiting.since <= self.compile_timeout:
                    continue
                compiled = f"the grammar did not compile within {self.compile_timeout:g} s"
            del self._waiting[request_id]
            if isinstance(compiled, str):
                failed.append((waiting.seq, compiled))
            else:
                self._matchers[request_id] = compiled
                ready.append(waiting.seq)
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until a compile finishes, or ``timeout`` s (for a step with nothing to run)."""
        self.compiler.wait(timeout)

    def release(self, request_id: str) -> None:
        """Forget a request that ended (its matcher or its wait). Idempotent."""
        self._waiting.pop(request_id, None)
        self._matchers.pop(request_id, None)

    def start_masks(self, seqs: Sequence[Seq]) -> Callable[[], MaskResult]:
        """Start filling the grammar masks of the constrained rows among ``seqs``
        (row i is ``seqs[i]``) in the mask thread, so that the fill overlaps the
        forward pass; call the result to wait for them. Never blocks.

        The result: row -> bool ``[vocab_size]`` (True = allowed), and row ->
        error for a matcher that cannot go on. Until it is called, nothing may
        touch these matchers (the step loop only runs the model meanwhile).
        Without constrained rows nothing starts.
        """
        rows: list[tuple[int, llguidance.LLMatcher]] = []
        errors: dict[int, str] = {}
        for i, seq in enumerate(seqs):
            matcher = self._matchers.get(seq.request_id)
            if matcher is None or (self._fault is not None and self._fault.search(seq.request_id)):
                continue
            if matcher.is_error():
                errors[i] = f"the grammar failed: {_first_line(matcher.get_error())}"
            else:
                rows.append((i, matcher))
        if not rows:
            return lambda: ({}, errors)
        return self._mask_thread.submit(self._fill, rows, errors).result

    def masks(self, seqs: Sequence[Seq]) -> MaskResult:
        """:meth:`start_masks` and wait for them. Blocks while llguidance fills them."""
        return self.start_masks(seqs)()

    def _fill(
        self, rows: list[tuple[int, llguidance.LLMatcher]], errors: dict[int, str]
    ) -> MaskResult:
        """In the mask thread: llguidance's parallel fill (the GIL released), unpacked."""
        words = (self.compiler.tokenizer.vocab_size + 31) // 32
        bitmask = np.zeros((len(rows), words), dtype="<i4")  # C-contiguous, as llguidance writes it
        pairs = [(matcher, k) for k, (_, matcher) in enumerate(rows)]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.ctypes.data, words * 4, len(rows))
        allowed = _unpack(bitmask, self.vocab_size)
        any_allowed = np.count_nonzero(allowed, axis=1).tolist()
        masks: dict[int, npt.NDArray[np.bool_]] = {}
        for k, (i, _) in enumerate(rows):
            if any_allowed[k]:
                masks[i] = allowed[k]
            else:
                errors[i] = "the grammar allows no token of this model here"
        return masks, errors

    def advance(self, request_id: str, token: int) -> str | None:
        """Feed a sampled token to the request's matcher (if it has one); the
        error when the grammar rejects it, else None."""
        matcher = self._matchers.get(request_id)
        if matcher is None or matcher.consume_token(token):
            return None
        return f"the grammar rejected token {token}: {_first_line(matcher.get_error())}"

    def finished(self, request_id: str) -> bool:
        """Whether the request's grammar is complete and takes no more tokens."""
        matcher = self._matchers.get(request_id)
        return matcher is not None and matcher.is_stopped()

    def close(self) -> None:
        """Stop the mask thread and the compiler's (see :meth:`GrammarCompiler.close`)."""
        self._mask_thread.shutdown(wait=False)
        self.compiler.close()


def _unpack(bitmask: npt.NDArray[np.int32], width: int) -> npt.NDArray[np.bool_]:
    """Bool ``[R, width]`` from llguidance's int32 bitmask ``[R, W]`` (bit i of
    word w = token 32w + i); columns past the mask's tokens are False."""
    words = np.ascontiguousarray(bitmask, dtype="<i4")  # little-endian: byte b of word w
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little").view(np.bool_)
    if bits.shape[1] >= width:
        return bits[:, :width]
    out = np.zeros((bits.shape[0], width), dtype=np.bool_)
    out[:, : bits.shape[1]] = bits
    return out


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "no reason given"
