"""Grammars compiled off the step loop: :class:`GrammarCompiler`.

It compiles constraints in ONE worker thread (the grammar text,
``tserve.grammar.grammar_text``, made in a second thread, then llguidance's
matcher) and keeps the compiled ones in a bounded LRU cache keyed by the
constraint's wire encoding (:func:`constraint_key`), so the step loop only
encodes it (a fraction of a millisecond for a 128-tool schema; the text
takes milliseconds). A constraint is compiled once however many requests ask
for it; each gets its own copy of the compiled matcher. A constraint that
cannot become a grammar, a grammar that fails to compile or that can write
nothing (``tserve.grammar.start_problem``) is cached with its error, so the
same constraint fails the same way again. The thread cannot be stopped: a
compile that runs late finishes and is cached (llguidance's own limits, and
``tserve.grammar.LEXER_FUEL``, bound its work), and the compiles behind it
wait. What the step loop does with a compiled matcher is ``_constraints.py``'s.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final, TypeAlias

import msgspec

from tserve._host import lower_thread_priority, trim_heap
from tserve.grammar import grammar_text, llg_tokenizer, start_problem
from tserve.grammar import matcher as new_matcher
from tserve.sampling import Constraint

if TYPE_CHECKING:  # imported where used: an engine that constrains nothing never needs it
    import llguidance

__all__ = ["Compiled", "GrammarCompiler", "constraint_key"]

Compiled: TypeAlias = "llguidance.LLMatcher | str"
"""A compiled grammar's matcher at its start, or why it did not compile."""

_ENCODE: Final = msgspec.msgpack.Encoder().encode


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
    thread waits for, and so are llguidance's calls that hold the GIL
    (``start_problem``'s ``run_held``).
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
        # The grammar texts and llguidance's calls that hold the GIL. Bound: one
        # at a time, for the one compile running.
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

    def _run_held(self, call: Callable[[], bool]) -> bool:
        """One of llguidance's calls that hold the GIL, in the text thread (at the
        process's own priority); the compile thread waits for it."""
        return self._texts.submit(call).result()

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
            problem = start_problem(matcher.deep_copy(), self.tokenizer, self._run_held)
        except Exception as exc:  # llguidance's or the tokenizer's error, whatever its type
            return f"{type(exc).__name__}: {exc}"
        return matcher if problem is None else problem
