"""Checking a request's constraint before it reaches the engine.

A constraint the grammar engine cannot honour is refused before anything
reaches the engine, with :class:`~tserve.nursery.InvalidRequest` naming
``constraint`` (the web layer names its own field); the engine never
generates unconstrained after a failed check. The check compiles the
grammar's lexer (``tserve.grammar.constraint_problem``): milliseconds for an
ordinary schema, a tenth of a second for a hostile regex, some of it holding
the GIL. So it runs in a grammar worker process
(:class:`~tserve._grammar_worker.GrammarWorker`) at a lower priority than
this one, and the event loop only waits for its answer.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Final

import anyio
import msgspec

from tserve._grammar_worker import CHECK_THREADS, GrammarWorker, WorkerGone
from tserve.nursery._errors import InvalidRequest
from tserve.sampling import Constraint
from tserve.validity import Problem

__all__ = ["CHECK_CACHE_SIZE", "ConstraintCheck"]

CHECK_CACHE_SIZE: Final = 128
"""Constraints whose verdict is remembered (valid or not), least recently used dropped."""

CHECK_ATTEMPTS: Final = 2
"""Workers a check is given: one whose worker process ends before it answers
runs again on a new one; a constraint that ends this many is refused."""

_ENCODE: Final = msgspec.msgpack.Encoder().encode


class ConstraintCheck:
    """Validates constraints for one model; shared by its requests.

    ``tokenizer_json`` gives the model's ``tokenizer.json`` text and
    ``vocab_size`` the engine's vocabulary; both are read when the worker
    process starts (``start_worker``'s), in a thread, by :meth:`prepare` (at
    startup) or else by the first check, and again for each worker that
    replaces one that ended. Call :meth:`check` on the event loop, and :meth:`close`
    when the model is no longer served.
    """

    def __init__(
        self,
        tokenizer_json: Callable[[], str],
        vocab_size: Callable[[], int],
        start_worker: Callable[[str, int], GrammarWorker] = GrammarWorker,
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._start_worker = start_worker
        self._worker: GrammarWorker | None = None
        self._worker_lock = threading.Lock()  # who starts the next worker; the others wait
        self._closed = False
        # Verdicts by the constraint's wire encoding. Bound: CHECK_CACHE_SIZE
        # entries; at the bound the least recently used is dropped. Touched
        # on the event loop only.
        self._verdicts: collections.OrderedDict[bytes, Problem | None] = collections.OrderedDict()
        # Checks sent to the worker at once, each waited for in a thread;
        # more wait here, on the event loop (they belong to admitted
        # requests, at most max_pending).
        self._limiter = anyio.CapacityLimiter(CHECK_THREADS)
        self._starter = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="tserve-grammar-start"
        )
        # The worker's start by prepare(), until it is ready; None before.
        self.prepared: concurrent.futures.Future[object] | None = None

    @property
    def worker_pid(self) -> int | None:
        """The grammar worker's pid while one runs, else None."""
        worker = self._worker
        return worker.process.pid if worker is not None and worker.alive else None

    def prepare(self) -> None:
        """Start the grammar worker and its tokenizer's build (a third of a second
        for a 50k vocabulary, in that process). Never blocks. A failure is left
        for the first check to report. Idempotent."""
        if self.prepared is None:
            self.prepared = self._starter.submit(self._ready_worker)

    async def check(self, constraint: Constraint) -> None:
        """Raise InvalidRequest (``param`` "constraint") unless the grammar engine
        can honour ``constraint`` (one holding an integer beyond 64 bits, which
        no wire encoding carries, at once).

        A remembered verdict answers at once (not a checkpoint); otherwise the
        check runs in the worker process (a checkpoint; a cancel takes effect
        when it answers, milliseconds for ordinary grammars).
        """
        try:
            key = _ENCODE(constraint)
        except OverflowError:  # JSON's integers are unbounded; the wire's are 64 bits
            message = "the grammar holds an integer beyond the 64-bit range"
            raise InvalidRequest(message, param="constraint") from None
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
            problem = self._verdicts[key]
        else:
            problem, known = await anyio.to_thread.run_sync(self._check, key, limiter=self._limiter)
            if known:
                self._verdicts[key] = problem
                while len(self._verdicts) > CHECK_CACHE_SIZE:
                    self._verdicts.popitem(last=False)
        if problem is not None:
            raise InvalidRequest(problem.message, param=problem.param)

    def close(self) -> None:
        """End the worker process; a check after this one is refused. Never blocks
        for long (the process is killed)."""
        with self._worker_lock:
            self._closed = True
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()
        self._starter.shutdown(wait=False, cancel_futures=True)

    def _check(self, key: bytes) -> tuple[Problem | None, bool]:
        """In a thread: the verdict on ``key``, and whether it is the
        constraint's own (to remember) rather than the checker's failure."""
        gone = ""
        for _ in range(CHECK_ATTEMPTS):
            try:
                worker, error = self._ready_worker()
                if error is not None:
                    message = f"structured outputs are not available: {error}"
                    return Problem("constraint", message), False
                return worker.check(key), True
            except WorkerGone as exc:
                gone = str(exc)
        return Problem("constraint", f"the grammar could not be checked: {gone}"), False

    def _ready_worker(self) -> tuple[GrammarWorker, str | None]:
        """The live worker, started here if there is none, once it is ready, and
        why its tokenizer could not be built (or None). Blocks; raises
        WorkerGone if it ended first or this check is closed."""
        with self._worker_lock:
            if self._closed:
                raise WorkerGone("the model is no longer served")
            if self._worker is None or not self._worker.alive:
                self._worker = self._start_worker(self._tokenizer_json(), self._vocab_size())
            worker = self._worker
        return worker, worker.wait_ready()
