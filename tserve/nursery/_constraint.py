"""Checking a request's constraint in the API process, off the event loop.

A constraint the grammar engine cannot honour is refused before anything
reaches the engine, with :class:`~tserve.nursery.InvalidRequest` naming
``constraint`` (the web layer names its own field); the engine never
generates unconstrained after a failed check. The check compiles the
grammar's lexer (``tserve.grammar.constraint_problem``): milliseconds for an
ordinary schema, more for a very large one, so it runs in a worker thread at
a lower priority than the event loop, and the part of it that holds the GIL
(the grammar text) in a thread at the event loop's own priority.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable
from typing import Final

import anyio
import llguidance
import msgspec

from tserve._host import lower_thread_priority
from tserve.grammar import checked_text, llg_tokenizer, text_problem
from tserve.nursery._errors import InvalidRequest
from tserve.sampling import Constraint
from tserve.validity import Problem

__all__ = ["CHECK_CACHE_SIZE", "ConstraintCheck"]

CHECK_CACHE_SIZE: Final = 128
"""Constraints whose verdict is remembered (valid or not), least recently used dropped."""

_ENCODE: Final = msgspec.msgpack.Encoder().encode
_CHECK_THREADS: Final = 2


class ConstraintCheck:
    """Validates constraints for one model; shared by its requests.

    ``tokenizer_json`` gives the model's ``tokenizer.json`` text and
    ``vocab_size`` the engine's vocabulary; both are read once, in a worker
    thread, by :meth:`prepare` (at startup) or else by the first check that
    needs them. Call :meth:`check` on the event loop.
    """

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: Callable[[], int]) -> None:
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()  # the first builder; the others wait for it
        # Verdicts by the constraint's wire encoding. Bound: CHECK_CACHE_SIZE
        # entries; at the bound the least recently used is dropped. Touched
        # on the event loop only.
        self._verdicts: collections.OrderedDict[bytes, Problem | None] = collections.OrderedDict()
        # Checks in worker threads of their own, at a lower priority than the
        # event loop (``lower_thread_priority``). Bound: this many at once;
        # more wait for a thread (they belong to admitted requests, at most
        # max_pending).
        self._threads = concurrent.futures.ThreadPoolExecutor(
            _CHECK_THREADS,
            thread_name_prefix="tserve-grammar-check",
            initializer=lower_thread_priority,
        )
        # The grammar texts, at the process's own priority: Python that holds
        # the GIL, which a low-priority thread kept off the CPU by a busy
        # machine would keep from the event loop as long. A check thread
        # waits for its text. Bound: one per check thread.
        self._texts = concurrent.futures.ThreadPoolExecutor(
            _CHECK_THREADS, thread_name_prefix="tserve-grammar-text"
        )
        self._limiter = anyio.CapacityLimiter(_CHECK_THREADS)
        # The tokenizer's build started by prepare(); None before.
        self.prepared: concurrent.futures.Future[None] | None = None

    def prepare(self) -> None:
        """Start building llguidance's tokenizer in a worker thread at the event
        loop's priority. Never blocks. It holds the GIL for about a third of a
        second for a 50k vocabulary, so it is built when the process starts,
        not by the first constrained request (which would stall every stream
        of the process once). A failure is left for the first check to report.
        Idempotent."""
        if self.prepared is None:
            self.prepared = self._texts.submit(self._build_tokenizer)

    def _build_tokenizer(self) -> None:
        with contextlib.suppress(ValueError):  # check() reports it, named
            self._llg_tokenizer()

    async def check(self, constraint: Constraint) -> None:
        """Raise InvalidRequest (``param`` "constraint") unless the grammar engine
        can honour ``constraint``.

        A remembered verdict answers at once (not a checkpoint); otherwise the
        check runs in a worker thread (a checkpoint; a cancel takes effect when
        the thread returns, milliseconds for ordinary grammars).
        """
        key = _ENCODE(constraint)
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
            problem = self._verdicts[key]
        else:
            job = self._threads.submit(self._check, constraint)
            problem = await anyio.to_thread.run_sync(job.result, limiter=self._limiter)
            self._verdicts[key] = problem
            while len(self._verdicts) > CHECK_CACHE_SIZE:
                self._verdicts.popitem(last=False)
        if problem is not None:
            raise InvalidRequest(problem.message, param=problem.param)

    def _check(self, constraint: Constraint) -> Problem | None:
        """In a check thread; blocks while a text thread makes the grammar text."""
        try:
            tokenizer = self._llg_tokenizer()
        except ValueError as exc:
            return Problem("constraint", f"structured outputs are not available: {exc}")
        text = self._texts.submit(checked_text, constraint).result()
        return text if isinstance(text, Problem) else text_problem(constraint, text, tokenizer)

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = llg_tokenizer(
                    self._tokenizer_json(), vocab_size=self._vocab_size()
                )
            return self._tokenizer
