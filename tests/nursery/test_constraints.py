"""Structured outputs through the embeddable API, a real engine process, both backends.

Invalid constraints are refused in the API process (InvalidRequest naming
``constraint``) before anything reaches the engine, and the LLM goes on
serving.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import jsonschema
import pytest

import tserve
from tests.nursery.conftest import ENGINE, settled
from tests.processes import process_gone
from tserve import LLM, InvalidRequest, SamplingParams, open_llm

pytestmark = pytest.mark.anyio

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 5},
        "population": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
async def llm(anyio_backend: str, tiny_model_dir: Path) -> AsyncIterator[LLM]:
    async with open_llm(tiny_model_dir, max_pending=64, max_num_seqs=8, **ENGINE) as llm:
        yield llm


async def test_a_json_schema_output_validates(llm: LLM) -> None:
    params = SamplingParams(
        max_tokens=120, temperature=0.8, seed=5, constraint=tserve.JsonSchema(SCHEMA)
    )
    result = await llm.complete("Describe Paris as JSON:", params)
    assert result.finish_reason == "stop"
    jsonschema.validate(json.loads(result.text), SCHEMA)
    await settled(llm)


async def test_choice_and_regex_outputs_match(llm: LLM) -> None:
    choice = await llm.complete(
        "Is it?", SamplingParams(max_tokens=20, constraint=tserve.Choice(("yes", "no")))
    )
    assert (choice.text, choice.finish_reason) in {("yes", "stop"), ("no", "stop")}
    pattern = r"[A-Z][a-z]{2,5} [0-9]{2}"
    deltas = [
        delta
        async for delta in llm.generate(
            "When?", SamplingParams(max_tokens=30, seed=1, constraint=tserve.Regex(pattern))
        )
    ]
    text = "".join(d.text for d in deltas)
    assert re.fullmatch(pattern, text) and deltas[-1].finish_reason == "stop"
    chat = await llm.complete_chat(
        [{"role": "user", "content": "Pick one"}],
        SamplingParams(max_tokens=20, constraint=tserve.LarkGrammar('start: "A" | "B" | "C"')),
    )
    assert chat.text in {"A", "B", "C"}
    await settled(llm)


@pytest.mark.parametrize(
    "constraint",
    [
        tserve.JsonSchema({"type": "object", "properties": {"a": {"type": "wat"}}}),
        tserve.Regex("(unclosed"),
        tserve.LarkGrammar("start: nowhere"),
        tserve.LarkGrammar('start: "x" <|not_a_special_token|>'),
        tserve.Choice(()),
    ],
)
async def test_an_invalid_constraint_is_refused_and_the_llm_serves_on(
    llm: LLM, constraint: tserve.protocol.Constraint
) -> None:
    params = SamplingParams(max_tokens=8, constraint=constraint)
    for _ in range(2):  # the second answer is the remembered verdict
        with pytest.raises(InvalidRequest) as caught:
            await llm.complete("Hello", params)
        assert caught.value.param == "constraint"
    assert llm.stats.engine.aborts_received == llm.stats.aborts_sent
    plain = await llm.complete("Hello", SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(plain.token_ids) == 4
    await settled(llm)


async def test_logit_bias_is_checked_and_applied(llm: LLM) -> None:
    with pytest.raises(InvalidRequest) as caught:
        await llm.complete("Hi", SamplingParams(logit_bias=((llm.ready.vocab_size, 1.0),)))
    assert caught.value.param == "logit_bias"
    forced = llm.encode("fox")[0]
    result = await llm.complete(
        "Hi", SamplingParams(max_tokens=5, ignore_eos=True, logit_bias=((forced, 100.0),))
    )
    assert result.token_ids == [forced] * 5
    await settled(llm)


async def test_the_grammar_worker_starts_with_the_llm_and_ends_with_it(
    tiny_model_dir: Path,
) -> None:
    """The grammar worker process, and llguidance's view of the vocabulary in it,
    start when the LLM opens, before any constrained request, so the first one
    does not wait for them; the worker ends when the LLM closes."""
    async with open_llm(tiny_model_dir, **ENGINE) as llm:
        prepared = llm.constraints.prepared
        assert prepared is not None  # started by open_llm, no request sent
        await anyio.to_thread.run_sync(prepared.result)
        worker = llm.constraints.worker_pid
        assert worker is not None and worker != os.getpid()
        choice = SamplingParams(max_tokens=20, constraint=tserve.Choice(("yes", "no")))
        assert (await llm.complete("Is it?", choice)).text in {"yes", "no"}
        assert llm.constraints.worker_pid == worker
    assert process_gone(worker)
