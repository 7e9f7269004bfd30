"""Tool calling through the official openai SDK against a real server on the tiny model:
its own template (which ignores tools: the generic format) and a Hermes-style one."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.nursery import chat_templates
from tests.web.conftest import API_KEY, Server, keyed_server

pytestmark = pytest.mark.slow

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Today's weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
HISTORY: Any = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


@pytest.fixture(scope="module")
def hermes_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a Hermes/Qwen-style template that renders tools and calls."""
    directory = tmp_path_factory.mktemp("hermes") / "model"
    shutil.copytree(tiny_model_dir, directory)
    (directory / "chat_template.jinja").write_text(chat_templates.TOOLS)
    return directory


@pytest.fixture(scope="module")
def hermes(hermes_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("hermes-server") / "server.log"
    with keyed_server(hermes_dir, log=log) as srv:
        yield srv


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.mark.parametrize("which", ["generic", "hermes"])
def test_history_with_tool_calls_renders(which: str, server: Server, hermes: Server) -> None:
    srv = server if which == "generic" else hermes
    for tools in ([WEATHER], openai.omit):
        out = client(srv).chat.completions.create(
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
    assert with_tools["usage"]["prompt_tokens"] > without["usage"]["prompt_tokens"] + 20


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
            out = client(server).chat.completions.create(**args)
            message = out.choices[0].message
            assert message.content is not None or message.tool_calls
            continue
        finishes = [
            chunk.choices[0].finish_reason
            for chunk in client(server).chat.completions.create(**args, stream=True)
            if chunk.choices
        ]
        assert finishes[-1] in ("stop", "length", "tool_calls")
