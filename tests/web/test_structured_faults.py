"""Grammars that cannot work, or work too slowly, against a real server: every
one is an error naming the request's field, never a 200 with an empty or
broken output, and the server serves on.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.web.conftest import Server

pytestmark = pytest.mark.slow

ASK: Any = [{"role": "user", "content": "Describe a person."}]
CYCLE: Any = {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}
REQUIRED_CYCLE: Any = {
    "type": "object",
    "properties": {"k": {"$ref": "#/$defs/a"}},
    "required": ["k"],
    "$defs": CYCLE,
}


def schema_format(schema: Any) -> Any:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def tool(name: str, parameters: Any) -> Any:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def optional(count: int) -> Any:
    """A legal schema of ``count`` optional integer properties (too large for llguidance)."""
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(count)}}


FINE: Any = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

IMPOSSIBLE = [
    ({"response_format": schema_format({"$ref": "#"})}, "response_format", "accepts no string"),
    (
        {"structured_outputs": {"json": {"$defs": CYCLE, "$ref": "#/$defs/a"}}},
        "structured_outputs.json",
        "accepts no string",
    ),
    ({"response_format": schema_format(REQUIRED_CYCLE)}, "response_format", "accepts no string"),
    (
        {"structured_outputs": {"grammar": 'start: "a" x\nx: /[^\\x00-\\U0010FFFF]/'}},
        "structured_outputs.grammar",
        "accepts no string",
    ),
    (
        {"structured_outputs": {"grammar": 'start: "a" x\nx: /[]/'}},
        "structured_outputs.grammar",
        "",
    ),
    ({"guided_regex": ""}, "guided_regex", "only the empty string"),
]


def post(server: Server, path: str, body: dict[str, Any]) -> tuple[int, list[Any]]:
    """Status and the JSON of the body (non-streamed), or of each SSE data event."""
    reply = server.client.post(path, json=body)
    if not body.get("stream") or reply.status_code != 200:
        return reply.status_code, [reply.json()]
    events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return 200, [json.loads(e) for e in events[:-1]]


def endpoints(extra: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("/v1/chat/completions", {"model": "tiny", "messages": ASK, **extra}),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", **extra}),
    ]


@pytest.mark.parametrize(("fields", "param", "words"), IMPOSSIBLE)
def test_a_grammar_that_can_write_nothing_is_a_400_naming_its_field(
    server: Server, fields: dict[str, Any], param: str, words: str
) -> None:
    for path, body in endpoints({"max_tokens": 20, **fields}):
        for stream in (False, True):
            status, [reply] = post(server, path, {**body, "stream": stream})
            assert status == 400, reply
            assert reply["error"]["param"] == param
            assert words in reply["error"]["message"]
    ok = server.client.post(
        "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}
    )
    assert ok.status_code == 200


HUGE = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 2**70}}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": schema_format(HUGE)}, "response_format"),
        ({"structured_outputs": {"json": {"enum": [-(2**64)]}}}, "structured_outputs.json"),
    ],
)
def test_a_grammar_with_an_integer_beyond_64_bits_is_a_400_naming_its_field(
    server: Server, fields: dict[str, Any], param: str
) -> None:
    """JSON's integers are unbounded; one past 64 bits in a schema is refused by
    name (it was a 500: its grammar could not be encoded to be checked)."""
    for path, body in endpoints({"max_tokens": 4, **fields}):
        for stream in (False, True):
            status, [reply] = post(server, path, {**body, "stream": stream})
            assert status == 400, reply
            assert reply["error"]["param"] == param
            assert "64-bit" in reply["error"]["message"]


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        (
            {"structured_outputs": {"regex": "((a{100}){100}){100}"}},
            "structured_outputs.regex",
            "too many expressions constructed",
        ),
        ({"response_format": schema_format({"$ref": "#"})}, "response_format", "accepts no string"),
        ({"response_format": schema_format(optional(5000))}, "response_format", "too big"),
        ({"response_format": schema_format(optional(500))}, "response_format", "2000"),
    ],
)
def test_a_failed_grammar_fails_the_same_way_again(
    server: Server, fields: dict[str, Any], param: str, words: str
) -> None:
    """The verdict on a grammar is remembered with its error: the identical
    request gets the identical 400, never a success the second time."""
    body = {"model": "tiny", "messages": ASK, "max_tokens": 8, **fields}
    replies = [server.client.post("/v1/chat/completions", json=body) for _ in range(3)]
    assert [r.status_code for r in replies] == [400, 400, 400]
    assert replies[0].json() == replies[1].json() == replies[2].json()
    error = replies[0].json()["error"]
    assert error["param"] == param and words in error["message"]


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        (
            [tool("f", FINE), tool("g", FINE), tool("h", FINE), tool("bad", {"$ref": "#"})],
            {"type": "function", "function": {"name": "bad"}},
            "tools[3].function.parameters",
        ),
        ([tool("bad", REQUIRED_CYCLE)], "required", "tools[0].function.parameters"),
    ],
)
def test_a_tool_whose_parameters_accept_nothing_is_named(
    server: Server, tools: list[Any], choice: Any, param: str
) -> None:
    body = {"model": "tiny", "messages": ASK, "max_tokens": 30, "tools": tools}
    for stream in (False, True):
        status, [reply] = post(
            server, "/v1/chat/completions", {**body, "tool_choice": choice, "stream": stream}
        )
        assert status == 400, reply
        assert reply["error"]["param"] == param


def test_a_grammar_over_its_mask_budget_ends_with_an_error_naming_its_field(
    start_server: Callable[..., Server],
) -> None:
    """A budget no mask meets (1 ns): after 7 tokens the grammar is ended. Not
    streamed: a 422 naming the field; streamed: the tokens, then an error event
    naming it; never a ``stop``. Plain requests are untouched (one runs to its
    ``max_tokens``: ``ignore_eos``, as the sampled model may end sooner)."""
    srv = start_server("--grammar-mask-budget", "0.000001")
    fields = {"structured_outputs": {"regex": "[a-z]{300}"}, "max_tokens": 400}
    for path, body in endpoints(fields):
        status, [reply] = post(srv, path, body)
        assert status == 422, reply
        error = reply["error"]
        assert (error["param"], error["code"]) == ("structured_outputs.regex", "request_failed")
        assert "--grammar-mask-budget" in error["message"]
        # Streamed: the error event after the tokens already sent; or, when the
        # tokens and the error reached the API together, the error alone (422).
        status, events = post(srv, path, {**body, "stream": True})
        *chunks, last = events
        assert status in (200, 422) and last["error"]["param"] == "structured_outputs.regex"
        assert all(c["choices"][0].get("finish_reason") is None for c in chunks if c["choices"])
    plain = {"model": "tiny", "prompt": "hi", "max_tokens": 12, "ignore_eos": True}
    status, [ok] = post(srv, "/v1/completions", plain)
    assert status == 200 and ok["choices"][0]["finish_reason"] == "length"
