"""Structured outputs and tool calls on a real model, checked sample by sample.

Run: ``python -m benchmarks.structured_checks [--model default] [--samples 3]``
(or ``--base-url URL --name NAME`` for a running server).

Through the ``openai`` SDK at temperature 0.8: every schema of :data:`SCHEMAS`
(required fields, enums, booleans, arrays with min/max items, nested
objects, ``anyOf`` with null, string patterns, ``$defs``/``$ref``, ``const``)
``--samples`` times; each output must parse, validate with ``jsonschema``
and finish with "stop". Then ``tool_choice="required"``, a named tool and
the streamed form (assembled by the SDK): arguments validate against the
tool's parameters, finish "tool_calls". Then an invalid schema must be a
400 naming ``response_format``, and the server must still answer. Writes
``results/structured-checks-<name>-<stamp>.json``; exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import jsonschema
import openai

from benchmarks._results import result_stem, write_json
from benchmarks._serve import serve

SCHEMAS: dict[str, dict[str, Any]] = {
    "required_fields": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 24},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        },
        "required": ["title", "year"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"mood": {"enum": ["happy", "sad", "calm"]}},
        "required": ["mood"],
        "additionalProperties": False,
    },
    "boolean": {
        "type": "object",
        "properties": {"is_open": {"type": "boolean"}, "has_wifi": {"type": "boolean"}},
        "required": ["is_open", "has_wifi"],
        "additionalProperties": False,
    },
    "array_bounds": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue", "black"]},
                "minItems": 2,
                "maxItems": 3,
            }
        },
        "required": ["colors"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "address": {
                        "type": "object",
                        "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["id", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "anyof_null": {
        "type": "object",
        "properties": {
            "score": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "note": {"anyOf": [{"type": "string", "maxLength": 12}, {"type": "null"}]},
        },
        "required": ["score", "note"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {
            "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
        },
        "required": ["date", "code"],
        "additionalProperties": False,
    },
    "defs_ref": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -100, "maximum": 100},
                    "y": {"type": "integer", "minimum": -100, "maximum": 100},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    "const": {
        "type": "object",
        "properties": {
            "version": {"const": 2},
            "kind": {"const": "report"},
            "ok": {"type": "boolean"},
        },
        "required": ["version", "kind", "ok"],
        "additionalProperties": False,
    },
}

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK: Any = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
ASK: Any = [{"role": "user", "content": "What is the weather in Paris, and the time in Berlin?"}]


def check_schemas(client: openai.OpenAI, model: str, samples: int) -> list[dict[str, Any]]:
    out = []
    for name, schema in SCHEMAS.items():
        for i in range(samples):
            reply = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"Give me an example ({name}) as JSON."}],
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": name, "schema": schema, "strict": True},
                },
                temperature=0.8,
                max_tokens=200,
                seed=i,
            )
            choice = reply.choices[0]
            ok, error = True, None
            try:
                jsonschema.validate(json.loads(choice.message.content or ""), schema)
            except (ValueError, jsonschema.ValidationError) as exc:
                ok, error = False, str(exc)[:200]
            ok = ok and choice.finish_reason == "stop"
            out.append(
                {
                    "schema": name,
                    "sample": i,
                    "ok": ok,
                    "finish_reason": choice.finish_reason,
                    "content": choice.message.content,
                    "error": error,
                }
            )
    return out


def _calls_ok(calls: Any, finish: str | None, names: set[str]) -> tuple[bool, str | None]:
    if finish != "tool_calls" or not calls:
        return False, f"finish {finish}, calls {calls!r}"
    for call in calls:
        if call.function.name not in names:
            return False, f"called {call.function.name}"
        try:
            jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
        except (ValueError, jsonschema.ValidationError) as exc:
            return False, str(exc)[:200]
    return True, None


def check_tools(client: openai.OpenAI, model: str, samples: int) -> list[dict[str, Any]]:
    out = []
    named = {"type": "function", "function": {"name": "get_time"}}
    cases: list[tuple[str, Any, set[str], bool]] = [
        ("required", "required", {"get_weather", "get_time"}, False),
        ("required_parallel", "required", {"get_weather", "get_time"}, True),
        ("named", named, {"get_time"}, False),
    ]
    for label, choice, names, parallel in cases:
        for i in range(samples):
            reply = client.chat.completions.create(
                model=model,
                messages=ASK,
                tools=[WEATHER, CLOCK],
                tool_choice=choice,
                parallel_tool_calls=parallel,
                temperature=0.8,
                max_tokens=200,
                seed=i,
            )
            message = reply.choices[0].message
            ok, error = _calls_ok(message.tool_calls, reply.choices[0].finish_reason, names)
            ok = ok and message.content is None
            calls = [c.model_dump() for c in message.tool_calls or []]
            out.append({"case": label, "sample": i, "ok": ok, "calls": calls, "error": error})
    for i in range(samples):
        with client.chat.completions.stream(
            model=model,
            messages=ASK,
            tools=[WEATHER, CLOCK],
            tool_choice="required",
            temperature=0.8,
            max_tokens=200,
            seed=i,
        ) as stream:
            for _ in stream:
                pass
            final = stream.get_final_completion()
        message = final.choices[0].message
        ok, error = _calls_ok(message.tool_calls, final.choices[0].finish_reason, set(PARAMETERS))
        calls = [c.model_dump() for c in message.tool_calls or []]
        out.append({"case": "streamed", "sample": i, "ok": ok, "calls": calls, "error": error})
    return out


def check_invalid_schema(client: openai.OpenAI, model: str) -> dict[str, Any]:
    bad: Any = {"type": "object", "properties": {"a": {"type": "integer", "minimum": "zero"}}}
    status, param = None, None
    try:
        client.chat.completions.create(
            model=model,
            messages=ASK,
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": bad}},
            max_tokens=8,
        )
    except openai.BadRequestError as exc:
        status = exc.status_code
        body = exc.body if isinstance(exc.body, dict) else {}
        param = body.get("param")
    after = client.chat.completions.create(model=model, messages=ASK, max_tokens=4)
    ok = status == 400 and param == "response_format" and bool(after.choices)
    return {"ok": ok, "status": status, "param": param, "served_after": bool(after.choices)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--base-url")
    parser.add_argument("--name", default="tserve")
    parser.add_argument("--samples", type=int, default=3)
    args = parser.parse_args()
    stem = result_stem(f"structured-checks-{args.name}")
    process, base_url = None, args.base_url
    if base_url is None:
        process, base_url = serve(
            args.model, stem.with_suffix(".log"), "--served-model-name", args.name
        )
    try:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
        result = {
            "name": args.name,
            "schemas": check_schemas(client, args.name, args.samples),
            "tools": check_tools(client, args.name, args.samples),
            "invalid_schema": check_invalid_schema(client, args.name),
        }
    finally:
        if process is not None:
            process.terminate()
            process.wait(60)
    print(write_json(stem, result))
    schemas, tools = result["schemas"], result["tools"]
    print(f"schemas: {sum(s['ok'] for s in schemas)}/{len(schemas)} valid with finish stop")
    for case in ("required", "required_parallel", "named", "streamed"):
        rows = [t for t in tools if t["case"] == case]
        print(f"tools {case}: {sum(t['ok'] for t in rows)}/{len(rows)}")
    print(f"invalid schema: {result['invalid_schema']}")
    failed = [s for s in schemas + tools if not s["ok"]] or not result["invalid_schema"]["ok"]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
