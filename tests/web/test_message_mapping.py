"""The Messages API mapping, sans-IO: bodies to chat requests, deltas to blocks and events."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tserve.nursery import Delta, EngineDeadError, InvalidRequest, Usage
from tserve.web._errors import Unauthorized, anthropic_error_reply
from tserve.web._message_events import MessageOutput
from tserve.web._message_requests import parse_count_tokens, parse_messages
from tserve.web._sse import SSEOrderError
from tserve.web._tool_formats import ToolFormat
from tserve.web._tools import ToolPlan


def parse(**body: Any) -> Any:
    return parse_messages(json.dumps({"model": "m", "max_tokens": 8, **body}).encode())


TOOL: Any = {"name": "add", "input_schema": {"type": "object", "properties": {}}}
CONVERSATION: Any = [
    {"role": "user", "content": "Add."},
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "hm", "signature": "s"},
            {"type": "text", "text": "Calling."},
            {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1}},
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                {"type": "text", "text": "2"}], "is_error": True},
            {"type": "text", "text": "Thanks"},
        ],
    },
]  # fmt: skip


def test_a_conversation_becomes_chat_messages() -> None:
    req = parse(
        system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
        messages=CONVERSATION,
        tools=[TOOL],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["##"],
        top_k=5,
        metadata={"user_id": "u"},
    )
    assert req.messages == [
        {"role": "system", "content": "A\n\nB"},
        {"role": "user", "content": "Add."},
        {
            "role": "assistant",
            "content": "Calling.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": {"a": 1}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "name": "add", "content": "Error: 2"},
        {"role": "user", "content": "Thanks"},
    ]
    assert req.n == 1 and req.max_tokens == 8 and req.max_tokens_fits
    assert req.params.stop == ("##",) and req.params.top_k == 5
    assert req.params.temperature is None  # the engine's default
    assert req.tools is not None
    assert req.tools.choice == "required" and not req.tools.parallel


def test_no_tools_with_choice_auto_is_no_tools() -> None:
    req = parse(messages=[{"role": "user", "content": "x"}], tools=[], tool_choice={"type": "auto"})
    assert req.tools is None


def test_count_tokens_needs_no_max_tokens() -> None:
    req = parse_count_tokens(json.dumps({"model": "m", "messages": CONVERSATION}).encode())
    assert req.tools is None and len(req.messages) == 4


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"tool_choice": {"type": "tool"}, "tools": [TOOL]}, "tool_choice.name"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tools": [TOOL, TOOL]}, "tools[1].name"),
        ({"tools": [{"name": "x"}]}, "tools[0].input_schema"),
        ({"stop_sequences": [""]}, "stop_sequences[0]"),
        ({"system": [{"type": "image"}]}, "system"),
    ],
)
def test_bad_fields_are_named(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse(**{"messages": [{"role": "user", "content": "x"}], **body})
    assert info.value.param is not None and info.value.param.startswith(param)


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_tool_result_content_nested_deeply_is_a_400(depth: int) -> None:
    block = '{"type":"tool_result","tool_use_id":"t","content":[' * depth + "]}" * depth
    raw = '{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[' + block + "]}]}"
    with pytest.raises(InvalidRequest):
        parse_messages(raw.encode())


def test_too_many_stop_sequences_are_refused() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse(messages=[{"role": "user", "content": "x"}], stop_sequences=["a"] * 17)
    assert info.value.param == "stop_sequences"


def test_a_tool_result_answers_only_the_message_before() -> None:
    late = [*CONVERSATION[:2], {"role": "user", "content": "x"}, CONVERSATION[2]]
    with pytest.raises(InvalidRequest) as info:
        parse(messages=late)
    assert info.value.param == "messages[1].content"


def test_error_replies_in_anthropic_shape() -> None:
    bad = anthropic_error_reply(InvalidRequest("too many", param="stop_sequences"), "r")
    assert bad.status == 400
    assert bad.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "too many ('stop_sequences')"},
    }
    assert anthropic_error_reply(Unauthorized("no"), "r").body["error"]["type"] == (
        "authentication_error"
    )
    dead = anthropic_error_reply(EngineDeadError("gone"), "r")
    assert dead.status == 529 and dead.body["error"]["type"] == "overloaded_error"
    assert dead.headers["Retry-After"].isdigit()
    assert anthropic_error_reply(ValueError("bug"), "r").body["error"]["type"] == "api_error"


class _Stream:
    prompt_token_ids = [1, 2, 3]


def decode(data: bytes) -> list[tuple[str, Any]]:
    out = []
    for event in data.decode().split("\n\n"):
        if event:
            name, payload = event.split("\n")
            out.append((name.removeprefix("event: "), json.loads(payload.removeprefix("data: "))))
    return out


def hermes_plan() -> ToolPlan:
    req = parse(messages=[{"role": "user", "content": "x"}], tools=[TOOL])
    assert req.tools is not None
    return ToolPlan(req.tools, ToolFormat.HERMES)


def test_text_then_a_tool_call_as_blocks_split_anywhere() -> None:
    output = ("Sure. <tool_call>\n"
              '{"name": "add", "arguments": {"a": 1}}\n</tool_call>')  # fmt: skip
    whole = MessageOutput("m", hermes_plan())
    whole.choice.push(Delta(output, [1], None, "stop", Usage(3, 9)))
    expected = whole.response()
    assert expected["stop_reason"] == "tool_use"
    content = expected["content"]
    assert content[0] == {"type": "text", "text": "Sure. "}
    assert content[1]["type"] == "tool_use" and content[1]["input"] == {"a": 1}
    for size in (1, 3, 7):
        streamed = MessageOutput("m", hermes_plan())
        events = streamed.events([_Stream()], "r")  # type: ignore[list-item]
        pieces = [output[i : i + size] for i in range(0, len(output), size)]
        data = b"".join(events.chunk(0, Delta(p, [1])) for p in pieces[:-1])
        data += events.chunk(0, Delta(pieces[-1], [1], None, "stop", Usage(3, 9)))
        assert events.close() == []
        decoded = decode(data)
        assert [n for n, _ in decoded[:2]] == ["message_start", "ping"]
        assert decoded[0][1]["message"]["usage"] == {"input_tokens": 3, "output_tokens": 0}
        assert decoded[-2][1] == {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use", "stop_sequence": None},
            "usage": {"output_tokens": 9},
        }
        text = "".join(d["delta"].get("text", "") for n, d in decoded if n == "content_block_delta")
        arguments = "".join(
            d["delta"].get("partial_json", "") for n, d in decoded if n == "content_block_delta"
        )
        assert text == "Sure. " and json.loads(arguments) == {"a": 1}
        assert [d["index"] for n, d in decoded if n == "content_block_stop"] == [0, 1]


def test_a_stream_cut_short_ends_with_an_error_event_and_nothing_after() -> None:
    events = MessageOutput("m", None).events([_Stream()], "r")  # type: ignore[list-item]
    events.chunk(0, Delta("Hi", [1]))
    (error,) = decode(events.close(EngineDeadError("gone"))[0])
    assert error[0] == "error" and error[1]["error"]["type"] == "overloaded_error"
    assert events.status == 529
    with pytest.raises(SSEOrderError):
        events.chunk(0, Delta("!", [2]))
    cut = MessageOutput("m", None).events([_Stream()], "r")  # type: ignore[list-item]
    cut.chunk(0, Delta("Hi", [1]))
    assert decode(cut.close()[0])[0][0] == "error"  # no error given, still never silent


def test_stop_reasons() -> None:
    for delta, reason, sequence in [
        (Delta("a", [1], None, "length", Usage(1, 1)), "max_tokens", None),
        (Delta("a", [1], None, "stop", Usage(1, 1), "##"), "stop_sequence", "##"),
        (Delta("a", [1], None, "stop", Usage(1, 1)), "end_turn", None),
    ]:
        output = MessageOutput("m", None)
        output.choice.push(delta)
        body = output.response()
        assert (body["stop_reason"], body["stop_sequence"]) == (reason, sequence)
        assert body["content"] == [{"type": "text", "text": "a"}]
