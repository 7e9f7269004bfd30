"""Structured outputs in the engine: grammars compiled off the step loop, masks, matchers.

:class:`GrammarCompiler` compiles constraints in ONE worker thread (the
grammar text, ``tserve.grammar.grammar_text``, made in a second thread, then
llguidance's matcher) and keeps the compiled ones in a bounded LRU cache
keyed by the constraint's wire encoding, so the step loop only encodes it (a
fraction of a millisecond for a 128-tool schema; the text takes milliseconds).
:class:`Constraints` holds each constrained request's matcher and answers
the step loop's three questions: which requests are ready to run, each
constrained row's mask, and whether a sampled token is accepted and ends the
grammar.

Rules:

* A constrained request is not scheduled until its matcher is ready; it waits
  here, not in the scheduler, so it never holds back anyone's step. A
  constraint is compiled once however many requests (``n > 1`` choices) ask
  for it; each request gets its own copy of the compiled matcher.
* A constraint that cannot become a grammar, a grammar that fails to compile,
  that can write nothing
  (``tserve.grammar.start_problem``: it accepts no string, or only the empty
  one), or is not compiled ``compile_timeout`` seconds after its request
  arrived, ends that request with an error before its first token. A failed
  grammar is cached with its error, so the same constraint fails the same way
  again. The thread cannot be stopped: a compile that runs late finishes and
  is cached (llguidance's own limits bound its work), and the compiles
  behind it wait.
* A matcher has consumed exactly its sequence's output tokens. Preemption
  keeps a sequence's outputs (it is recomputed as a prefill of prompt +
  outputs), so the matcher stays in step with no rollback.
* A row's next mask starts in a mask thread as soon as its token is consumed
  (its first as soon as it is compiled), so it overlaps the next forward
  pass. The mask threads are bounded by the cores the forward pass leaves
  (:func:`mask_threads`: one on two cores with one engine thread), so masks
  cannot take every core from it; a row whose last mask took longer than the
  budget computes its next in one slow-lane thread of its own, so a slow
  grammar queues no other row's masks behind it for more than one mask.
  A mask that is not ready when the step samples leaves that row out:
  the engine keeps its logits and samples it in a later step; nobody else
  waits. The mask budget (``mask_budget`` s a token) is enforced per row:
  :data:`MASK_MISSES` masks in a row that took longer to compute end the
  request with an error (one mask's work is bounded by llguidance's limits).
* The mask of a row allows only token ids below the tokenizer's vocabulary;
  the model's padding rows (logits wider than the vocabulary) are never
  allowed. A matcher in its error state, a mask that allows nothing, or an
  EOS sampled before the grammar is complete, ends that request with an
  error; nothing here fails a step.

Test-only fault injection: when the environment variable
``TSERVE_TEST_FAULT_MASK`` holds a regular expression when a
:class:`Constraints` is built, the rows of requests whose id it matches
(``re.search``) get no mask, so their tokens reach the matcher unchecked.
A second hook, ``TSERVE_TEST_FAULT_MASK_HOLD`` = ``REGEX:DIR``, holds the
mask of every request whose id matches in its thread (after creating
``DIR/held``) until ``DIR/release`` exists: a slow grammar on demand. Both
are unset in production and nothing over HTTP or the wire can set them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final, TypeAlias

import msgspec
import numpy as np
import numpy.typing as npt

from tserve._host import lower_thread_priority
from tserve.gpu.kernels._heap import trim_heap
from tserve.gpu.scheduling._sequence import Sequence as Seq
from tserve.grammar import first_line, grammar_text, llg_tokenizer, start_problem
from tserve.grammar import matcher as new_matcher
from tserve.sampling import Constraint

if TYPE_CHECKING:  # imported where used: an engine that constrains nothing never needs it
    import llguidance

__all__ = [
    "MASK_FAULT_ENV",
    "MASK_HOLD_ENV",
    "MASK_MISSES",
    "Constraints",
    "GrammarCompiler",
    "Mask",
    "constraint_key",
    "mask_threads",
]

log = logging.getLogger(__name__)

MASK_FAULT_ENV: Final = "TSERVE_TEST_FAULT_MASK"
MASK_HOLD_ENV: Final = "TSERVE_TEST_FAULT_MASK_HOLD"

MASK_MISSES: Final = 8
"""Masks in a row over the budget before a grammar is ended."""

Compiled: TypeAlias = "llguidance.LLMatcher | str"
"""A compiled grammar's matcher at its start, or why it did not compile."""

