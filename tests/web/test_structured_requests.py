"""Structured outputs, logit_bias and tools in request bodies, sans-IO: the mapping
onto SamplingParams and ToolRequest, and the field each 400 names."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tserve.nursery import InvalidRequest, RequestFailed
from tserve.protocol import Choice, JsonSchema, LarkGrammar, Regex
from tserve.web._requests import parse_chat, parse_completion
from tserve.web._structured import rename_constraint_error
from tserve.web._tool_formats import ToolFormat
from tserve.web._tools import ToolPlan

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CLOCK = {"type": "function", "function": {"name": "now"}}


def body(base: dict[str, Any], **fields: Any) -> bytes:
    return json.dumps({**base, **fields}).encode()


# What the openai SDK's chat.completions.parse(response_format=Model) sends.
PARSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "Model", "schema": SCHEMA, "strict": True},
}


@pytest.mark.parametrize(
    ("fields", "constraint", "field"),
    [
        ({"response_format": {"type": "json_object"}}, JsonSchema(None), "response_format"),
        ({"response_format": PARSE_FORMAT}, JsonSchema(SCHEMA), "response_format"),
        ({"structured_outputs": {"json": SCHEMA}}, JsonSchema(SCHEMA), "structured_outputs.json"),
        (
            {"structured_outputs": {"json": json.dumps(SCHEMA)}},
            JsonSchema(SCHEMA),
            "structured_outputs.json",
        ),
        ({"structured_outputs": {"regex": "[0-9]+"}}, Regex("[0-9]+"), "structured_outputs.regex"),
        (
            {"structured_outputs": {"choice": ["yes", "no"]}},
            Choice(("yes", "no")),
            "structured_outputs.choice",
        ),
        (
            {"structured_outputs": {"grammar": 'start: "a" | "b"'}},
            LarkGrammar('start: "a" | "b"'),
            "structured_outputs.grammar",
        ),
        (
            {"structured_outputs": {"json_object": True}},
            JsonSchema(None),
            "structured_outputs.json_object",
        ),
        ({"guided_json": SCHEMA}, JsonSchema(SCHEMA), "guided_json"),
        ({"guided_regex": "a+"}, Regex("a+"), "guided_regex"),
        ({"guided_choice": ["x"]}, Choice(("x",)), "guided_choice"),
        ({"guided_grammar": 'start: "a"'}, LarkGrammar('start: "a"'), "guided_grammar"),
    ],
)
def test_constraints_map_on_both_endpoints(
    fields: dict[str, Any], constraint: object, field: str
) -> None:
    for req in (
        parse_chat(body(CHAT, n=2, stream=True, **fields)),
        parse_completion(body(COMPLETION, n=2, **fields)),
    ):
        assert req.params.constraint == constraint
        assert req.constraint_field == field


def test_gbnf_grammars_become_lark() -> None:
    req = parse_chat(body(CHAT, structured_outputs={"grammar": 'root ::= "yes" | "no"'}))
    assert isinstance(req.params.constraint, LarkGrammar)
    assert "start:" in req.params.constraint.grammar


def test_text_format_and_nothing_mean_no_constraint() -> None:
    assert parse_chat(body(CHAT, response_format={"type": "text"})).params.constraint is None
    req = parse_completion(body(COMPLETION))
    assert req.params.constraint is None and req.constraint_field is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"structured_outputs": {"json": "[1]"}}, "structured_outputs.json"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"structural_tag": {}}}, "structured_outputs.structural_tag"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs.regex",
        ),
        ({"logit_bias": {"ten": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"5": "x"}}, "logit_bias[...]"),
    ],
)
def test_bad_constraints_name_their_field(fields: dict[str, Any], param: str) -> None:
    for parse, base in ((parse_chat, CHAT), (parse_completion, COMPLETION)):
        with pytest.raises(InvalidRequest) as info:
            parse(body(base, **fields))
        assert info.value.param == param


def test_logit_bias_maps_to_sorted_pairs() -> None:
    req = parse_completion(body(COMPLETION, logit_bias={"7": -100, "3": 100.0, "12": 0.5}))
    assert req.params.logit_bias == ((3, 100.0), (7, -100.0), (12, 0.5))
    assert parse_chat(body(CHAT, logit_bias={})).params.logit_bias == ()


def test_the_nursery_constraint_problem_is_renamed() -> None:
    exc = InvalidRequest("'constraint': the schema has an unknown type", param="constraint")
    renamed = rename_constraint_error(exc, "response_format")
    assert isinstance(renamed, InvalidRequest)
    assert renamed.param == "response_format" and "'response_format'" in str(renamed)
    other = InvalidRequest("prompt too long", param="prompt")
    assert rename_constraint_error(other, "response_format") is other
    late = RequestFailed("the grammar failed: too many items", param="constraint")
    named = rename_constraint_error(late, "tools[3].function.parameters")
    assert isinstance(named, RequestFailed) and named.param == "tools[3].function.parameters"
    assert str(named) == "tools[3].function.parameters: the grammar failed: too many items"
    assert rename_constraint_error(late, None) is late


# -- tools ---------------------------------------------------------------------------------


def test_tool_choice_defaults() -> None:
    assert parse_chat(body(CHAT)).tools is None
    assert parse_chat(body(CHAT, tools=[WEATHER], tool_choice="none")).tools is None
    tools = parse_chat(body(CHAT, tools=[WEATHER, CLOCK])).tools
    assert tools is not None and tools.choice == "auto" and not tools.enforced
    assert tools.parallel and tools.field == "tools"
    assert tools.parameters["now"] == {
        "type": "object",
        "properties": {},
        "additionalProperties": False,
    }
    assert tools.definitions[1] == {"type": "function", "function": {"name": "now"}}


@pytest.mark.parametrize(
    ("choice", "parallel", "names"),
    [
        ("required", False, {"get_weather", "now"}),
        ({"type": "function", "function": {"name": "now"}}, True, {"now"}),
    ],
)
def test_enforced_choices_get_a_grammar(choice: Any, parallel: bool, names: set[str]) -> None:
    fields = {"tools": [WEATHER, CLOCK], "tool_choice": choice, "parallel_tool_calls": parallel}
    tools = parse_chat(body(CHAT, **fields)).tools
    assert tools is not None and tools.enforced and tools.parallel is parallel
    grammar = ToolPlan(tools, ToolFormat.HERMES).grammar()
    assert isinstance(grammar, LarkGrammar)
    assert all(f'"const":"{name}"' in grammar.grammar for name in names)
    assert ("{0," in grammar.grammar) is parallel
    assert ToolPlan(tools, ToolFormat.HERMES).template_tools() == tools.definitions


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function.name"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
        ),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "web_search", "function": CLOCK["function"]}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [CLOCK, CLOCK]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "x", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        ({"functions": [{"name": "x"}]}, "functions"),
    ],
)
def test_bad_tools_name_their_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_chat(body(CHAT, **fields))
    assert info.value.param == param


HISTORY: Any = [  # also the conversation of test_tools_live
    {"role": "user", "content": "weather in Paris?"},
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
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def test_history_calls_reach_the_template_decoded() -> None:
    req = parse_chat(body({}, messages=HISTORY, tools=[WEATHER]))
    call = req.messages[1]["tool_calls"][0]
    assert call == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    assert req.messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_generic_format_writes_the_note_and_the_calls_as_text() -> None:
    req = parse_chat(body({}, messages=HISTORY, tools=[WEATHER], tool_choice="required"))
    assert req.tools is not None
    plan = ToolPlan(req.tools, ToolFormat.GENERIC)
    assert plan.template_tools() is None
    system, user, assistant, tool = plan.messages(req.messages)
    assert system["role"] == "system" and '"tool_calls"' in system["content"]
    assert "get_weather" in system["content"] and "plain text" not in system["content"]
    auto = parse_chat(body({}, messages=HISTORY, tools=[WEATHER])).tools
    assert auto is not None
    assert "plain text" in ToolPlan(auto, ToolFormat.GENERIC).messages(req.messages)[0]["content"]
    assert user == HISTORY[0] and "tool_calls" not in assistant
    assert json.loads(assistant["content"]) == {
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    }
    assert tool["role"] == "tool"
    own = [{"role": "system", "content": "Be brief."}, *req.messages]
    first = plan.messages(own)[0]
    assert first["content"].startswith("Be brief.\n\n") and len(plan.messages(own)) == 4


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
        (
            {"role": "user", "content": "x", "tool_calls": HISTORY[1]["tool_calls"]},
            "messages[0].tool_calls",
        ),
        ({"role": "assistant", "tool_calls": [{"id": "c"}]}, "messages[0].tool_calls[0].function"),
        (
            {
                "role": "assistant",
                "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}],
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {
                "role": "assistant",
                "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {"a": 1}}}],
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        ({"role": "assistant", "tool_calls": {}}, "messages[0].tool_calls"),
    ],
)
def test_bad_history_names_the_field(message: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_chat(body({}, messages=[message]))
    assert info.value.param == param
