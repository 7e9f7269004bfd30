"""Tool calling on ``/v1/chat/completions``: the request's tools, its
``tool_choice``, and the plan for one model's template. Sans-IO.

Rules:

* ``tools`` are OpenAI function tools with unique names; ``parameters`` is
  a JSON Schema object (absent = no arguments: ``{}``).
* ``tool_choice``: "none" (the default without tools), "auto" (the default
  with tools), "required", or ``{"type": "function", "function": {"name"}}``
  naming one of the tools. Anything else, or a choice other than "none"
  without tools, is a 400 naming ``tool_choice``. ``parallel_tool_calls``
  (default true) allows up to :data:`MAX_TOOL_CALLS` calls, false exactly one.
* "none": the template is rendered without the tools and nothing is parsed.
* "required" and a named tool are enforced: the request's constraint is the
  format's grammar (:func:`tool_grammar`), so every call parses and its
  arguments validate; such a request cannot also have a ``response_format``
  (400 naming ``tool_choice``). "auto" adds no constraint; calls are parsed
  out of whatever the model writes, and a malformed one is content.
* The format is the template's (:func:`detect_format`). A template that does
  not read ``tools`` (GENERIC) gets a system note listing them and the JSON
  shape of a call (first system message extended, or one added first), and
  earlier assistant calls are shown to it in that shape as the message's
  content; templates that read tools get the tools and the calls as data
  (``arguments`` decoded to objects, as transformers' templates expect).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal

import msgspec

from tserve.nursery import InvalidRequest
from tserve.sampling import LarkGrammar
from tserve.web._bodies import ChatBody, ToolBody
from tserve.web._tool_formats import (
    MAX_TOOL_CALLS,
    ToolFormat,
    compact_json,
    generic_note,
    tool_grammar,
)
from tserve.web._tool_stream import ToolCallStream

__all__ = [
    "MAX_TOOL_CALLS",
    "Mode",
    "ToolPlan",
    "ToolRequest",
    "ToolSpec",
    "build_tool_request",
    "new_call_id",
    "tool_request",
]

_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}

Mode = Literal["none", "auto", "required"]
_MODES: tuple[Mode, ...] = ("none", "auto", "required")


@dataclasses.dataclass(frozen=True, slots=True)
class ToolRequest:
    """A chat request's validated tools: ``parameters`` by name (in order),
    ``definitions`` as the template sees them, and the choice: a mode, or the
    one tool's name that must be called."""

    parameters: dict[str, dict[str, Any]]
    definitions: list[dict[str, Any]]
    choice: Mode | str
    parallel: bool
    field: str  # the field a grammar problem is named by: "tools" or "tool_choice"

    @property
    def enforced(self) -> bool:
        return self.choice not in ("none", "auto")


def tool_request(body: ChatBody) -> ToolRequest | None:
    """The body's tools and choice, or None when no tool may be called. Raises InvalidRequest."""
    tools = body.tools or []
    specs = [
        ToolSpec(tool.function.name, tool.function.parameters, _definition(tool)) for tool in tools
    ]
    request = build_tool_request(
        specs,
        _choice(body.tool_choice),
        parallel=body.parallel_tool_calls is not False,
        name_param="tools[{i}].function.name",
        choice_param="tool_choice.function.name",
    )
    if request is not None and request.enforced and _has_format(body):
        raise InvalidRequest(
            "a required or named 'tool_choice' cannot be combined with a structured output",
            param="tool_choice",
        )
    return request


@dataclasses.dataclass(frozen=True, slots=True)
class ToolSpec:
    """One tool of any API: its name, its arguments' JSON Schema (None: no arguments),
    and its definition as the template sees it (OpenAI's tool object)."""

    name: str
    parameters: dict[str, Any] | None
    definition: dict[str, Any]