_ENCODE: Final = msgspec.msgpack.Encoder().encode


def mask_threads(engine_threads: int, cores: int) -> int:
    """Mask threads beside a forward pass on ``engine_threads`` of ``cores``
    cores: the cores it leaves, at least one."""
    return max(1, cores - engine_threads)


def _usable_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def constraint_key(constraint: Constraint) -> bytes:
    """The compile cache's key for ``constraint``: its wire encoding. Equal
    constraints give equal keys (a schema's keys in another order give another
    key: a second compile of the same grammar, never a wrong one)."""
    return _ENCODE(constraint)


class GrammarCompiler:
    """Constraints to matchers, compiled in one worker thread. Not thread-safe:
    one owner (the step loop) calls it; only the compile runs in the thread.

    The llguidance tokenizer is built in the same thread, before the first
    compile: building it holds the GIL (a fraction of a second for a 50k
    vocabulary, seconds on a busy machine), so an engine that serves no
    constrained request never builds it, and its start, its ready reply and
    its first steps never wait for it. The first constrained request does,
    unless :meth:`prepare` built it before (an API process that serves this
    model alone asks for that in its Hello, before it serves anyone).

    The compile thread runs at a lower priority (``lower_thread_priority``)
    and holds the GIL only between llguidance's calls, which release it: a
    low-priority thread that holds the GIL while a busy machine keeps it off
    the CPU keeps the step loop waiting for as long. So the grammar text,
    Python over the whole schema (milliseconds for a 128-tool one), is made
    in a second thread at the process's own priority, which the compile
    thread waits for.
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
        self.eos_token_ids = frozenset(eos_token_ids)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="tserve-grammar", initializer=lower_thread_priority
        )
        # The tokenizer's build, once asked for (_built); its text until then.
        self._tokenizer: concurrent.futures.Future[llguidance.LLTokenizer] | None = None
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos_order = tuple(eos_token_ids)
        # The grammar texts. Bound: one at a time, for the one compile running.
        self._texts = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="tserve-grammar-text"
        )
        # Compiled grammars by constraint_key, least recently used first.
        # Bound: cache_size entries; at the bound the least recently used is
        # dropped (a later request for it compiles it again).
        self._cache: collections.OrderedDict[bytes, Compiled] = collections.OrderedDict()
        self._cache_size = cache_size
        # Compiles queued or running, by constraint_key. Bound: the distinct
        # constraints of the requests waiting here (the API's admission caps those).
        self._running: dict[bytes, concurrent.futures.Future[Compiled]] = {}

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer. Blocks until it is built; raises ValueError if it cannot be."""
        return self._built().result()

    @property
    def tokenizer_built(self) -> bool:
        """Whether llguidance's tokenizer is built (or failed to be). Never blocks."""
        return self._tokenizer is not None and self._tokenizer.done()

    def prepare(self) -> None:
        """Build the tokenizer now. Blocks until it is built; one that cannot be
        is left for the first compile to report. Idempotent."""
        with contextlib.suppress(ValueError):
            self._built().result()

    def _built(self) -> concurrent.futures.Future[llguidance.LLTokenizer]:
        """The tokenizer's build in the worker thread, queued on the first call."""
        if self._tokenizer is None:
            self._tokenizer = self._pool.submit(
                llg_tokenizer,
                self._tokenizer_json,
                vocab_size=self._vocab_size,
                eos_token_ids=self._eos_order,
            )
            self._tokenizer_json = ""
            # What building it freed (its parse: tens of MB for a 50k vocabulary) goes
            # back to the kernel, as the engine's own load garbage does (_heap.py).
            self._pool.submit(trim_heap)
        return self._tokenizer

    def start(self, key: bytes, constraint: Constraint) -> None:
        """Queue the compile of ``constraint`` (``key``: its :func:`constraint_key`)
        unless it is cached or queued. Never blocks."""
        if key in self._cache:
            self._cache.move_to_end(key)
        elif key not in self._running:
            self._built()
            self._running[key] = self._pool.submit(self._compile, constraint)

    def result(self, key: bytes, constraint: Constraint) -> Compiled | None:
        """``constraint``'s matcher (a fresh copy, at its start) or its error; None
        while it compiles. Never blocks. ``start`` it first (and with the same key)."""
        future = self._running.get(key)
        if future is not None:
            if not future.done():
                return None
            del self._running[key]
            self._remember(key, future.result())
        compiled = self._cache.get(key)
        if compiled is None:  # dropped from the cache since: compile it again
            self.start(key, constraint)
            return None
        self._cache.move_to_end(key)
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
        self._texts.shutdown(wait=False, cancel_futures=True)

    def _remember(self, key: bytes, compiled: Compiled) -> None:
        self._cache[key] = compiled
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def _compile(self, constraint: Constraint) -> Compiled:
        """In the worker thread: the matcher of ``constraint``, or why it cannot
        become a grammar, be built, or write anything (``start_problem``, on a copy).
        Blocks while the text thread makes the grammar text."""
        try:
            text = self._texts.submit(grammar_text, constraint).result()
        except (ValueError, RecursionError) as exc:
            return f"the constraint is invalid: {exc}"
        try:
            matcher = new_matcher(self.tokenizer, text)
            if matcher.is_error():
                return f"the grammar does not compile: {matcher.get_error().strip()}"
            problem = start_problem(matcher.deep_copy(), self.tokenizer)
        except Exception as exc:  # llguidance's or the tokenizer's error, whatever its type
            return f"{type(exc).__name__}: {exc}"
        return matcher if problem is None else problem


