"""The Responses API mapping, sans-IO: bodies to chat requests, deltas to output items
and events, and the store's bounds, without sockets, processes or models."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tserve.nursery import Delta, EngineDeadError, InvalidRequest, Usage
from tserve.web._reasoning import syntax_named
from tserve.web._response_events import ResponseOutput
from tserve.web._response_requests import parse_responses
from tserve.web._response_store import ResponseStore, StoredResponse
from tserve.web._sse import SSEOrderError
from tserve.web._tool_formats import ToolFormat
from tserve.web._tools import ToolPlan

TOOL: Any = {"type": "function", "name": "add", "parameters": {"type": "object"}}


class _Stream:
    prompt_token_ids = [1, 2, 3]


def parse(**body: Any) -> Any:
    return parse_responses(json.dumps({"model": "m", **body}).encode())


def test_items_become_the_chat_the_template_sees() -> None:
    req = parse(
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Rules."},
            {"role": "user", "content": [{"type": "input_text", "text": "Add."}]},
            {"role": "assistant", "content": "Sure."},
            {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'},
            {"type": "function_call", "call_id": "c2", "name": "add", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "1"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call_output", "call_id": "c2", "output": [
                {"type": "input_text", "text": "2"}]},
        ],
        tools=[TOOL],
    )  # fmt: skip
    messages = req.chat([]).messages
    assert [m["role"] for m in messages] == [
        "system",
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
    ]
    assert messages[0]["content"] == "Be brief." and messages[1]["content"] == "Rules."
    calls = messages[3]["tool_calls"]
    assert messages[3]["content"] == "Sure." and [c["id"] for c in calls] == ["c1", "c2"]
    assert calls[0]["function"]["arguments"] == {"a": 1}
    assert messages[4] == {"role": "tool", "tool_call_id": "c1", "name": "add", "content": "1"}
    assert messages[5]["content"] == "2"
    assert all(item["id"] and item["status"] == "completed" for item in req.items)
    assert len(req.items) == 7  # the reasoning item dropped


def test_history_comes_before_the_input_and_answers_its_calls() -> None:
    call = {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "add",
            "arguments": "{}", "status": "completed"}  # fmt: skip
    user = {"type": "message", "id": "msg_1", "role": "user", "status": "completed",
            "content": [{"type": "input_text", "text": "Add."}]}  # fmt: skip
    req = parse(input=[{"type": "function_call_output", "call_id": "c1", "output": "3"}])
    messages = req.chat([user, call]).messages
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    with pytest.raises(InvalidRequest) as info:
        req.chat([user])
    assert info.value.param == "input[0].call_id"


def test_a_stored_call_cut_short_is_shown_with_no_arguments() -> None:
    cut = {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "add",
           "arguments": '{"a": 1', "status": "incomplete"}  # fmt: skip
    req = parse(input=[{"type": "function_call_output", "call_id": "c1", "output": "?"}])
    assistant = req.chat([cut]).messages[0]
    assert assistant["tool_calls"][0]["function"]["arguments"] == {}


def test_namespaces_and_hosted_tools() -> None:
    req = parse(
        input="x",
        tools=[{"type": "namespace", "name": "ns", "tools": [TOOL]}, {"type": "web_search"}],
    )
    assert req.namespaces == {"add": "ns"} and req.tools is not None
    assert list(req.tools.parameters) == ["add"]
    assert [t["type"] for t in req.echo["tools"]] == ["namespace", "web_search"]


def test_a_forced_call_leaves_the_format_for_later_and_auto_keeps_it() -> None:
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}
    forced = parse(input="x", tools=[TOOL], tool_choice="required", text=fmt)
    assert forced.params.constraint is None and forced.constraint_field is None
    auto = parse(input="x", tools=[TOOL], text=fmt)
    assert auto.params.constraint is not None and auto.constraint_field == "text.format"


def hermes_plan() -> ToolPlan:
    req = parse(input="x", tools=[TOOL])
    assert req.tools is not None
    return ToolPlan(req.tools, ToolFormat.HERMES)


def decode(data: bytes) -> list[dict[str, Any]]:
    out = []
    for event in data.decode().split("\n\n"):
        if event:
            name, payload = event.split("\n")
            decoded = json.loads(payload.removeprefix("data: "))
            assert name.removeprefix("event: ") == decoded["type"]
            out.append(decoded)
    return out


def test_text_then_a_call_as_items_split_anywhere() -> None:
    output = 'Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    stored: list[dict[str, Any]] = []
    whole = ResponseOutput("m", hermes_plan(), response_id="resp_1", echo={}, on_end=stored.append)
    whole.choice.push(Delta(output, [1], None, "stop", Usage(3, 9, 2)))
    expected = whole.response()
    assert stored == [expected] and expected["status"] == "completed"
    message, call = expected["output"]
    assert message["content"][0]["text"] == "Sure. " and message["status"] == "completed"
    assert call["type"] == "function_call" and json.loads(call["arguments"]) == {"a": 1}
    assert expected["usage"]["input_tokens_details"]["cached_tokens"] == 2
    for size in (1, 3, 7):
        streamed = ResponseOutput("m", hermes_plan(), response_id="resp_1", echo={})
        events = streamed.events([_Stream()], "r")  # type: ignore[list-item]
        pieces = [output[i : i + size] for i in range(0, len(output), size)]
        data = b"".join(events.chunk(0, Delta(p, [1])) for p in pieces[:-1])
        data += events.chunk(0, Delta(pieces[-1], [1], None, "stop", Usage(3, 9, 2)))
        assert events.close() == []
        decoded = decode(data)
        assert [e["sequence_number"] for e in decoded] == list(range(len(decoded)))
        assert decoded[-1]["type"] == "response.completed"
        final = decoded[-1]["response"]
        for got, want in zip(final["output"], expected["output"], strict=True):
            assert {**got, "id": "", "call_id": ""} == {**want, "id": "", "call_id": ""}


def test_a_length_finish_is_incomplete() -> None:
    output = ResponseOutput("m", None, response_id="resp_1", echo={})
    output.choice.push(Delta("Hi", [1], None, "length", Usage(3, 1)))
    response = output.response()
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["status"] == "incomplete"


def test_a_stream_cut_short_ends_with_response_failed_and_nothing_after() -> None:
    stored: list[dict[str, Any]] = []
    output = ResponseOutput("m", None, response_id="resp_1", echo={}, on_end=stored.append)
    events = output.events([_Stream()], "r")  # type: ignore[list-item]
    events.chunk(0, Delta("Hi", [1]))
    (failed,) = decode(events.close(EngineDeadError("gone"))[0])
    assert failed["type"] == "response.failed" and failed["sequence_number"] == 5
    assert failed["response"]["status"] == "failed" and stored[0]["status"] == "failed"
    assert events.status == 503
    with pytest.raises(SSEOrderError):
        events.chunk(0, Delta("!", [2]))
    refused = ResponseOutput("m", None, response_id="resp_2", echo={})
    cut = refused.events([_Stream()], "r")  # type: ignore[list-item]
    names = [e["type"] for e in decode(cut.close(InvalidRequest("no", param="input"))[0])]
    assert names == ["response.created", "response.in_progress", "error"]


def record(response_id: str, size: int = 0) -> StoredResponse:
    response = {"id": response_id, "created_at": 0, "output": [], "pad": "x" * size}
    return StoredResponse(response=response, input_items=[])


def rid(i: int) -> str:
    return f"resp_{i:032x}"


def test_the_store_keeps_gets_deletes_and_refuses_odd_ids(tmp_path: Path) -> None:
    store = ResponseStore(str(tmp_path), max_bytes=1 << 20, ttl=60)
    assert store.put(record(rid(1)))
    got = store.get(rid(1))
    assert got is not None and got.response["id"] == rid(1)
    assert store.get("resp_../../etc/passwd") is None and store.get(rid(2)) is None
    assert store.delete(rid(1)) and not store.delete(rid(1)) and store.get(rid(1)) is None


def test_the_store_forgets_what_is_past_its_age(tmp_path: Path) -> None:
    now = [1_000_000.0]
    store = ResponseStore(str(tmp_path), max_bytes=1 << 20, ttl=60, clock=lambda: now[0])
    store.put(record(rid(1)))
    now[0] += 60
    assert store.get(rid(1)) is not None
    now[0] += 1
    assert store.get(rid(1)) is None
    store.sweep()
    assert not (tmp_path / f"{rid(1)}.json").exists()


def test_the_store_evicts_the_oldest_past_its_budget(tmp_path: Path) -> None:
    budget = 16 * 1024
    start = 1_000_000.0
    store = ResponseStore(str(tmp_path), max_bytes=budget, ttl=3600, clock=lambda: start + 200)
    for i in range(100):
        assert store.put(record(rid(i), 500))
        os.utime(tmp_path / f"{rid(i)}.json", (start + i, start + i))  # a strict order
        assert store.used_bytes() <= budget + budget // 16
    store.sweep()
    kept = [i for i in range(100) if store.get(rid(i)) is not None]
    assert 10 < len(kept) < 40  # ~600 bytes each
    assert kept == list(range(100 - len(kept), 100)) and store.used_bytes() <= budget
    assert not store.put(record(rid(200), budget // 8))  # past a sixteenth: not stored
    assert store.get(rid(200)) is None


def test_thinking_is_a_reasoning_item_before_the_answer_split_anywhere() -> None:
    syntax = syntax_named("qwen3")
    output = "<think>Add them.</think>Sure."
    for size in (1, 2, 5, len(output)):
        streamed = ResponseOutput("m", None, response_id="resp_1", echo={}, reasoning=syntax)
        events = streamed.events([_Stream()], "r")  # type: ignore[list-item]
        pieces = [output[i : i + size] for i in range(0, len(output), size)]
        data = b"".join(events.chunk(0, Delta(p, [1])) for p in pieces[:-1])
        data += events.chunk(0, Delta(pieces[-1], [1], None, "stop", Usage(3, 9)))
        decoded = decode(data)
        thinking = "".join(
            e["delta"] for e in decoded if e["type"] == "response.reasoning_text.delta"
        )
        answer = "".join(e["delta"] for e in decoded if e["type"] == "response.output_text.delta")
        assert (thinking, answer) == ("Add them.", "Sure.")
        reasoning, message = decoded[-1]["response"]["output"]
        assert reasoning["type"] == "reasoning" and reasoning["summary"] == []
        assert reasoning["content"] == [{"type": "reasoning_text", "text": "Add them."}]
        assert message["content"][0]["text"] == "Sure."
    # A stored reasoning item is not shown to the template when the conversation goes on.
    req = parse(input="More?")
    assert [m["role"] for m in req.chat([reasoning, message]).messages] == ["assistant", "user"]
