"""Bodies a hostile client sends, sans-IO: every one is an InvalidRequest (a 400
naming the field where there is one), never another exception."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tserve.nursery import InvalidRequest
from tserve.web._bodies import MAX_MESSAGES, MAX_STOP_LENGTH
from tserve.web._errors import error_reply
from tserve.web._message_requests import parse_count_tokens, parse_messages
from tserve.web._requests import (
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_embeddings,
    parse_tokenize,
)

PARSERS: list[Callable[[bytes], object]] = [
    parse_completion,
    parse_chat,
    parse_tokenize,
    parse_detokenize,
    parse_embeddings,
    parse_messages,
    parse_count_tokens,
]
MESSAGE = {"role": "user", "content": "hi"}


def nested(depth: int, open_: bytes = b"[", close: bytes = b"]") -> bytes:
    return open_ * depth + b"1" + close * depth


@pytest.mark.parametrize("parse", PARSERS)
@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_deep_nesting_anywhere_is_a_400(parse: Callable[[bytes], object], depth: int) -> None:
    arrays = b'{"prompt":"x","messages":[],"tokens":[],"input":"x","foo":' + nested(depth) + b"}"
    objects = b'{"prompt":' + nested(depth, b'{"a":', b"}") + b"}"
    for raw in (arrays, objects, nested(depth)):
        with pytest.raises(InvalidRequest):
            parse(raw)


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"prompt":"\\ud800"}', None),  # a lone high surrogate
        (b'{"prompt":"a\\udfffb"}', None),  # a lone low surrogate
        (b'{"prompt":"\xff\xfe"}', None),  # not UTF-8
        (b'{"prompt":"hi","max_tokens":1' + b"0" * 400 + b"}", "max_tokens"),
        (b'{"prompt":"hi","seed":-1' + b"0" * 30 + b"}", "seed"),
        (b'{"prompt":"hi","temperature":1e400}', "temperature"),
        (b'{"prompt":"hi","temperature":NaN}', None),
        (b'{"prompt":"hi","top_p":-Infinity}', None),
        (b'{"prompt":"hi","temperature":"1"}', "temperature"),
        (b'{"prompt":{"a":1}}', "prompt"),
        (b'{"prompt":[1,"a"]}', "prompt"),
        (b'{"prompt":[[1],[]]}', "prompt[1]"),
        (b'{"prompt":[-1]}', "prompt[0]"),
        (b'{"prompt":"hi","stop_token_ids":[18446744073709551616]}', "stop_token_ids[0]"),
        (b'{"prompt":"hi","n":true}', "n"),
        (b'{"prompt":"hi","stream_options":[]}', "stream_options"),
        (b"[]", None),
        (b"", None),
        (b"\x00", None),
    ],
)
def test_completion_bodies_out_of_range_name_their_field(raw: bytes, param: str | None) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_completion(raw)
    assert info.value.param == param


def test_negative_zero_is_zero() -> None:
    assert parse_completion(b'{"prompt":"hi","temperature":-0.0}').params.temperature == 0.0


def chat(**fields: Any) -> bytes:
    return json.dumps({"messages": [MESSAGE], **fields}).encode()


def test_the_number_of_messages_is_bounded() -> None:
    at_bound = [MESSAGE] * MAX_MESSAGES
    assert len(parse_chat(json.dumps({"messages": at_bound}).encode()).messages) == MAX_MESSAGES
    for parse in (parse_chat, parse_tokenize):
        with pytest.raises(InvalidRequest) as info:
            parse(json.dumps({"messages": [*at_bound, MESSAGE]}).encode())
        assert info.value.param == "messages"


@pytest.mark.parametrize("parse", [parse_completion, parse_chat])
def test_stop_strings_are_bounded_in_length(parse: Callable[[bytes], Any]) -> None:
    base = {"prompt": "hi", "messages": [MESSAGE]}
    ok = parse(json.dumps({**base, "stop": ["x" * MAX_STOP_LENGTH]}).encode())
    assert ok.params.stop == ("x" * MAX_STOP_LENGTH,)
    for stop, param in ((["x" * (MAX_STOP_LENGTH + 1)], "stop[0]"), ("y" * 5000, "stop")):
        with pytest.raises(InvalidRequest) as info:
            parse(json.dumps({**base, "stop": stop}).encode())
        assert info.value.param == param


def test_message_fields_of_the_wrong_type_name_the_field() -> None:
    cases = [
        ({"role": "robot", "content": "x"}, "messages[0].role"),
        ({"role": "user", "content": 5}, "messages[0].content"),
        ({"role": "user", "content": [{"type": "text", "text": 1}]}, "messages[0].content[0].text"),
        ({"content": "x"}, "messages[0].role"),
    ]
    for message, param in cases:
        with pytest.raises(InvalidRequest) as info:
            parse_chat(json.dumps({"messages": [message]}).encode())
        assert info.value.param == param


def test_a_recursion_error_from_anywhere_is_a_400_not_a_500() -> None:
    reply = error_reply(RecursionError("maximum recursion depth exceeded"), "rid")
    assert reply.status == 400
    assert reply.body["error"]["code"] == "nested_too_deeply"
