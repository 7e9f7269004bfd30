"""Structured outputs in the engine: each constrained request's matcher and masks.

:class:`Constraints` holds each constrained request's matcher (compiled by
``_compiler.py``'s :class:`~tserve.gpu.sampling._compiler.GrammarCompiler`)
and answers the step loop's three questions: which requests are ready to
run, each constrained row's mask, and whether a sampled token is accepted
and ends the grammar.

Rules:

* A constrained request is not scheduled until its matcher is ready; it waits
  here, not in the scheduler, so it never holds back anyone's step. Each
  request (each of ``n > 1`` choices) gets its own copy of the compiled
  matcher.
* A constraint that cannot become a grammar, a grammar that fails to compile,
  that can write nothing
  (``tserve.grammar.start_problem``: it accepts no string, or only the empty
  one), or is not compiled ``compile_timeout`` seconds after its request
  arrived, ends that request with an error before its first token.
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

import concurrent.futures
import dataclasses
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Final

import numpy as np
import numpy.typing as npt

from tserve.gpu.sampling._compiler import GrammarCompiler, constraint_key
from tserve.gpu.scheduling._sequence import Sequence as Seq
from tserve.grammar import first_line
from tserve.sampling import Constraint

if TYPE_CHECKING:  # imported where used: an engine that constrains nothing never needs it
    import llguidance

__all__ = [
    "MASK_FAULT_ENV",
    "MASK_HOLD_ENV",
    "MASK_MISSES",
    "Constraints",
    "Mask",
    "mask_threads",
]

MASK_FAULT_ENV: Final = "TSERVE_TEST_FAULT_MASK"
MASK_HOLD_ENV: Final = "TSERVE_TEST_FAULT_MASK_HOLD"

MASK_MISSES: Final = 8
"""Masks in a row over the budget before a grammar is ended."""


def mask_threads(engine_threads: int, cores: int) -> int:
    """Mask threads beside a forward pass on ``engine_threads`` of ``cores``
    cores: the cores it leaves, at least one."""
    return max(1, cores - engine_threads)


def _usable_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


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
