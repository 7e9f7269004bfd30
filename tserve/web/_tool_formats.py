"""How a model writes tool calls: the formats, which one a chat template uses,
the grammar that enforces one, and parsing a whole output. Sans-IO.

The formats (the model writes ``NAME`` and ``ARGS``, a JSON object):

========  ==================================================================
HERMES    ``<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>``,
          one block per call, text allowed around them (Hermes, Qwen)
LLAMA3    ``{"name": NAME, "parameters": ARGS}``, calls joined by ``; ``;
          the whole output (Llama 3.x JSON tool calling)
MISTRAL   ``[TOOL_CALLS][{"name": NAME, "arguments": ARGS}, ...]``, the rest
          of the output after the marker
GENERIC   ``{"tool_calls": [{"name": NAME, "arguments": ARGS}, ...]}``, the
          whole output: for templates that ignore ``tools``, which get a
          system note (:func:`generic_note`) describing the tools and this shape
========  ==================================================================

:func:`detect_format` reads the template's source: one that never reads
``tools`` is GENERIC; else ``[TOOL_CALLS]`` means MISTRAL, ``<tool_call>``
HERMES, a ``"parameters"`` JSON shape LLAMA3; a template that reads tools in
a format not listed gets GENERIC (with the note) too.

Parsing (:func:`parse_output`): a call is a JSON object with a string
``name`` that names one of the request's tools and an object (or absent/null)
``arguments`` (LLAMA3: ``parameters``). A region that does not parse as calls
is content, unchanged: a malformed call is never an error. A HERMES block is
decided alone (one bad block is content, the others still calls); the other
formats' region is the rest of the output and is decided as a whole.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

from tserve.grammar import lark_json

__all__ = [
    "MAX_TOOL_CALLS",
    "ParsedCall",
    "ParsedOutput",
    "ToolFormat",
    "detect_format",
    "generic_note",
    "parse_output",
    "tool_grammar",
]

MAX_TOOL_CALLS: Final = 16
"""Calls one enforced output may hold (``parallel_tool_calls``): a small model
cannot loop on calls past it."""


class ToolFormat(enum.Enum):
    HERMES = "hermes"
    LLAMA3 = "llama3_json"
    MISTRAL = "mistral"
    GENERIC = "generic"

    @property
    def arguments_key(self) -> str:
        return "parameters" if self is ToolFormat.LLAMA3 else "arguments"


HERMES_OPEN: Final = "<tool_call>"
HERMES_CLOSE: Final = "</tool_call>"
MISTRAL_OPEN: Final = "[TOOL_CALLS]"
LLAMA3_SEPARATOR: Final = ";"

_PARAMETERS_SHAPE = re.compile(r"""["']parameters["']""")


def detect_format(source: str, *, reads_tools: bool) -> ToolFormat:
    """The tool-call format of a chat template (see the module docstring)."""
    if not reads_tools:
        return ToolFormat.GENERIC
    if MISTRAL_OPEN in source:
        return ToolFormat.MISTRAL
    if HERMES_OPEN in source:
        return ToolFormat.HERMES
    if _PARAMETERS_SHAPE.search(source) and "name" in source:
        return ToolFormat.LLAMA3
    return ToolFormat.GENERIC


def generic_note(tools: Sequence[Mapping[str, Any]], *, required: bool) -> str:
    """The system note that tells a model whose template ignores tools how to call them
    (compact: it counts against the context)."""
    lines = [
        "Tools:",
        *(_compact_tool(t) for t in tools),
        'To call tools, reply with only {"tool_calls":[{"name":NAME,"arguments":{...}}]}',
    ]
    if not required:
        lines.append("or answer in plain text.")
    return "\n".join(lines)


def _compact_tool(tool: Mapping[str, Any]) -> str:
    function = tool.get("function", tool)
    return compact_json({key: function[key] for key in function if key != "strict"})


# -- the enforcing grammar ---------------------------------------------------------------


def tool_grammar(fmt: ToolFormat, tools: Mapping[str, dict[str, Any]], *, parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) whose sentences are calls of ``tools``
    (name -> parameters schema) in ``fmt``: exactly one call, or 1 to
    :data:`MAX_TOOL_CALLS` with ``parallel``. JSON is compact, ``name`` first,
    numbers bounded as :func:`tserve.grammar.lark_json` bounds them."""
    call = _call_schema(fmt, tools)
    most = MAX_TOOL_CALLS if parallel else 1
    if fmt is ToolFormat.HERMES:
        opener, closer = _lark_escape(HERMES_OPEN), _lark_escape(HERMES_CLOSE)
        block = f'"{opener}\\n" %json {lark_json(call)} "\\n{closer}"'
        return f"start: call{_repeat(_NEWLINE_CALL, most)}\ncall: {block}\n"
    if fmt is ToolFormat.LLAMA3:
        return f"start: call{_repeat(_SEMICOLON_CALL, most)}\ncall: %json {lark_json(call)}\n"
    array = {"type": "array", "items": call, "minItems": 1, "maxItems": most}
    if fmt is ToolFormat.MISTRAL:
        return f'start: "{_lark_escape(MISTRAL_OPEN)}" %json {lark_json(array)}\n'
    outer = {
        "type": "object",
        "properties": {"tool_calls": array},
        "required": ["tool_calls"],
        "additionalProperties": False,
    }
    return f"start: %json {lark_json(outer)}\n"


_NEWLINE_CALL: Final = '"\\n" call'
_SEMICOLON_CALL: Final = '"; " call'


def _repeat(item: str, most: int) -> str:
    """Lark for 0 to ``most - 1`` more of ``item``."""
    return "" if most == 1 else f" ({item}){{0,{most - 1}}}"


def _call_schema(fmt: ToolFormat, tools: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, fmt.arguments_key: parameters},
            "required": ["name", fmt.arguments_key],
            "additionalProperties": False,
        }
        for name, parameters in tools.items()
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _lark_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


# -- parsing a whole output ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ParsedCall:
    """One call: ``arguments`` is compact JSON text of an object."""

    name: str
    arguments: str


@dataclasses.dataclass(frozen=True, slots=True)
class ParsedOutput:
    """An output split into content (text outside valid calls, or None) and calls."""

    content: str | None
    calls: list[ParsedCall]


def call_of(value: Any, fmt: ToolFormat, names: frozenset[str]) -> ParsedCall | None:
    """``value`` (decoded JSON) as a call of one of ``names``, or None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if value["name"] not in names:
        return None
    key = fmt.arguments_key
    arguments = value.get(key, value.get("arguments") if key != "arguments" else None)
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], compact_json(arguments))


def compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def calls_of_region(region: str, fmt: ToolFormat, names: frozenset[str]) -> list[ParsedCall] | None:
    """The calls a region (see the module docstring) holds, or None if it is not calls."""
    text = region.strip()
    values: list[Any] = []
    try:
        if fmt is ToolFormat.LLAMA3:
            values = _llama3_values(text)
        else:
            decoded = json.loads(text)
            if fmt is ToolFormat.HERMES:
                values = [decoded]
            elif fmt is ToolFormat.MISTRAL:
                values = decoded if isinstance(decoded, list) else [decoded]
            elif isinstance(decoded, dict) and isinstance(decoded.get("tool_calls"), list):
                values = decoded["tool_calls"]
    except ValueError:
        return None
    calls = [call_of(v, fmt, names) for v in values]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def _llama3_values(text: str) -> list[Any]:
    """JSON objects joined by ``;`` (raises ValueError on anything else)."""
    decoder = json.JSONDecoder()
    values, at = [], 0
    while True:
        value, at = decoder.raw_decode(text, at)
        values.append(value)
        rest = text[at:].lstrip()
        if not rest:
            return values
        if not rest.startswith(LLAMA3_SEPARATOR):
            raise ValueError("calls must be joined by ';'")
        at = len(text) - len(rest) + 1
        while at < len(text) and text[at].isspace():
            at += 1


def parse_output(text: str, fmt: ToolFormat, names: frozenset[str]) -> ParsedOutput:
    """Split a whole output into content and calls (see the module docstring)."""
    if fmt is ToolFormat.HERMES:
        return _parse_hermes(text, names)
    if fmt is ToolFormat.MISTRAL:
        head, marker, region = text.partition(MISTRAL_OPEN)
        if not marker:
            return ParsedOutput(text, [])
    else:
        head, region = "", text
        if not text.lstrip().startswith("{"):
            return ParsedOutput(text, [])
    calls = calls_of_region(region, fmt, names)
    if calls is None:
        return ParsedOutput(text, [])
    return ParsedOutput(head if head.strip() else None, calls)


def _parse_hermes(text: str, names: frozenset[str]) -> ParsedOutput:
    content: list[str] = []
    calls: list[ParsedCall] = []
    at = 0
    while True:
        start = text.find(HERMES_OPEN, at)
        end = -1 if start < 0 else text.find(HERMES_CLOSE, start + len(HERMES_OPEN))
        if end < 0:
            content.append(text[at:])
            break
        content.append(text[at:start])
        block = text[start + len(HERMES_OPEN) : end]
        found = calls_of_region(block, ToolFormat.HERMES, names)
        if found is None:
            content.append(text[start : end + len(HERMES_CLOSE)])
        else:
            calls.extend(found)
        at = end + len(HERMES_CLOSE)
    joined = "".join(content)
    if calls:  # the blanks between calls and text are not content
        return ParsedOutput(joined.strip() or None, calls)
    return ParsedOutput(joined, calls)
