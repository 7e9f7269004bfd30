"""Tool-call formats without an engine: detection, the enforcing grammars, the
whole-output parser, and the streamed parser fed in random splits."""

from __future__ import annotations

import json
import random
from itertools import count
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.nursery import chat_templates
from tests.web.grammar_walk import Walker
from tserve.web._tool_formats import (
    ParsedCall,
    ParsedOutput,
    ToolFormat,
    detect_format,
    parse_output,
    tool_grammar,
)
from tserve.web._tool_stream import Arguments, CallStarted, Content, Event, ToolCallStream

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
FLAG = {
    "type": "object",
    "properties": {
        "on": {"type": "boolean"},
        "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["a", "b{", 'c"}']}},
    },
    "required": ["on", "tags"],
    "additionalProperties": False,
}
TOOLS = {"get_weather": WEATHER, "set_flag": FLAG}
NAMES = frozenset(TOOLS)


@pytest.fixture(scope="module")
def walker(tiny_model_dir: Path) -> Walker:
    return Walker(tiny_model_dir)


def ids() -> Any:
    counter = count()
    return lambda: f"call_{next(counter)}"


def streamed(text: str, fmt: ToolFormat, *, enforced: bool, seed: int) -> ParsedOutput:
    """``text`` pushed in random pieces; the events assembled the way the SDK does."""
    rng = random.Random(seed)
    stream = ToolCallStream(fmt, NAMES, enforced=enforced, new_id=ids())
    events: list[Event] = []
    at = 0
    while at < len(text):
        size = rng.choice([1, 1, 2, 3, 5, 8, 13])
        events += stream.push(text[at : at + size])
        at += size
    events += stream.finish()
    return assemble(events)


def assemble(events: list[Event]) -> ParsedOutput:
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    for event in events:
        if isinstance(event, Content):
            content.append(event.text)
        elif isinstance(event, CallStarted):
            assert event.index == len(names) and event.id == f"call_{event.index}"
            names[event.index], calls[event.index] = event.name, []
        else:
            assert isinstance(event, Arguments) and event.index in names
            calls[event.index].append(event.text)
    joined = "".join(content)
    parsed = [ParsedCall(names[i], "".join(calls[i])) for i in sorted(names)]
    return ParsedOutput(joined if joined.strip() or not parsed else None, parsed)


def same(a: ParsedOutput, b: ParsedOutput) -> None:
    assert [c.name for c in a.calls] == [c.name for c in b.calls]
    assert [json.loads(c.arguments) for c in a.calls] == [json.loads(c.arguments) for c in b.calls]
    assert (a.content or "").strip() == (b.content or "").strip()


@pytest.mark.parametrize("fmt", list(ToolFormat))
@pytest.mark.parametrize("parallel", [False, True])
def test_enforced_outputs_parse_validate_and_stream_alike(
    walker: Walker, fmt: ToolFormat, parallel: bool
) -> None:
    grammar = tool_grammar(fmt, TOOLS, parallel=parallel)
    for seed in range(6):
        text = walker.text(grammar, seed, max_tokens=600)
        whole = parse_output(text, fmt, NAMES)
        assert whole.content is None and whole.calls, text
        if not parallel:
            assert len(whole.calls) == 1
        for call in whole.calls:
            jsonschema.validate(json.loads(call.arguments), TOOLS[call.name])
        for split in range(4):
            same(streamed(text, fmt, enforced=True, seed=split), whole)
            same(streamed(text, fmt, enforced=False, seed=split), whole)


def test_a_named_tool_grammar_calls_only_it(walker: Walker) -> None:
    grammar = tool_grammar(ToolFormat.HERMES, {"set_flag": FLAG}, parallel=True)
    for seed in range(4):
        calls = parse_output(walker.text(grammar, seed), ToolFormat.HERMES, NAMES).calls
        assert calls and {c.name for c in calls} == {"set_flag"}


def test_a_tool_without_parameters_gets_an_empty_object(walker: Walker) -> None:
    empty = {"type": "object", "properties": {}, "additionalProperties": False}
    grammar = tool_grammar(ToolFormat.GENERIC, {"now": empty}, parallel=False)
    text = walker.text(grammar, 0)
    assert parse_output(text, ToolFormat.GENERIC, frozenset({"now"})).calls == [
        ParsedCall("now", "{}")
    ]


