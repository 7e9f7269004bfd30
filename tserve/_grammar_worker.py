"""The grammar worker: a process that checks constraints for an API process.

Checking a constraint (:func:`tserve.grammar.text_problem`) compiles its
grammar's lexer and follows the tokens it forces from its start: milliseconds
for an ordinary schema, a tenth of a second of one core for a hostile regex
under :data:`~tserve.grammar.LEXER_FUEL`. Some of llguidance's calls hold the
GIL all the while (feeding a forced token to the matcher: 5 ms for a token of
many bytes through ``((a{100}){100}){100}``), and no thread priority can make
an event loop's wait for the GIL shorter than the holder's call. So an API
process checks in a process of its own, :class:`GrammarWorker`, run as
``python -m tserve._grammar_worker`` at a lower priority than its parent: the
event loop never waits behind a check, and a busy machine gives the event
loop and the engine the CPU first.

The protocol, msgpack frames over two pipes (``multiprocessing.connection``'s
length-prefixed messages): the parent sends :class:`Setup` (the model's
``tokenizer.json`` text), the worker answers :class:`Ready` once llguidance's
tokenizer is built; then each :class:`Check` gets one :class:`Verdict`, in any
order, at most :data:`CHECK_THREADS` computed at once. The worker exits when
its input ends: its parent closed it, or died. A leaf: the standard library,
msgspec, llguidance (in the worker) and :mod:`tserve.grammar`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Final

import msgspec

from tserve._host import lower_thread_priority, own_process_group, trim_heap
from tserve.sampling import Constraint
from tserve.validity import Problem

if TYPE_CHECKING:  # imported in the worker alone: its parent never needs it
    import llguidance

__all__ = ["CHECK_THREADS", "WORKER_COMMAND", "GrammarWorker", "WorkerGone"]

CHECK_THREADS: Final = 2
"""Checks the worker computes at once; more wait in its queue."""

WORKER_COMMAND: Final = (sys.executable, "-m", "tserve._grammar_worker")
"""How a worker process starts."""


class Setup(msgspec.Struct, array_like=True, tag=1):
    tokenizer_json: str
    vocab_size: int


class Ready(msgspec.Struct, array_like=True, tag=2):
    error: str | None  # why llguidance's tokenizer could not be built


class Check(msgspec.Struct, array_like=True, tag=3):
    id: int
    constraint: bytes  # its msgpack encoding


class Verdict(msgspec.Struct, array_like=True, tag=4):
    id: int
    problem: Problem | None


_ENCODE: Final = msgspec.msgpack.Encoder().encode
_FROM_PARENT: Final = msgspec.msgpack.Decoder(Setup | Check)
_FROM_WORKER: Final = msgspec.msgpack.Decoder(Ready | Verdict)
_CONSTRAINT: Final = msgspec.msgpack.Decoder(Constraint)


class WorkerGone(Exception):
    """The worker process ended before it answered."""


class GrammarWorker:
    """A grammar worker process and its pipes; :meth:`check` from any thread.

    Starting it never blocks; :meth:`wait_ready` blocks until its tokenizer is
    built (a third of a second for a 50k vocabulary). A daemon thread reads
    its answers. When the process ends, every check waiting on it, and every
    later one, raises :class:`WorkerGone`: start another.
    """

    def __init__(
        self, tokenizer_json: str, vocab_size: int, command: Sequence[str] = WORKER_COMMAND
    ) -> None:
        to_worker, self._to_worker = os.pipe()
        self._from_worker, from_worker = os.pipe()
        try:
            self.process = subprocess.Popen(
                list(command),
                stdin=to_worker,
                stdout=from_worker,
                # It moves to a process group of its own (own_process_group):
                # a terminal's Ctrl-C reaches the API process alone.
            )
        finally:
            os.close(to_worker)
            os.close(from_worker)
        self._outbox = Connection(self._to_worker, readable=False)
        self._lock = threading.Lock()  # the outbox, _pending and _gone
        # Checks sent and not answered, by id. Bound: the checks in flight
        # (ConstraintCheck lets CHECK_THREADS wait at once).
        self._pending: dict[int, concurrent.futures.Future[Problem | None]] = {}
        self._ids = itertools.count()
        self._gone: str | None = None
        self._ready: concurrent.futures.Future[str | None] = concurrent.futures.Future()
        with self._lock:
            self._send(Setup(tokenizer_json, vocab_size))
        threading.Thread(target=self._read, name="tserve-grammar-worker", daemon=True).start()

    @property
    def alive(self) -> bool:
        return self._gone is None

    def wait_ready(self) -> str | None:
        """Block until the worker's tokenizer is built; why it could not be, or
        None. Raises WorkerGone if the process ended first."""
        return self._ready.result()

    def check(self, constraint: bytes) -> Problem | None:
        """The verdict on ``constraint`` (its msgpack encoding). Blocks for the
        check; raises WorkerGone if the process ended before it answered."""
        future: concurrent.futures.Future[Problem | None] = concurrent.futures.Future()
        with self._lock:
            if self._gone is not None:
                raise WorkerGone(self._gone)
            job = next(self._ids)
            self._pending[job] = future
            self._send(Check(job, constraint))
        return future.result()

    def close(self) -> None:
        """End the process (killed: it holds nothing to save) and reap it. Never
        blocks longer than the kernel takes to end it."""
        with self._lock:
            self._outbox.close()
        self.process.kill()
        self.process.wait()

    def _send(self, message: Setup | Check) -> None:
        """Under _lock. A closed or broken pipe is left for the reader to report."""
        if self._outbox.closed:
            return
        with contextlib.suppress(OSError):
            self._outbox.send_bytes(_ENCODE(message))

    def _read(self) -> None:
        """The reader thread: answers to their futures until the process ends."""
        inbox = Connection(self._from_worker, writable=False)
        try:
            while True:
                message = _FROM_WORKER.decode(inbox.recv_bytes())
                if isinstance(message, Ready):
                    self._ready.set_result(message.error)
                    continue
                with self._lock:
                    future = self._pending.pop(message.id)
                future.set_result(message.problem)
        except (EOFError, OSError):
            pass
        finally:
            inbox.close()
            code = self.process.wait()
            self._end(f"the grammar worker process ended (status {code})")

    def _end(self, reason: str) -> None:
        with self._lock:
            self._gone = reason
            pending, self._pending = self._pending, {}
        futures: list[concurrent.futures.Future[Any]] = [self._ready, *pending.values()]
        for future in futures:
            if not future.done():
                future.set_exception(WorkerGone(reason))


def _verdict(constraint: bytes, tokenizer: llguidance.LLTokenizer | None) -> Problem | None:
    """In a check thread of the worker: ``constraint``'s problem, or None."""
    from tserve.grammar import constraint_problem

    try:
        return constraint_problem(_CONSTRAINT.decode(constraint), tokenizer)
    except Exception as exc:  # llguidance's error, whatever its type: this grammar's
        return Problem("constraint", f"the grammar could not be checked: {exc}")


