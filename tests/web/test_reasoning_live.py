"""Reasoning output against real servers of a tiny thinking model whose greedy output
is ``<think>REASONING</think>ANSWER`` (tests/web/thinking_model.py): chat completions
with the ``openai`` SDK, Messages with the ``anthropic`` SDK, and structured outputs
and tool calls after the thinking."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.web.conftest import Server, served
from tests.web.sdks import anthropic_client, openai_client
from tests.web.thinking_model import ANSWER, REASONING, build_thinking_model
from tserve.web._message_events import MessageChoice
from tserve.web._reasoning import QWEN3

pytestmark = pytest.mark.slow

HI: Any = [{"role": "user", "content": "Hi"}]
GREEDY: Any = {"temperature": 0}
WHOLE = f"<think>{REASONING}</think>{ANSWER}"
SCHEMA: Any = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["c", "f"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_thinking_model(tmp_path_factory.mktemp("thinking-model"))


@pytest.fixture(scope="module")
def auto(thinking_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The default, --reasoning-parser auto: the template writes <think>, so qwen3's."""
    yield from served(thinking_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def r1(thinking_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from served(thinking_dir, tmp_path_factory, "--reasoning-parser", "deepseek_r1")


@pytest.fixture(scope="module")
def plain(thinking_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from served(thinking_dir, tmp_path_factory, "--reasoning-parser", "none")


def _message(server: Server, **body: Any) -> dict[str, Any]:
    response = server.client.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": HI, **GREEDY, **body}
    )
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()["choices"][0]["message"]
    return result


@pytest.mark.parametrize("which", ["auto", "r1"])
def test_reasoning_content_is_split_from_the_answer(
    which: str, request: pytest.FixtureRequest
) -> None:
    server: Server = request.getfixturevalue(which)
    completion = openai_client(server).chat.completions.create(
        model="tiny", messages=HI, temperature=0
    )
    message = completion.choices[0].message
    assert message.content == ANSWER
    assert message.model_extra is not None
    assert message.model_extra["reasoning_content"] == REASONING
    assert completion.choices[0].finish_reason == "stop"
    # Usage is unchanged: the thinking and both tags are completion tokens.
    assert completion.usage is not None
    tokens = server.client.post("/tokenize", json={"model": "tiny", "prompt": WHOLE}).json()
    assert completion.usage.completion_tokens == tokens["count"] + 1  # and the eos


def test_streamed_reasoning_comes_first_in_its_own_deltas(auto: Server) -> None:
    stream = openai_client(auto).chat.completions.create(
        model="tiny", messages=HI, stream=True, temperature=0
    )
    reasoning, content, order = [], [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        extra = (delta.model_extra or {}).get("reasoning_content")
        if extra:
            reasoning.append(extra)
            order.append("reasoning")
        if delta.content:
            content.append(delta.content)
            order.append("content")
    assert "".join(reasoning) == REASONING
    assert "".join(content) == ANSWER
    assert order == sorted(order, key=["reasoning", "content"].index)


def test_max_tokens_inside_the_thinking_leaves_no_answer(auto: Server) -> None:
    message = _message(auto, max_tokens=3)
    assert message["content"] == ""
    assert REASONING.startswith(message["reasoning_content"])
    assert message["reasoning_content"]


def test_enable_thinking_false_reaches_the_template(auto: Server) -> None:
    message = _message(auto, chat_template_kwargs={"enable_thinking": False})
    assert message == {
        "role": "assistant",
        "content": ANSWER,
        "refusal": None,
        "reasoning_content": None,
    }
    for kwargs, param in [
        ({"messages": []}, "chat_template_kwargs.messages"),
        ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
        ("enable_thinking", "chat_template_kwargs"),
    ]:
        refused = auto.client.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": HI, "chat_template_kwargs": kwargs},
        )
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == param


def test_without_a_reasoning_parser_the_text_is_unchanged(plain: Server) -> None:
    message = _message(plain)
    assert message == {"role": "assistant", "content": WHOLE, "refusal": None}


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_applies_to_the_answer_after_the_thinking(auto: Server, stream: bool) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    client = openai_client(auto)
    if stream:
        reasoning, content = "", ""
        for chunk in client.chat.completions.create(
            model="tiny", messages=HI, response_format=fmt, stream=True, temperature=0
        ):
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
    else:
        message = (
            client.chat.completions.create(
                model="tiny", messages=HI, response_format=fmt, temperature=0
            )
            .choices[0]
            .message
        )
        reasoning = (message.model_extra or {})["reasoning_content"]
        content = message.content or ""
    assert reasoning == REASONING
    jsonschema.validate(json.loads(content), SCHEMA)


def test_a_required_tool_call_follows_the_thinking(auto: Server) -> None:
    choice = (
        openai_client(auto)
        .chat.completions.create(
            model="tiny",
            messages=HI,
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
        )
        .choices[0]
    )
    assert choice.finish_reason == "tool_calls"
    assert (choice.message.model_extra or {})["reasoning_content"] == REASONING
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["unit"] in ("c", "f")
    assert not choice.message.content


def test_streamed_tool_call_after_thinking(auto: Server) -> None:
    reasoning, names, arguments = "", [], ""
    for chunk in openai_client(auto).chat.completions.create(
        model="tiny",
        messages=HI,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        stream=True,
        temperature=0,
    ):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for call in delta.tool_calls or []:
            if call.function and call.function.name:
                names.append(call.function.name)
            arguments += (call.function.arguments if call.function else None) or ""
    assert reasoning == REASONING
    assert names == ["get_weather"]
    assert json.loads(arguments)["unit"] in ("c", "f")


# -- Messages -------------------------------------------------------------------------


THINKING: Any = {"type": "enabled", "budget_tokens": 1024}


def test_messages_thinking_block(auto: Server) -> None:
    message = anthropic_client(auto).messages.create(
        model="tiny", max_tokens=64, messages=HI, thinking=THINKING, extra_body=GREEDY
    )
    [thinking, text] = message.content
    assert thinking.type == "thinking"
    assert thinking.thinking == REASONING and thinking.signature == ""
    assert text.type == "text" and text.text == ANSWER
    assert message.stop_reason == "end_turn"


def test_messages_thinking_streamed(auto: Server) -> None:
    with anthropic_client(auto).messages.stream(
        model="tiny", max_tokens=64, messages=HI, thinking={"type": "adaptive"}, extra_body=GREEDY
    ) as stream:
        deltas = [event.delta.type for event in stream if event.type == "content_block_delta"]
        final = stream.get_final_message()
    assert deltas[0] == "thinking_delta" and deltas[-1] == "text_delta"
    [thinking, text] = final.content
    assert thinking.type == "thinking" and thinking.thinking == REASONING
    assert text.type == "text" and text.text == ANSWER


@pytest.mark.parametrize("thinking", [None, {"type": "disabled"}])
def test_messages_without_thinking_have_no_thinking_block(auto: Server, thinking: Any) -> None:
    extra = {} if thinking is None else {"thinking": thinking}
    client = anthropic_client(auto)
    message = client.messages.create(
        model="tiny", max_tokens=64, messages=HI, **extra, extra_body=GREEDY
    )
    assert [(b.type, getattr(b, "text", None)) for b in message.content] == [("text", ANSWER)]
    with client.messages.stream(
        model="tiny", max_tokens=64, messages=HI, **extra, extra_body=GREEDY
    ) as stream:
        types = {event.delta.type for event in stream if event.type == "content_block_delta"}
        assert types == {"text_delta"}
        assert stream.get_final_message().content[0].type == "text"


def test_thinking_not_asked_for_is_dropped_from_the_answer() -> None:
    """A model that thinks although its template was told not to: the thinking goes."""
    from tserve.nursery import Delta, Usage

    choice = MessageChoice(None, QWEN3, show_thinking=False)
    events = []
    for i, text in enumerate(["<thi", "nk>secret</th", "ink>\n\nHel", "lo"]):
        last = i == 3
        delta = Delta(
            text=text,
            token_ids=[i],
            finish_reason="stop" if last else None,
            usage=Usage(1, 4) if last else None,
        )
        events += choice.push(delta)
    assert choice.content() == [{"type": "text", "text": "Hello"}]
    assert all(e.get("delta", {}).get("type") != "thinking_delta" for e in events)


def test_responses_get_a_reasoning_item_before_the_answer(auto: Server) -> None:
    client = openai_client(auto)
    response = client.responses.create(model="tiny", input="Hi", temperature=0)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert [part.text for part in reasoning.content] == [REASONING]
    assert message.type == "message" and response.output_text == ANSWER
    with client.responses.stream(model="tiny", input="Hi", temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    assert final.output_text == ANSWER and final.output[0].type == "reasoning"
    # Continued, the stored reasoning is not shown to the template again.
    again = client.responses.create(
        model="tiny", input="And?", previous_response_id=response.id, temperature=0
    )
    assert again.status == "completed"
