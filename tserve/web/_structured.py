"""Structured-output fields and ``logit_bias`` of a request body, as SamplingParams values. Sans-IO.

Rules:

* A request has at most one constraint. It may come from OpenAI's
  ``response_format`` (``json_object`` -> any JSON object, ``json_schema``
  -> that schema; ``text`` -> none), from vLLM's ``structured_outputs``
  (exactly one of ``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object``), or from vLLM's older top-level ``guided_json``,
  ``guided_regex``, ``guided_choice``, ``guided_grammar``. Two sources at
  once, or two keys of ``structured_outputs``, are a 400 naming the second.
* A JSON schema given as text (vLLM allows it) must parse to an object.
* ``grammar`` is Lark (llguidance's dialect) or GBNF/EBNF, converted to Lark
  here (llguidance's own converter); a grammar that converts to nothing is a
  400 naming the field.
* Whether a schema, pattern or grammar can be honoured is not decided here:
  the nursery validates the constraint and raises InvalidRequest with
  ``param`` "constraint" (the engine's grammar errors come as InvalidRequest
  before the first token, RequestFailed after it, with the same param), which
  the handler, and a stream's error event, rename to :attr:`Constrained.field`.
* ``logit_bias`` keys are token ids written as decimal strings; anything
  else is a 400 naming ``logit_bias``. Values and vocabulary ranges are
  :mod:`tserve.validity`'s rule.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from llguidance.gbnf_to_lark import any_to_lark

from tserve.nursery import InvalidRequest, RequestFailed
from tserve.sampling import Choice, Constraint, JsonSchema, LarkGrammar, Regex
from tserve.web._bodies import SamplingBody

__all__ = ["Constrained", "constraint_of", "logit_bias_of", "rename_constraint_error"]

_TOKEN_ID = re.compile(r"^[0-9]{1,19}$")


@dataclasses.dataclass(frozen=True, slots=True)
class Constrained:
    """A request's constraint and the HTTP field it came from."""

    constraint: Constraint
    field: str


def constraint_of(body: SamplingBody) -> Constrained | None:
    """The body's one constraint, or None. Raises InvalidRequest naming the field."""
    found: list[Constrained] = []
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        found.append(Constrained(_response_format(body), "response_format"))
    so = body.structured_outputs
    if so is not None:
        keys = [
            (key, value)
            for key, value in (
                ("json", so.json),
                ("regex", so.regex),
                ("choice", so.choice),
                ("grammar", so.grammar),
                ("json_object", so.json_object or None),
                ("structural_tag", so.structural_tag),
            )
            if value is not None
        ]
        if len(keys) > 1:
            names = ", ".join(key for key, _ in keys)
            raise InvalidRequest(
                f"'structured_outputs' takes one of json, regex, choice, grammar, json_object "
                f"(got {names})",
                param="structured_outputs",
            )
        if keys:
            key, value = keys[0]
            field = f"structured_outputs.{key}"
            found.append(Constrained(_vllm(key, value, field), field))
    for key, value in (
        ("json", body.guided_json),
        ("regex", body.guided_regex),
        ("choice", body.guided_choice),
        ("grammar", body.guided_grammar),
    ):
        if value is not None:
            field = f"guided_{key}"
            found.append(Constrained(_vllm(key, value, field), field))
    if len(found) > 1:
        raise InvalidRequest(
            f"at most one structured output per request: '{found[0].field}' and "
            f"'{found[1].field}' are both set",
            param=found[1].field,
        )
    return found[0] if found else None


def _response_format(body: SamplingBody) -> Constraint:
    fmt = body.response_format
    assert fmt is not None
    if fmt.type == "json_object":
        return JsonSchema(None)
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise InvalidRequest(
                "'response_format' of type json_schema needs 'json_schema'",
                param="response_format.json_schema",
            )
        if fmt.json_schema.schema is None:
            raise InvalidRequest(
                "'response_format.json_schema' needs a 'schema'",
                param="response_format.json_schema.schema",
            )
        return JsonSchema(fmt.json_schema.schema)
    raise InvalidRequest(
        f"'response_format.type' must be text, json_object or json_schema, not {fmt.type!r}",
        param="response_format.type",
    )


def _vllm(key: str, value: Any, field: str) -> Constraint:
    """One vLLM-style constraint (``structured_outputs.<key>`` or ``guided_<key>``)."""
    if key == "json":
        return JsonSchema(_schema_object(value, field))
    if key == "json_object":
        return JsonSchema(None)
    if key == "regex":
        return Regex(value)
    if key == "choice":
        if not value:
            raise InvalidRequest(f"'{field}' must hold at least one string", param=field)
        return Choice(tuple(value))
    if key == "grammar":
        return LarkGrammar(_lark(value, field))
    raise InvalidRequest(f"'{field}' is not supported by this server", param=field)


def _schema_object(value: dict[str, Any] | str, field: str) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    try:
        schema = json.loads(value)
    except ValueError as exc:
        raise InvalidRequest(f"'{field}' is not valid JSON: {exc}", param=field) from None
    if not isinstance(schema, dict):
        raise InvalidRequest(f"'{field}' must be a JSON Schema object", param=field)
    return schema


def _lark(grammar: str, field: str) -> str:
    """``grammar`` as Lark: GBNF/EBNF converted by llguidance, Lark left as it is."""
    try:
        lark = any_to_lark(grammar)
    except Exception as exc:  # the converter's own error, whatever its type
        raise InvalidRequest(
            f"'{field}' is not a Lark or GBNF grammar: {exc}", param=field
        ) from None
    if not lark.strip():
        raise InvalidRequest(f"'{field}' is empty", param=field)
    return lark


def logit_bias_of(body: SamplingBody) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, bias) pairs, by token id. Raises InvalidRequest."""
    if not body.logit_bias:
        return ()
    pairs = []
    for key, value in body.logit_bias.items():
        if not _TOKEN_ID.match(key):
            raise InvalidRequest(
                f"'logit_bias' keys must be token ids (decimal integers), not {key!r}",
                param="logit_bias",
            )
        pairs.append((int(key), value))
    return tuple(sorted(pairs))


def rename_constraint_error(exc: Exception, field: str | None) -> Exception:
    """``exc`` naming ``field`` when it is an InvalidRequest or RequestFailed that
    named the nursery's "constraint" (the engine's grammar errors do), else ``exc``."""
    if field is None or not isinstance(exc, (InvalidRequest, RequestFailed)):
        return exc
    if exc.param is None or not (exc.param == "constraint" or exc.param.startswith("constraint.")):
        return exc
    message = str(exc).replace("'constraint'", f"'{field}'")
    if not message.startswith(field):
        message = f"{field}: {message}"
    return type(exc)(message, param=field)
