"""Request validation, sans-IO: every field, its type, its range, and the name in the error."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tserve.nursery import InvalidRequest
from tserve.web._bodies import MAX_CHOICES
from tserve.web._requests import (
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}


def body(base: dict[str, Any], **fields: Any) -> bytes:
    return json.dumps({**base, **fields}).encode()


def test_completion_defaults() -> None:
    req = parse_completion(body(COMPLETION))
    assert req.prompts == ["hi"] and req.n == 1 and not req.stream and not req.echo
    assert req.params.max_tokens == 16
    # Left out: unset, for the engine to fill with the model's defaults (else OpenAI's).
    assert (req.params.temperature, req.params.top_p, req.params.top_k) == (None, None, None)
    assert req.params.logprobs is None and req.logprobs is None


def test_completion_maps_every_sampling_field() -> None:
    req = parse_completion(
        body(
            COMPLETION,
            model="m",
            max_tokens=7,
            temperature=0.5,
            top_p=0.9,
            top_k=40,
            seed=-3,
            stop=["a", "bc"],
            n=3,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            user="u",
            stream=True,
            stream_options={"include_usage": True},
            ignore_eos=True,
            stop_token_ids=[5, 6],
            logprobs=2,
            best_of=1,
            logit_bias={},
            suffix="",
            unknown_field={"anything": [1]},
        )
    )
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (7, 0.5, 0.9, 40, -3)
    assert p.stop == ("a", "bc") and p.stop_token_ids == (5, 6) and p.ignore_eos
    assert (p.presence_penalty, p.frequency_penalty, p.logprobs) == (0.5, -0.5, 2)
    assert req.n == 3 and req.stream and req.include_usage and req.model == "m"


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("text", ["text"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_prompt_shapes(prompt: Any, expected: Any) -> None:
    assert parse_completion(body({}, prompt=prompt)).prompts == expected


def test_stop_string_and_top_k_minus_one() -> None:
    req = parse_completion(body(COMPLETION, stop="x", top_k=-1))
    assert req.params.stop == ("x",) and req.params.top_k == 0


def test_include_usage_needs_stream() -> None:
    req = parse_completion(body(COMPLETION, stream_options={"include_usage": True}))
    assert not req.include_usage


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": 5}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [[1], []]}, "prompt[1]"),
        ({"prompt": [-1]}, "prompt[0]"),
        ({"prompt": [True]}, "prompt[0]"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 2**70}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"seed": 2**64}, "seed"),
        ({"seed": "1"}, "seed"),
        ({"stop": ""}, "stop"),
        ({"stop": [""]}, "stop[0]"),
        ({"stop": [1]}, "stop[0]"),
        ({"stop": ["s"] * 17}, "stop"),
        ({"n": 0}, "n"),
        ({"n": MAX_CHOICES + 1}, "n"),
        ({"prompt": ["a", "b"], "n": MAX_CHOICES}, "n"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"echo": "yes"}, "echo"),
        ({"stream": 1}, "stream"),
        ({"stream_options": []}, "stream_options"),
        ({"stream_options": {"include_usage": "x"}}, "stream_options.include_usage"),
        ({"user": 5}, "user"),
        ({"model": 5}, "model"),
        ({"ignore_eos": "no"}, "ignore_eos"),
        ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
        ({"best_of": 2}, "best_of"),
        ({"suffix": "tail"}, "suffix"),
        ({"logit_bias": {"five": 1.0}}, "logit_bias"),
        ({"min_tokens": 3}, "min_tokens"),
        ({"echo": True, "logprobs": 1}, "echo"),
    ],
)
def test_completion_rejects(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_completion(body(COMPLETION, **fields))
    assert info.value.param == param
    assert param.split("[")[0].split(".")[0] in str(info.value)


def test_missing_prompt_names_it() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_completion(b"{}")
    assert info.value.param == "prompt"


@pytest.mark.parametrize(
    "raw", [b"", b"{", b"[1]", b"null", b'"x"', b"\xff\xfe", b'{"prompt": "a"} trailing']
)
def test_not_a_json_object(raw: bytes) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_completion(raw)
    assert info.value.param is None


def test_chat_defaults_and_fields() -> None:
    req = parse_chat(body(CHAT))
    assert req.max_tokens is None and req.logprobs is None and req.n == 1
    assert req.messages == [{"role": "user", "content": "hi"}]
    req = parse_chat(body(CHAT, max_tokens=5, max_completion_tokens=9, logprobs=True))
    assert req.max_tokens == 9 and req.params.max_tokens == 9 and req.logprobs == 0
    req = parse_chat(body(CHAT, logprobs=True, top_logprobs=4, response_format={"type": "text"}))
    assert req.params.logprobs == 4


def test_chat_message_shapes() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "developer", "content": None},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok", "name": "bot"},
        {"role": "tool", "content": "42", "tool_call_id": "t1"},
    ]
    req = parse_chat(body({}, messages=messages))
    assert [m["content"] for m in req.messages] == ["be brief", "", "ab", "ok", "42"]
    assert req.messages[3]["name"] == "bot" and req.messages[4]["tool_call_id"] == "t1"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0].type",
        ),
        ({"messages": [{"role": "assistant", "tool_calls": [5]}]}, "messages[0].tool_calls[0]"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"logprobs": 1}, "logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"functions": [{}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"response_format": {"type": "json_objects"}}, "response_format.type"),
        ({"audio": {}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"prediction": {"type": "content"}}, "prediction"),
        ({"n": 0}, "n"),
        ({"temperature": 3}, "temperature"),
    ],
)
def test_chat_rejects(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_chat(body(CHAT, **fields))
    assert info.value.param == param


def test_chat_accepts_harmless_known_fields() -> None:
    parse_chat(body(CHAT, tool_choice="none", tools=[], parallel_tool_calls=True))


def test_tokenize_and_detokenize() -> None:
    assert parse_tokenize(b'{"prompt": "a"}').prompt == "a"
    assert parse_tokenize(body({}, messages=CHAT["messages"])).messages == CHAT["messages"]
    with pytest.raises(InvalidRequest):
        parse_tokenize(b"{}")
    with pytest.raises(InvalidRequest):
        parse_tokenize(body({"prompt": "a"}, messages=CHAT["messages"]))
    assert parse_detokenize(b'{"tokens": [1, 2]}').tokens == [1, 2]
    with pytest.raises(InvalidRequest) as info:
        parse_detokenize(b'{"tokens": [1, -2]}')
    assert info.value.param == "tokens[1]"
