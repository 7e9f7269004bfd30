"""``except tserve.LLMError`` catches every failure of open_llm, attach_llm and their LLM.

Each failure for real: a model that cannot load, keys missing for a network
address, an engine that is gone before the attach, an overload, bad input
(out-of-vocabulary ids, text that is not Unicode), a deadline, shutting down,
and the engine process killed under a live stream. The echo engine (paced:
a request here cannot finish on its own) keeps each start cheap.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Awaitable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import anyio
import pytest

import tserve
import tserve.mux
import tserve.nursery
from tests.guards import HANG_GUARD
from tests.nursery.conftest import ENGINE
from tserve import LLMError, SamplingParams, open_llm
from tserve.nursery import attach_llm

pytestmark = pytest.mark.anyio

LONG = SamplingParams(max_tokens=400, ignore_eos=True)
PACED = {"engine_kind": "echo", "echo_step_time": 0.1, **ENGINE}  # LONG needs 40 s


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "trio"  # the error types are the same on both loops


def test_every_exported_error_is_an_llm_error() -> None:
    errors = {
        value
        for module in (tserve, tserve.nursery, tserve.mux)
        for value in (getattr(module, name) for name in module.__all__)
        if isinstance(value, type) and issubclass(value, BaseException)
    }
    assert {e.__name__ for e in errors} >= {"EngineDeadError", "KeyFileError", "MuxClosedError"}
    assert all(issubclass(e, LLMError) for e in errors), errors


async def _fails_as_llm_error(block: AbstractAsyncContextManager[object]) -> LLMError:
    """Enter the async context manager ``block``; the LLMError it raised."""
    with anyio.fail_after(HANG_GUARD):
        try:
            async with block:
                pass
        except LLMError as exc:
            return exc
    raise AssertionError("it started")


async def _raises(call: Awaitable[object]) -> LLMError:
    """The LLMError that awaiting ``call`` raised."""
    try:
        await call
    except LLMError as exc:
        return exc
    raise AssertionError(f"{call!r}: no error")


async def test_a_model_that_cannot_load() -> None:
    error = await _fails_as_llm_error(open_llm("/nonexistent/model", **ENGINE))
    assert isinstance(error, tserve.EngineDeadError)
    assert "failed to start" in str(error)


async def test_attaching_without_keys_or_to_a_gone_engine() -> None:
    no_keys = await _fails_as_llm_error(attach_llm("tcp://127.0.0.1:9"))
    assert isinstance(no_keys, tserve.KeyFileError)
    gone = await _fails_as_llm_error(attach_llm("ipc:///nonexistent/engine", 2**22 + 1))
    assert isinstance(gone, tserve.EngineDeadError)


async def test_failures_of_requests(tiny_model_dir: Path) -> None:
    """An overload, bad input, a deadline, then the engine killed mid-stream."""
    caught: dict[str, LLMError] = {}
    short = SamplingParams(max_tokens=2)
    with anyio.fail_after(HANG_GUARD):
        async with open_llm(tiny_model_dir, max_pending=1, overload="raise", **PACED) as llm:
            async with llm.generate([5], LONG) as held:  # takes the one slot
                await held.__anext__()
                with pytest.raises(LLMError) as overloaded:
                    llm.generate([6], short)
                caught["overloaded"] = overloaded.value
                pid = llm.engine_pid
                os.kill(pid, signal.SIGKILL)
                with pytest.raises(LLMError) as died:
                    async for _ in held:
                        pass
                caught["killed"] = died.value
            caught["after the death"] = await _raises(llm.complete([7], short))
    assert isinstance(caught["overloaded"], tserve.Overloaded)
    assert isinstance(caught["killed"], tserve.EngineDeadError)
    assert "SIGKILL" in str(caught["killed"])
    assert isinstance(caught["after the death"], tserve.EngineDeadError)


async def test_bad_input_a_deadline_and_shutting_down(tiny_model_dir: Path) -> None:
    caught: dict[str, LLMError] = {}
    short = SamplingParams(max_tokens=2)
    with anyio.fail_after(HANG_GUARD):
        async with open_llm(tiny_model_dir, **PACED) as llm:
            caught["token id"] = await _raises(llm.complete([10**6], short))
            caught["surrogate"] = await _raises(llm.complete("a\ud800b", short))
            chat = [{"role": "user", "content": "a\udfffb"}]
            caught["chat surrogate"] = await _raises(llm.complete_chat(chat, short))
            caught["deadline"] = await _raises(llm.complete([8], LONG, timeout=0.05))
            caught["no embedder"] = await _raises(llm.embed("x"))
    caught["after the block"] = await _raises(llm.complete([9], short))
    assert isinstance(caught["token id"], tserve.InvalidRequest)
    assert caught["token id"].param == "prompt"
    assert isinstance(caught["surrogate"], tserve.InvalidRequest)
    assert caught["surrogate"].param == "prompt"
    assert isinstance(caught["chat surrogate"], tserve.InvalidRequest)
    assert caught["chat surrogate"].param == "messages"
    assert isinstance(caught["deadline"], tserve.RequestTimeout)
    assert isinstance(caught["no embedder"], tserve.InvalidRequest)
    assert isinstance(caught["after the block"], tserve.ShuttingDown)
