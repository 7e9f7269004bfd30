"""Structured outputs and logit_bias through the official openai SDK against a real server.

The tiny model writes garbage, so every output below is valid only because the
grammar masks what it may write: each is checked with ``jsonschema`` (or the
pattern), on both endpoints, streamed and not, with ``n > 1``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Annotated, Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.web.conftest import Server
from tests.web.sdks import openai_client

pytestmark = pytest.mark.slow

PERSON: Any = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "tier": {"enum": ["free", "pro"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "age", "member", "tier", "tags"],
    "additionalProperties": False,
}
ASK: Any = [{"role": "user", "content": "Describe a person."}]


class Person(BaseModel):
    name: Annotated[str, Field(max_length=6)]
    age: Annotated[int, Field(ge=0, le=120)]
    member: bool
    tier: Literal["free", "pro"]


@pytest.fixture
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai_client(server) as c:
        yield c
    server.wait_for_metric("tserve_requests_live", 0)


def person_format(schema: Any = PERSON) -> Any:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    for seed in range(3):
        out = client.chat.completions.parse(
            model="tiny", messages=ASK, response_format=Person, max_tokens=120, seed=seed
        )
        choice = out.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person)


def test_json_schema_n_choices_all_validate(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="tiny", messages=ASK, response_format=person_format(), max_tokens=150, n=3, seed=1
    )
    assert len(out.choices) == 3
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)


def test_json_schema_streamed(client: openai.OpenAI) -> None:
    text: list[str] = []
    finish = None
    for chunk in client.chat.completions.create(
        model="tiny", messages=ASK, response_format=person_format(), max_tokens=150, stream=True
    ):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads("".join(text)), PERSON)


def test_json_object_is_an_object(client: openai.OpenAI, server: Server) -> None:
    """Garbage runs on inside an object; a bias toward ``}`` closes it, and it parses."""
    [close] = server.client.post("/tokenize", json={"prompt": "}"}).json()["tokens"]
    for bias in ({}, {str(close): 100}):
        out = client.chat.completions.create(
            model="tiny",
            messages=ASK,
            response_format={"type": "json_object"},
            max_tokens=60,
            logit_bias=bias,
        )
        choice = out.choices[0]
        assert (choice.message.content or "").startswith("{")
        if bias:
            assert choice.finish_reason == "stop"
            assert json.loads(choice.message.content or "") == {}


def test_completions_take_vllm_structured_outputs(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="tiny",
        prompt="A person:",
        max_tokens=150,
        n=2,
        extra_body={"structured_outputs": {"json": PERSON}},
    )
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), PERSON)


@pytest.mark.parametrize("stream", [False, True])
def test_regex_and_choice(client: openai.OpenAI, stream: bool) -> None:
    cases: list[tuple[dict[str, Any], Callable[[str], object]]] = [
        ({"regex": "[a-c]{3}-[0-9]{2}"}, lambda s: re.fullmatch("[a-c]{3}-[0-9]{2}", s)),
        ({"choice": ["yes", "no", "maybe"]}, lambda s: s in ("yes", "no", "maybe")),
        ({"grammar": 'start: "x" ("+" "x"){0,3}'}, lambda s: re.fullmatch(r"x(\+x){0,3}", s)),
    ]
    for constraint, valid in cases:
        body = {"structured_outputs": constraint}
        if not stream:
            out = client.chat.completions.create(
                model="tiny", messages=ASK, max_tokens=20, extra_body=body
            )
            assert out.choices[0].finish_reason == "stop"
            assert valid(out.choices[0].message.content or ""), out.choices[0].message.content
            continue
        chunks = client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=20, extra_body=body, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert valid(text), text


def test_logit_bias_forces_and_bans(client: openai.OpenAI, server: Server) -> None:
    [token] = server.client.post("/tokenize", json={"prompt": "a"}).json()["tokens"]
    forced = client.completions.create(
        model="tiny",
        prompt="Hello",
        max_tokens=6,
        logit_bias={str(token): 100},
        extra_body={"ignore_eos": True},
    )
    assert forced.choices[0].text == "a" * 6
    greedy = client.completions.create(model="tiny", prompt="Hello", max_tokens=1, temperature=0)
    first = server.client.post("/tokenize", json={"prompt": greedy.choices[0].text}).json()
    banned = client.completions.create(
        model="tiny",
        prompt="Hello",
        max_tokens=1,
        temperature=0,
        logit_bias={str(first["tokens"][0]): -100},
    )
    assert banned.choices[0].text != greedy.choices[0].text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": person_format({"type": "nonsense"})}, "response_format"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar"),
        ({"logit_bias": {"99999999": 5}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
    ],
)
def test_invalid_constraints_are_400_and_the_server_serves_on(
    server: Server, body: dict[str, Any], param: str
) -> None:
    for path, base in (
        ("/v1/chat/completions", {"messages": ASK}),
        ("/v1/completions", {"prompt": "hi"}),
    ):
        for stream in (False, True):
            reply = server.client.post(
                path, json={"model": "tiny", "max_tokens": 4, "stream": stream, **base, **body}
            )
            assert reply.status_code == 400, reply.text
            assert reply.json()["error"]["param"] == param
    ok = server.client.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": ASK, "max_tokens": 2}
    )
    assert ok.status_code == 200