def main() -> None:
    """The worker process: Setup, Ready, then a Verdict for each Check, until its input ends."""
    own_process_group()
    lower_thread_priority()  # before any thread starts: they inherit it
    answers = os.dup(1)
    os.dup2(2, 1)  # stray prints go to the log, never into the answers' pipe
    inbox = Connection(0, writable=False)
    outbox = Connection(answers, readable=False)
    setup = _FROM_PARENT.decode(inbox.recv_bytes())
    assert isinstance(setup, Setup), "the first message is Setup"
    from tserve.grammar import llg_tokenizer

    tokenizer = None
    try:
        tokenizer = llg_tokenizer(setup.tokenizer_json, vocab_size=setup.vocab_size)
        outbox.send_bytes(_ENCODE(Ready(None)))
    except ValueError as exc:
        outbox.send_bytes(_ENCODE(Ready(str(exc))))
    del setup
    trim_heap()  # the parse of tokenizer.json: hundreds of MB for a 262k vocabulary
    lock = threading.Lock()

    def answer(check: Check) -> None:
        problem = _verdict(check.constraint, tokenizer)
        with lock:
            outbox.send_bytes(_ENCODE(Verdict(check.id, problem)))

    pool = concurrent.futures.ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="check")
    while True:
        try:
            message = inbox.recv_bytes()
        except EOFError:  # the parent closed it, or died: nothing is waiting for answers
            os._exit(0)
        check = _FROM_PARENT.decode(message)
        assert isinstance(check, Check), "Setup comes once"
        pool.submit(answer, check)


if __name__ == "__main__":
    main()
