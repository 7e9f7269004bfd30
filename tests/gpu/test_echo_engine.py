"""The echo engine as a real process: behind ``open_llm``, and behind ``python -m tserve serve``.

No model is loaded (the tiny model's directory gives only the tokenizer), so
these run in seconds and show the frontend's behaviour with an engine whose
output is known exactly.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from tests.guards import HANG_GUARD
from tests.nursery.conftest import ENGINE, settled
from tests.web.conftest import Server
from tserve import LLM, RequestTimeout, SamplingParams, open_llm

pytestmark = pytest.mark.anyio

STEP_TIME = 0.002  # seconds per echo step


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "trio"


@pytest.fixture(scope="module")
async def llm(anyio_backend: str, tiny_model_dir: Path) -> AsyncIterator[LLM]:
    async with open_llm(
        tiny_model_dir,
        max_pending=2000,
        max_num_seqs=256,
        engine_kind="echo",
        echo_step_time=STEP_TIME,
        **ENGINE,
    ) as llm:
        yield llm


async def test_every_request_gets_exactly_max_tokens(llm: LLM) -> None:
    assert llm._mux.ready.kv_tokens_total == 0  # no KV: nothing was loaded
    for max_tokens in (1, 7, 100):
        result = await llm.complete([5, 6, 7], SamplingParams(max_tokens=max_tokens))
        assert result.token_ids == ([5, 6, 7] * 34)[:max_tokens]
        assert result.finish_reason == "length"
    text = await llm.complete("Hello there", SamplingParams(max_tokens=9))
    assert len(text.token_ids) == 9 and text.text
    await settled(llm)


async def test_a_closed_stream_is_aborted_in_the_engine(llm: LLM) -> None:
    async with llm.generate([5, 6], SamplingParams(max_tokens=400)) as stream:
        async for delta in stream:
            assert delta.token_ids
            break
    await settled(llm)  # the engine reported the abort and runs nothing


async def test_a_deadline_ends_the_request_and_frees_the_engine(llm: LLM) -> None:
    # 400 tokens take at least 400 steps of STEP_TIME: far past the timeout.
    with pytest.raises(RequestTimeout):
        await llm.complete([5], SamplingParams(max_tokens=400), timeout=0.05)
    await settled(llm)


async def test_a_thousand_concurrent_requests_all_complete(llm: LLM) -> None:
    counts: dict[int, int] = {}

    async def one(i: int) -> None:
        tokens = 1 + i % 16
        result = await llm.complete([1 + i % 50, 2], SamplingParams(max_tokens=tokens))
        assert result.finish_reason == "length"
        counts[i] = len(result.token_ids) - tokens

    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            for i in range(1000):
                tg.start_soon(one, i)
    assert len(counts) == 1000 and set(counts.values()) == {0}
    await settled(llm)


def test_a_streamed_completion_over_http(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = Server(
        tiny_model_dir,
        "--served-model-name",
        "tiny",
        "--engine-kind",
        "echo",
        "--echo-step-time",
        str(STEP_TIME),
        log=tmp_path / "server.log",
    )
    try:
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 12, "stream": True}
        body["stream_options"] = {"include_usage": True}
        events = []
        with server.client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line.removeprefix("data: ")))
                if line == "data: [DONE]":
                    break
        choices = [c for event in events for c in event["choices"]]
        assert choices[-1]["finish_reason"] == "length"
        assert events[-1]["usage"]["completion_tokens"] == 12
    finally:
        assert server.stop() == 0, server.log.read_text()[-3000:]