@dataclasses.dataclass(slots=True)
class _Waiting:
    seq: Seq
    constraint: Constraint  # seq's
    key: bytes  # constraint_key(constraint)
    since: float  # wall-clock time of its arrival (the clock deadlines use)


@dataclasses.dataclass(frozen=True, slots=True)
class Mask:
    """A constrained row's mask for its next token, once it is computed."""

    allowed: npt.NDArray[np.bool_] | None  # bool [vocab_size]; None: unmasked (test hook only)
    error: str | None = None  # the grammar cannot go on: end the request with this
    seconds: float = 0.0  # how long the mask took to compute


@dataclasses.dataclass(slots=True)
class _Row:
    """One scheduled constrained request: its matcher and its next token's mask.

    Invariant: while ``mask`` is not done, the mask thread owns ``matcher``
    and nothing else touches it; a token is consumed only after it is done.
    """

    matcher: llguidance.LLMatcher
    mask: concurrent.futures.Future[Mask] | None = None  # None: the grammar is complete
    misses: int = 0  # masks in a row that took longer than the budget
    slow: bool = False  # its last mask took longer than the budget: the slow lane


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
        mask_budget: float = 0.05,
        threads: int = 1,
    ) -> None:
        if mask_budget <= 0:
            raise ValueError(f"grammar_mask_budget must be > 0, got {mask_budget}")
        self.compiler = compiler
        self.compile_timeout = compile_timeout
        self.mask_budget = mask_budget
        self.vocab_size = vocab_size  # the model's: the width of its logits
        # Requests waiting for their grammar, in arrival order. Bound: the
        # constrained requests the API processes have live (admission).
        self._waiting: dict[str, _Waiting] = {}
        # Every constrained request in the scheduler. Bound: the same.
        self._matchers: dict[str, _Row] = {}
        # Masks are computed here (llguidance releases the GIL), at the
        # process's priority: a constrained row's pace depends on them (the
        # budget ends a grammar whose masks stay slow). Bound: one queued or
        # running mask per constrained row; mask_threads() threads, the cores
        # the forward pass leaves, so that masks never take all of them.
        self.mask_threads = mask_threads(threads, _usable_cores())
        self._mask_threads = concurrent.futures.ThreadPoolExecutor(
            self.mask_threads, thread_name_prefix="tserve-masks"
        )
        # The masks of rows whose last mask ran over the budget, one at a time,
        # so that a slow grammar does not queue the others' masks behind it.
        self._slow_lane = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="tserve-masks-slow"
        )
        # Masks started in each lane so far (tests and benchmarks read them).
        self.masks_started = {"fast": 0, "slow": 0}
        pattern = os.environ.get(MASK_FAULT_ENV)
        self._fault = re.compile(pattern) if pattern else None
        self._hold = _MaskHold.from_env()

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

    def constrained(self, request_id: str) -> bool:
        """Whether ``request_id`` is a scheduled request with a matcher."""
        return request_id in self._matchers

    def add(self, seq: Seq, now: float) -> str | None:
        """Start on ``seq``'s grammar; it becomes ready, or fails, in a later
        :meth:`take_ready`. ``seq.params.constraint`` is set. Never blocks: the
        grammar text is made in the compile thread.

        Returns an error (nothing is kept) for a constraint nested too deeply
        to encode as a cache key (it could not become a grammar either).
        """
        constraint = seq.params.constraint
        assert constraint is not None
        try:
            key = constraint_key(constraint)
        except RecursionError as exc:
            return f"the constraint is invalid: {exc}"
        self.compiler.start(key, constraint)
        self._waiting[seq.request_id] = _Waiting(seq, constraint, key, now)
        return None

    def take_ready(self, now: float) -> tuple[list[Seq], list[tuple[Seq, str]]]:
        """The waiting requests whose matcher is ready (now holding it, its first
        mask started), and those that failed (compile error, a grammar that can
        write nothing, or still compiling ``compile_timeout`` s after they
        arrived) with why; both leave the waiting list. Never blocks."""
        ready: list[Seq] = []
        failed: list[tuple[Seq, str]] = []
        for request_id, waiting in list(self._waiting.items()):
            compiled = self.compiler.result(waiting.key, waiting.constraint)
            if compiled is None:
                if now - waiting.since <= self.compile_timeout:
                    continue
                compiled = f"the grammar did not compile within {self.compile_timeout:g} s"
            del self._waiting[request_id]
            if isinstance(compiled, str):
                failed.append((waiting.seq, compiled))
            else:
                row = self._matchers[request_id] = _Row(compiled)
                self._start_mask(request_id, row)
                ready.append(waiting.seq)
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until a compile or a mask finishes, or ``timeout`` s (for a step
        with nothing to run)."""
        pending = [r.mask for r in self._matchers.values() if r.mask and not r.mask.done()]
        if pending:
            concurrent.futures.wait(
                pending, timeout, return_when=concurrent.futures.FIRST_COMPLETED
            )
        else:
            self.compiler.wait(timeout)

    def release(self, request_id: str) -> None:
        """Forget a request that ended (its matcher or its wait). Idempotent.
        A mask still computing for it finishes in its thread and is dropped."""
        self._waiting.pop(request_id, None)
        self._matchers.pop(request_id, None)

    def mask(self, request_id: str) -> Mask | None:
        """The mask of ``request_id``'s next token (a constrained request's), or
        None while it is computed: the row waits, its logits kept, and others
        go on. Never blocks.

        The budget: a mask that took longer than ``mask_budget`` to compute is
        a miss; :data:`MASK_MISSES` misses in a row end the request with an
        error. One mask's work is bounded by llguidance's own limits.
        """
        row = self._matchers[request_id]
        future = row.mask
        assert future is not None, "a complete grammar samples no more tokens"
        if not future.done():
            return None
        mask = future.result()
        row.slow = mask.seconds > self.mask_budget
        row.misses = row.misses + 1 if row.slow else 0
        if mask.error is None and row.misses >= MASK_MISSES:
            return Mask(None, self._over_budget())
        return mask

    def matcher(self, request_id: str) -> llguidance.LLMatcher:
        """A constrained request's matcher; touch it only while its mask is done."""
        return self._matchers[request_id].matcher

    def wait_mask(self, request_id: str) -> Mask | None:
        """:meth:`mask` once the mask is computed: blocks while it is (benchmarks, tests)."""
        future = self._matchers[request_id].mask
        if future is not None:
            concurrent.futures.wait([future])
        return self.mask(request_id)

    def advance(self, request_id: str, token: int) -> str | None:
        """Feed a sampled token to the request's matcher (if it has one) and start
        the next token's mask; the error when the grammar rejects the token, or
        the token is an EOS before the grammar is complete, else None. Call it
        only once :meth:`mask` gave the row's mask."""
        row = self._matchers.get(request_id)
        if row is None:
            return None
        matcher = row.matcher
        if token in self.compiler.eos_token_ids and not matcher.is_accepting():
            return "the output ended before its grammar was complete"
        if not matcher.consume_token(token):
            return f"the grammar rejected token {token}: {first_line(matcher.get_error())}"
        self._start_mask(request_id, row)
        return None

    def finished(self, request_id: str) -> bool:
        """Whether the request's grammar is complete and takes no more tokens."""
        row = self._matchers.get(request_id)
        return row is not None and row.mask is None

    def close(self) -> None:
        """Stop the mask threads and the compiler's (see :meth:`GrammarCompiler.close`)."""
        self._mask_threads.shutdown(wait=False, cancel_futures=True)
        self._slow_lane.shutdown(wait=False, cancel_futures=True)
        self.compiler.close()

    def _over_budget(self) -> str:
        return (
            f"the grammar is too slow: its masks took longer than the budget for "
            f"{MASK_MISSES} tokens in a row ({self.mask_budget * 1000:g} ms a token, "
            f"--grammar-mask-budget)"
        )

    def _start_mask(self, request_id: str, row: _Row) -> None:
        """Start the next mask of ``row`` in a mask thread (none once the grammar is complete)."""
        if row.matcher.is_stopped() and not row.matcher.is_error():
            row.mask = None
            return
        if self._fault is not None and self._fault.search(request_id):
            row.mask = concurrent.futures.Future()
            row.mask.set_result(Mask(None))
            return
        lane = "slow" if row.slow else "fast"
        self.masks_started[lane] += 1
        pool = self._slow_lane if row.slow else self._mask_threads
        row.mask = pool.submit(self._compute, request_id, row.matcher)

    def _compute(self, request_id: str, matcher: llguidance.LLMatcher) -> Mask:
        """In a mask thread: one matcher's mask (the GIL released while llguidance works)."""
        start = time.perf_counter()
        if self._hold is not None:
            self._hold.wait(request_id)
        bits = np.frombuffer(matcher.compute_bitmask(), dtype="<i4")
        seconds = time.perf_counter() - start
        if matcher.is_error():
            error = f"the grammar failed: {first_line(matcher.get_error())}"
            return Mask(None, error, seconds)
        allowed = _unpack(bits[None, :], self.vocab_size)[0]
        if not allowed.any():
            return Mask(None, "the grammar allows no token of this model here", seconds)
        return Mask(allowed, None, seconds)


class _MaskHold:
    """The test-only mask hold hook (module docstring)."""

    POLL = 0.01  # s between looks at DIR/release

    def __init__(self, pattern: re.Pattern[str], directory: Path) -> None:
        self.pattern, self.directory = pattern, directory

    @classmethod
    def from_env(cls) -> _MaskHold | None:
        value = os.environ.get(MASK_HOLD_ENV)
        if not value:
            return None
        pattern, directory = value.rsplit(":", 1)
        return cls(re.compile(pattern), Path(directory))

    def wait(self, request_id: str) -> None:
        """Block a matching request's mask until ``DIR/release`` exists."""
        if not self.pattern.search(request_id):
            return
        (self.directory / "held").touch()
        while not (self.directory / "release").exists():
            time.sleep(self.POLL)


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
