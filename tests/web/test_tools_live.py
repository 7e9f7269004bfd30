"""Tool calling through the official openai SDK against a real server on the tiny model:
its own template (which ignores tools: the generic format) and a Hermes-style one."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import FunctionToolCallArgumentsDeltaEvent as ArgumentsDelta

from tests.nursery import chat_templates
from tests.web.conftest import Server, served
from tests.web.sdks import openai_client
from tests.web.test_structured_requests import HISTORY

pytestmark = pytest.mark.slow

WEATHER_PARAMETERS: Any = {  # also those of test_messages_live's and test_responses_live's tools
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": WEATHER_PARAMETERS,
    },
}


@pytest.fixture(scope="module")
def hermes_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a Hermes/Qwen-style template that renders tools and calls
    (each tool by its name only: the tiny model has 512 positions)."""
    directory = tmp_path_factory.mktemp("hermes") / "model"
    shutil.copytree(tiny_model_dir, directory)
    template = chat_templates.TOOLS.replace("{{- tool | tojson }}", "{{- tool.function.name }}")
    assert template != chat_templates.TOOLS
    (directory / "chat_template.jinja").write_text(template)
    return directory


@pytest.fixture(scope="module")
def hermes(hermes_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from served(hermes_dir, tmp_path_factory, folder="hermes-server")


@pytest.mark.parametrize("which", ["generic", "hermes"])
def test_history_with_tool_calls_renders(which: str, server: Server, hermes: Server) -> None:
    srv = server if which == "generic" else hermes
    for tools in ([WEATHER], openai.omit):
        out = openai_client(srv).chat.completions.create(
            model="tiny", messages=HISTORY, max_tokens=4, tools=tools
        )
        assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt = srv.client.post("/tokenize", json={"messages": HISTORY}).json()
    assert prompt["count"] > 0


def test_the_hermes_template_sees_the_tools(hermes: Server) -> None:
    with_tools = hermes.client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": HISTORY, "tools": [WEATHER], "max_tokens": 1},
    ).json()
    without = hermes.client.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": HISTORY, "max_tokens": 1}
    ).json()
    assert with_tools["usage"]["prompt_tokens"] > without["usage"]["prompt_tokens"] + 5


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tools_answer_and_never_fail(server: Server, stream: bool) -> None:
    """The tiny model writes garbage: whatever it is, it comes back as content or calls."""
    for seed in range(4):
        args: Any = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Weather in Oslo?"}],
            "tools": [WEATHER],
            "tool_choice": "auto",
            "max_tokens": 12,
            "seed": seed,
        }
        if not stream:
            out = openai_client(server).chat.completions.create(**args)
            message = out.choices[0].message
            assert message.content is not None or message.tool_calls
            continue
        finishes = [
            chunk.choices[0].finish_reason
            for chunk in openai_client(server).chat.completions.create(**args, stream=True)
            if chunk.choices
        ]
        assert finishes[-1] in ("stop", "length", "tool_calls")


CLOCK: Any = {
    "type": "function",
    "function": {
        "name": "now",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"enum": ["UTC", "CET"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
ASK: Any = [{"role": "user", "content": "Oslo?"}]


def valid_calls(calls: Any, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.parametrize("which", ["generic", "hermes"])
@pytest.mark.parametrize(
    ("choice", "names"),
    [
        ("required", {"get_weather", "now"}),
        ({"type": "function", "function": {"name": "now"}}, {"now"}),
    ],
)
def test_required_and_named_calls_validate(
    which: str, choice: Any, names: set[str], server: Server, hermes: Server
) -> None:
    srv = server if which == "generic" else hermes
    for seed in range(2):
        out = openai_client(srv).chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=[WEATHER, CLOCK],
            tool_choice=choice,
            parallel_tool_calls=False,
            max_tokens=100,
            seed=seed,
            n=2,
        )
        for answer in out.choices:
            assert answer.finish_reason == "tool_calls"
            assert answer.message.content is None
            assert answer.message.tool_calls is not None and len(answer.message.tool_calls) == 1
            valid_calls(answer.message.tool_calls, names)


@pytest.mark.parametrize("which", ["generic", "hermes"])
def test_streamed_calls_are_assembled_by_the_sdk(
    which: str, server: Server, hermes: Server
) -> None:
    srv = server if which == "generic" else hermes
    for seed in range(2):
        with openai_client(srv).chat.completions.stream(
            model="tiny",
            messages=ASK,
            tools=[WEATHER, CLOCK],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=100,
            seed=seed,
        ) as stream:
            arguments = [e.arguments_delta for e in stream if isinstance(e, ArgumentsDelta)]
            final = stream.get_final_completion()
        choice = final.choices[0]
        assert choice.finish_reason == "tool_calls" and arguments
        valid_calls(choice.message.tool_calls, set(PARAMETERS))
        assert "".join(arguments) == "".join(
            c.function.arguments for c in choice.message.tool_calls or []
        )