def build_tool_request(
    tools: Sequence[ToolSpec],
    choice: Mode | str | None,
    *,
    parallel: bool,
    name_param: str,
    choice_param: str,
) -> ToolRequest | None:
    """The validated tools and choice (None: the API's default), or None when no tool
    may be called. ``name_param`` names tool ``{i}``'s name field, ``choice_param`` the
    field that names the one tool to call. Raises InvalidRequest."""
    parameters: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        if tool.name in parameters:
            param = name_param.format(i=i)
            raise InvalidRequest(f"'{param}': {tool.name!r} is defined twice", param=param)
        parameters[tool.name] = tool.parameters or _NO_ARGUMENTS
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if choice in _MODES and not tools:
        raise InvalidRequest(
            f"'tool_choice' is {choice!r} but no 'tools' are given", param="tool_choice"
        )
    if choice not in _MODES and choice not in parameters:
        raise InvalidRequest(
            f"'tool_choice' names {choice!r}, which is not one of 'tools'", param=choice_param
        )
    return ToolRequest(
        parameters,
        [tool.definition for tool in tools],
        choice,
        parallel=parallel,
        field="tools" if choice in ("auto", "required") else "tool_choice",
    )


def _has_format(body: ChatBody) -> bool:
    fmt = body.response_format
    return (fmt is not None and fmt.type != "text") or any(
        value is not None
        for value in (
            body.structured_outputs,
            body.guided_json,
            body.guided_regex,
            body.guided_choice,
            body.guided_grammar,
        )
    )


def _choice(raw: Any) -> Mode | str | None:
    """OpenAI's ``tool_choice``: a mode, or the named tool (checked against the tools later)."""
    if raw is None:
        return None
    for mode in _MODES:
        if raw == mode:
            return mode
    if isinstance(raw, dict) and raw.get("type") == "function":
        function = raw.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise InvalidRequest(
                "'tool_choice.function.name' must name a tool", param="tool_choice.function.name"
            )
        return name
    raise InvalidRequest(
        '\'tool_choice\' must be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


def _definition(tool: ToolBody) -> dict[str, Any]:
    """A tool as the template (and the generic note) sees it: OpenAI's shape, no nulls."""
    function = {
        key: value for key, value in msgspec.to_builtins(tool.function).items() if value is not None
    }
    return {"type": "function", "function": function}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass(frozen=True, slots=True)
class ToolPlan:
    """A :class:`ToolRequest` for one template format: what to render, what
    to constrain, how to parse."""

    request: ToolRequest
    format: ToolFormat

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.request.parameters)

    def grammar(self) -> LarkGrammar | None:
        """The enforcing grammar ("required" or a named tool), else None."""
        choice = self.request.choice
        if choice == "auto":
            return None
        params = self.request.parameters
        tools = params if choice == "required" else {choice: params[choice]}
        return LarkGrammar(tool_grammar(self.format, tools, parallel=self.request.parallel))

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The ``tools`` variable of the template (None for a template that ignores it)."""
        return None if self.format is ToolFormat.GENERIC else self.request.definitions

    def messages(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` for this format: the generic note and calls as content (GENERIC)."""
        if self.format is not ToolFormat.GENERIC:
            return list(messages)
        definitions = self.request.definitions
        choice = self.request.choice
        if choice not in ("auto", "required"):
            definitions = [d for d in definitions if d["function"]["name"] == choice]
        note = generic_note(definitions, required=self.request.enforced)
        return with_system_note(as_generic_history(messages), note)

    def stream(self, new_id: Callable[[], str] = new_call_id) -> ToolCallStream:
        """A parser of one streamed output; ``new_id`` makes each call's id."""
        return ToolCallStream(
            self.format, self.names, enforced=self.request.enforced, new_id=new_id
        )


def with_system_note(messages: Sequence[dict[str, Any]], note: str) -> list[dict[str, Any]]:
    """``note`` appended to the first system message, or a system message put first."""
    out = list(messages)
    if out and out[0].get("role") in ("system", "developer"):
        first = dict(out[0])
        first["content"] = f"{first.get('content') or ''}\n\n{note}".lstrip()
        out[0] = first
        return out
    return [{"role": "system", "content": note}, *out]


def as_generic_history(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant calls written into their message's content in the GENERIC shape, for a
    template that reads only contents."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and calls:
            shape = {
                "tool_calls": [
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                    for c in calls
                ]
            }
            content = message.get("content") or ""
            message = {**message, "content": f"{content}\n{compact_json(shape)}".lstrip()}
            del message["tool_calls"]
        out.append(message)
    return out
