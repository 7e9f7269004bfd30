"""The API process's constraint checks in their grammar worker process, both backends.

A real worker process (``python -m tserve._grammar_worker``) with the tiny
model's tokenizer; no engine. The checks answer as the grammar engine would,
a worker that dies with a check in flight is replaced and the check answered,
a constraint whose workers all end is refused without being remembered, and
closing the check ends the process.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from tests.nursery.conftest import eventually
from tests.processes import process_gone
from tserve import InvalidRequest
from tserve._grammar_worker import WORKER_COMMAND, GrammarWorker
from tserve.nursery._constraint import CHECK_ATTEMPTS, ConstraintCheck
from tserve.sampling import Choice, JsonSchema, Regex

pytestmark = pytest.mark.anyio

HANG_GUARD = 60.0


@pytest.fixture
async def check(anyio_backend: str, tiny_model_dir: Path) -> AsyncIterator[ConstraintCheck]:
    vocab_size = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    text = (tiny_model_dir / "tokenizer.json").read_text()
    constraints = ConstraintCheck(lambda: text, lambda: vocab_size)
    try:
        yield constraints
    finally:
        constraints.close()


async def test_verdicts_come_from_a_process_of_their_own(check: ConstraintCheck) -> None:
    assert check.worker_pid is None  # started by prepare() or the first check
    with anyio.fail_after(HANG_GUARD):
        await check.check(JsonSchema({"type": "object", "properties": {"a": {"type": "integer"}}}))
        await check.check(Choice(("yes", "no")))
        pid = check.worker_pid
        assert pid is not None and pid != os.getpid()
        with pytest.raises(InvalidRequest, match="regex") as bad:
            await check.check(Regex("(unclosed"))
        assert bad.value.param == "constraint"
        with pytest.raises(InvalidRequest, match="accepts no string"):
            await check.check(JsonSchema({"$ref": "#"}))
        # A regex that runs out of llguidance's lexer fuel is refused, in the worker.
        with pytest.raises(InvalidRequest, match="too many expressions"):
            await check.check(Regex("((a{100}){100}){100}"))
        assert check.worker_pid == pid  # one worker served them all
    check.close()  # the process killed and reaped
    assert process_gone(pid)
    with pytest.raises(InvalidRequest, match="no longer served"):
        await check.check(Regex("[a-z]+"))


async def test_a_check_in_flight_when_its_worker_dies_is_answered_by_another(
    check: ConstraintCheck,
) -> None:
    with anyio.fail_after(HANG_GUARD):
        await check.check(Choice(("warm", "up")))
        first = check.worker_pid
        assert first is not None
        os.kill(first, signal.SIGSTOP)  # it can answer nothing now
        async with anyio.create_task_group() as tg:
            tg.start_soon(check.check, Regex("[a-z]+ in flight"))
            worker = check._worker
            assert worker is not None
            await eventually(lambda: bool(worker._pending), "the check is sent")
            os.kill(first, signal.SIGKILL)
        second = check.worker_pid
        assert second is not None and second != first
        with pytest.raises(InvalidRequest, match="regex"):
            await check.check(Regex("(unclosed"))


async def test_a_constraint_whose_workers_all_end_is_refused_and_not_remembered(
    anyio_backend: str, tiny_model_dir: Path
) -> None:
    """Its worker ends every time (as if the kernel killed it): after
    CHECK_ATTEMPTS workers it is refused; the verdict is the checker's, so the
    same constraint is checked again later, and passes on a healthy worker."""
    healthy = False
    started: list[int] = []

    def start(tokenizer_json: str, vocab_size: int) -> GrammarWorker:
        command = WORKER_COMMAND if healthy else (sys.executable, "-c", "pass")
        worker = GrammarWorker(tokenizer_json, vocab_size, command)
        started.append(worker.process.pid)
        return worker

    constraint = Regex("[a-z]+ twice")
    vocab_size = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    text = (tiny_model_dir / "tokenizer.json").read_text()
    check = ConstraintCheck(lambda: text, lambda: vocab_size, start)
    try:
        with anyio.fail_after(HANG_GUARD):
            with pytest.raises(InvalidRequest, match=r"could not be checked.*ended") as refused:
                await check.check(constraint)
            assert refused.value.param == "constraint"
            assert len(started) == CHECK_ATTEMPTS
            healthy = True
            await check.check(constraint)  # not remembered: a new worker checks it
            assert len(started) == CHECK_ATTEMPTS + 1
    finally:
        check.close()