AUTO_CASES = [
    # (format, output, content, calls as (name, arguments))
    (ToolFormat.HERMES, "Just text.", "Just text.", []),
    (
        ToolFormat.HERMES,
        'Let me look.\n<tool_call>\n{"name": "set_flag", "arguments": {"on": true, "tags": []}}'
        "\n</tool_call>",
        "Let me look.",
        [("set_flag", {"on": True, "tags": []})],
    ),
    (
        ToolFormat.HERMES,
        '<tool_call>{"arguments": {"on": false}, "name": "set_flag"}</tool_call>\n'
        "<tool_call>{broken</tool_call>",
        "<tool_call>{broken</tool_call>",
        [("set_flag", {"on": False})],
    ),
    (
        ToolFormat.HERMES,
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        [],
    ),
    (ToolFormat.HERMES, "a <tool_call> never closed", "a <tool_call> never closed", []),
    (ToolFormat.HERMES, "x < y and <tool_ but no call", "x < y and <tool_ but no call", []),
    (
        ToolFormat.LLAMA3,
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "set_flag", '
        '"parameters": {"on": true}}',
        None,
        [("get_weather", {"city": "Paris"}), ("set_flag", {"on": True})],
    ),
    (
        ToolFormat.LLAMA3,
        '{"name": "get_weather", "parameters": 5}',
        '{"name": "get_weather", "parameters": 5}',
        [],
    ),
    (ToolFormat.LLAMA3, "  The answer is 4.", "  The answer is 4.", []),
    (
        ToolFormat.MISTRAL,
        '[TOOL_CALLS] [{"name": "set_flag", "arguments": {"on": true}}]',
        None,
        [("set_flag", {"on": True})],
    ),
    (ToolFormat.MISTRAL, "[TOOL_CALLS] [oops", "[TOOL_CALLS] [oops", []),
    (
        ToolFormat.GENERIC,
        ' {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}',
        None,
        [("get_weather", {"city": "Oslo"})],
    ),
    (ToolFormat.GENERIC, '{"answer": 4}', '{"answer": 4}', []),
    (
        ToolFormat.GENERIC,
        '{"tool_calls": [{"name": "get_weather"',
        '{"tool_calls": [{"name": "get_weather"',
        [],
    ),
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), AUTO_CASES)
def test_auto_outputs(
    fmt: ToolFormat, text: str, content: str | None, calls: list[tuple[str, Any]]
) -> None:
    whole = parse_output(text, fmt, NAMES)
    assert whole.content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == calls
    for seed in range(20):
        same(streamed(text, fmt, enforced=False, seed=seed), whole)


def test_enforced_stream_passes_arguments_on_as_they_arrive() -> None:
    stream = ToolCallStream(ToolFormat.HERMES, NAMES, enforced=True, new_id=ids())
    assert stream.push('<tool_call>\n{"name":"set_') == []
    assert stream.push('flag","arguments":{"on"') == [
        CallStarted(0, "call_0", "set_flag"),
        Arguments(0, '{"on"'),
    ]
    assert stream.push(':true,"tags":["b{"]}}\n</tool') == [Arguments(0, ':true,"tags":["b{"]}')]
    assert stream.push("_call>") == []
    assert stream.finish() == []


def test_auto_stream_holds_a_call_until_it_is_complete() -> None:
    stream = ToolCallStream(ToolFormat.HERMES, NAMES, enforced=False, new_id=ids())
    assert stream.push("Hi <tool") == [Content("Hi ")]
    assert stream.push('_call>{"name": "set_flag", "arguments": {}}') == []
    assert stream.push("</tool_call>") == [CallStarted(0, "call_0", "set_flag"), Arguments(0, "{}")]


# What Llama 3.1's template says of the call shape.
LLAMA3_INSTRUCTION = (
    '{{- \'Respond in the format {"name": function name, "parameters": dictionary of '
    "argument name and its value}. Do not use variables.' }}"
)
TEMPLATES = [
    (chat_templates.TOOLS, True, ToolFormat.HERMES),
    (chat_templates.HEADERS + LLAMA3_INSTRUCTION, True, ToolFormat.LLAMA3),
    ("{{ messages }}[TOOL_CALLS]{{ tools }}", True, ToolFormat.MISTRAL),
    (chat_templates.NAMED_DEFAULT, False, ToolFormat.GENERIC),
    ("{{ tools }}{% for m in messages %}{{ m.content }}{% endfor %}", True, ToolFormat.GENERIC),
]


@pytest.mark.parametrize(("source", "reads", "fmt"), TEMPLATES)
def test_detect_format(source: str, reads: bool, fmt: ToolFormat) -> None:
    assert detect_format(source, reads_tools=reads) is fmt
