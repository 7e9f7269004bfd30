"""Bad input fails alone, before the engine or inside it, never killing it
(issue 7, test 3; and the chat-template part of the API-process faults).

Every test ends by proving the engine survived: ``engine_alive`` and a normal
request still completes with exactly the tokens it had before.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from tests.faults.workload import (
    Output,
    Spec,
    assert_complete,
    assert_same,
    run_concurrently,
    run_one,
    seeded_spec,
    wait_until_idle,
)
from tests.guards import HANG_GUARD
from tserve.mux import Mailbox
from tserve.nursery import LLM, InvalidRequest, RequestFailed, open_llm
from tserve.protocol import AddRequest, FinishReason, SamplingParams

pytestmark = pytest.mark.anyio

CONTEXT = 512  # the tiny model's max_position_embeddings
VOCAB = 512


async def _still_serving(llm: LLM, reference: Output) -> None:
    """The engine is alive, serves a known request exactly, and is idle after."""
    assert llm.engine_alive
    assert_same(reference, await run_one(llm, seeded_spec(1, prefix="check")), "check")
    stats = await wait_until_idle(llm)
    assert stats.live_requests == 0
    assert stats.engine_alive


# -- checked in the API process, before the engine ---------------------------------------


_API_REJECTS: list[tuple[str, str | list[int], int, str]] = [
    # (case, prompt, max_tokens, the param InvalidRequest names)
    ("negative id", [5, -1, 6], 4, "prompt"),
    ("id == vocab", [5, VOCAB, 6], 4, "prompt"),
    ("huge id", [2**40], 4, "prompt"),
    ("empty text", "", 4, "prompt"),
    ("empty ids", [], 4, "prompt"),
    ("prompt at the context", [5] * CONTEXT, 1, "prompt"),
    ("prompt past the context", [5] * (CONTEXT + 1), 1, "prompt"),
    ("text past the context", "tserve " * 600, 1, "prompt"),
    ("max_tokens past the context", [5] * 10, CONTEXT - 9, "max_tokens"),
    ("max_tokens far past the context", [5] * 10, 10**9, "max_tokens"),
    ("max_tokens 0", [5] * 10, 0, "max_tokens"),
    ("negative max_tokens", [5] * 10, -5, "max_tokens"),
]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_bad_prompts_are_invalid_requests_that_never_reach_the_engine(
    tiny_model_dir: Path,
) -> None:
    with anyio.fail_after(HANG_GUARD):
        async with open_llm(tiny_model_dir, log_level="WARNING") as llm:
            assert (llm.ready.max_model_len, llm.ready.vocab_size) == (CONTEXT, VOCAB)
            reference = await run_one(llm, seeded_spec(1))
            adds_before = llm._mux.stats.adds_sent
            for case, prompt, max_tokens, param in _API_REJECTS:
                params = SamplingParams(max_tokens=max_tokens)
                with pytest.raises(InvalidRequest) as rejected:
                    await llm.complete(prompt, params, request_id=f"bad-{case}")
                assert rejected.value.param == param, case
                assert str(rejected.value), case
            assert llm._mux.stats.adds_sent == adds_before  # none reached the engine
            assert llm.stats.live_requests == 0

            # Exactly at the limits is fine: the whole context is usable.
            full = await llm.complete([5] * (CONTEXT - 1), SamplingParams(max_tokens=1))
            assert len(full.token_ids) == 1
            params = SamplingParams(max_tokens=12, seed=3, ignore_eos=True)
            to_the_end = Spec("to-the-end", [5] * (CONTEXT - 12), params)
            assert_complete(to_the_end, await run_one(llm, to_the_end))
            await _still_serving(llm, reference)


# -- checked again by the engine, for callers that skip the API's checks ----------------


def _bypass_cases() -> list[tuple[str, list[int], Any, str, type[Exception]]]:
    """(case, prompt, params, a word of the engine's error, what ``llm.complete`` raises).

    ``llm.complete`` raises InvalidRequest where the API process checks the
    case itself (``tserve.validity``: every field with a range), and
    RequestFailed where the mux finds the request cannot cross the wire.
    """
    ok = [5, 6, 7]
    p = SamplingParams
    invalid, failed = InvalidRequest, RequestFailed
    return [
        ("negative id", [5, -1], p(max_tokens=4), "vocabulary", invalid),
        ("id == vocab", [5, VOCAB], p(max_tokens=4), "vocabulary", invalid),
        ("empty prompt", [], p(max_tokens=4), "empty", invalid),
        ("prompt at the context", [5] * CONTEXT, p(max_tokens=1), "context", invalid),
        ("max_tokens past the context", ok, p(max_tokens=CONTEXT), "context", invalid),
        ("NaN temperature", ok, p(max_tokens=4, temperature=math.nan), "temperature", invalid),
        ("negative temperature", ok, p(max_tokens=4, temperature=-1.0), "temperature", invalid),
        ("infinite temperature", ok, p(max_tokens=4, temperature=math.inf), "temperature", invalid),
        ("top_p 0", ok, p(max_tokens=4, top_p=0.0), "top_p", invalid),
        ("NaN top_p", ok, p(max_tokens=4, top_p=math.nan), "top_p", invalid),
        ("top_k -2", ok, p(max_tokens=4, top_k=-2), "top_k", invalid),
        ("max_tokens 0", ok, p(max_tokens=0), "max_tokens", invalid),
        ("negative max_tokens", ok, p(max_tokens=-5), "max_tokens", invalid),
        (
            "stop id == vocab",
            ok,
            p(max_tokens=4, stop_token_ids=(VOCAB,)),
            "stop_token_ids",
            invalid,
        ),
        ("negative stop id", ok, p(max_tokens=4, stop_token_ids=(-1,)), "stop_token_ids", invalid),
        ("huge logprobs", ok, p(max_tokens=4, logprobs=10**6), "logprobs", invalid),
        ("negative logprobs", ok, p(max_tokens=4, logprobs=-1), "logprobs", invalid),
        (
            "NaN penalty",
            ok,
            p(max_tokens=4, presence_penalty=math.nan),
            "presence_penalty",
            invalid,
        ),
        # msgpack holds ints in [-2**63, 2**64 - 1]: these never leave the API process
        ("seed 2**64", ok, p(max_tokens=4, seed=2**64), "cannot be sent", failed),
        ("logprobs 2**70", ok, p(max_tokens=4, logprobs=2**70), "cannot be sent", invalid),
        ("id 2**64", [5, 2**64], p(max_tokens=4), "cannot be sent", invalid),
        # wrong types (a caller without a type checker): the engine could not decode them
        ("float id", [5, 6.5], p(max_tokens=4), "cannot be sent", failed),  # type: ignore[list-item]
        ("float top_k", ok, p(max_tokens=4, top_k=2.5), "cannot be sent", failed),  # type: ignore[arg-type]
    ]


# Odd but valid seeds: any 64-bit integer is a seed.
_ODD_SEEDS = [-1, -(2**63), 2**63, 2**64 - 1, 0]


async def test_the_engine_rejects_what_the_api_would_have_and_keeps_serving(
    tiny_model_dir: Path,
) -> None:
    """AddRequests straight into the mux, skipping the API's checks, in ONE
    frame together with good requests: each bad one ends alone with an error."""
    with anyio.fail_after(HANG_GUARD):
        async with open_llm(tiny_model_dir, log_level="WARNING") as llm:
            mux = llm._mux
            good = [seeded_spec(i, prefix="good") for i in range(6)]
            reference = await run_concurrently(llm, good)
            cases = _bypass_cases()
            seeded = [
                Spec(
                    f"seed={seed}",
                    [9, 8, 7],
                    SamplingParams(max_tokens=6, temperature=1.0, seed=seed, ignore_eos=True),
                )
                for seed in _ODD_SEEDS
            ]
            mailboxes: dict[str, Mailbox] = {}

            def submit(request_id: str, prompt: list[int], params: SamplingParams) -> None:
                mailboxes[request_id] = mux.open_mailbox(request_id, max(params.max_tokens, 1))
                mux.submit(AddRequest(request_id, prompt, params))

            frames_before = mux.stats.frames_sent
            for i, spec in enumerate(good):  # no await in between: one frame
                submit(spec.request_id, spec.prompt, spec.params)
                if i < len(cases):
                    case, prompt, params, *_ = cases[i]
                    submit(case, prompt, params)
            for case, prompt, params, *_ in cases[len(good) :]:
                submit(case, prompt, params)
            for spec in seeded:
                submit(spec.request_id, spec.prompt, spec.params)

            results: dict[str, list[Any]] = {}
            for request_id, mailbox in mailboxes.items():
                with mailbox:
                    results[request_id] = [output async for output in mailbox]
            assert mux.stats.frames_sent == frames_before + 1

            for case, _, _, word, _ in cases:
                (output,) = results[case]
                assert output.finish_reason is FinishReason.ERROR, case
                assert output.token_ids == [], case
                assert word in (output.error or ""), (case, output.error)
            for spec in good:
                tokens = [t for output in results[spec.request_id] for t in output.token_ids]
                assert tokens == reference[spec.request_id].token_ids, spec.request_id
                assert results[spec.request_id][-1].finish_reason is FinishReason.LENGTH
            for spec in seeded:
                outputs = results[spec.request_id]
                assert outputs[-1].finish_reason is FinishReason.LENGTH, spec.request_id
                assert len([t for output in outputs for t in output.token_ids]) == 6
            await _still_serving(llm, await run_one(llm, seeded_spec(1)))


async def test_the_same_cases_through_the_public_api_fail_alone(tiny_model_dir: Path) -> None:
    """SamplingParams is a plain struct, so an embedding caller can hand over
    anything: each case is an InvalidRequest or a clean RequestFailed."""
    with anyio.fail_after(HANG_GUARD):
        async with open_llm(tiny_model_dir, log_level="WARNING") as llm:
            reference = await run_one(llm, seeded_spec(1))
            for case, prompt, params, word, error in _bypass_cases():
                with pytest.raises(error) as raised:
                    await llm.complete(prompt, params, request_id=case)
                if error is RequestFailed:
                    assert word in str(raised.value), case
            await _still_serving(llm, reference)


# -- chat templates: the API process's own per-request failures --------------------------


_ODD_CHATS: list[tuple[str, Any]] = [
    ("missing content", [{"role": "user"}]),
    ("role not a string", [{"role": 5, "content": "hi"}]),
    ("content not a string", [{"role": "user", "content": 5}]),
    ("content None", [{"role": "user", "content": None}]),
    ("content parts", [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]),
    ("list instead of dict", [["user", "hi"]]),
    ("string instead of dict", ["hi"]),
    ("None instead of dict", [None]),
    ("a string for messages", "hello"),
]


async def test_chat_template_failures_fail_alone(tiny_model_dir: Path) -> None:
    with anyio.fail_after(HANG_GUARD):
        async with open_llm(tiny_model_dir, log_level="WARNING") as llm:
            neighbours = [seeded_spec(i, prefix="n", max_tokens=40) for i in range(16)]
            reference = await run_concurrently(llm, neighbours)
            chat = [{"role": "user", "content": "hello"}]
            chat_reference = await llm.complete_chat(chat, SamplingParams(max_tokens=5, seed=1))

            async def odd_chats() -> None:
                for case, messages in _ODD_CHATS:
                    with pytest.raises(InvalidRequest) as rejected:
                        await llm.complete_chat(messages, SamplingParams(max_tokens=4))
                    assert rejected.value.param == "messages", case
                    await anyio.lowlevel.checkpoint()

            # Renamed copies of the neighbours stream while the odd chats fail.
            again = [Spec(f"again-{s.request_id}", s.prompt, s.params) for s in neighbours]
            async with anyio.create_task_group() as tg:
                tg.start_soon(odd_chats)
                results = await run_concurrently(llm, again)
            for spec, copy in zip(neighbours, again, strict=True):
                assert_same(reference[spec.request_id], results[copy.request_id], spec.request_id)

            same_chat = await llm.complete_chat(chat, SamplingParams(max_tokens=5, seed=1))
            assert same_chat.token_ids == chat_reference.token_ids
            await _still_serving(llm, await run_one(llm, seeded_spec(1)))
