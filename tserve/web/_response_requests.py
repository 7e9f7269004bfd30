"""Responses API bodies in, the chat machinery's :class:`ChatRequest` out. Sans-IO.

Rules (each refusal is a 400 naming the field):

* ``input`` is a string (one user message) or a list of items. An item is
  a message (``type`` "message" or absent) of role ``user``, ``system``,
  ``developer`` (a system message for the template) or ``assistant``, its
  content a string or ``input_text``/``output_text`` parts (other parts:
  images, files, refusals, are refused); a ``function_call`` (``call_id``,
  ``name``, ``arguments``: a JSON object as text); or a
  ``function_call_output`` (``call_id``, ``output``: a string or text parts)
  answering a ``function_call`` earlier in the conversation. ``reasoning``
  items of an earlier turn (sent back, or stored) are dropped (the template
  never shows them);
  other item types are refused.
* Items are normalized (:func:`normalize_items`) to the shape the store
  keeps and ``input_items`` lists: every item has an ``id`` and a
  ``status``, message content is a list of parts.
* The conversation the template sees: ``instructions`` as the first system
  message (a previous response's instructions are not carried over, as
  OpenAI's), then the items of ``previous_response_id``'s conversation (its
  input and its output), then this request's items. Consecutive
  ``function_call`` items become one assistant message's ``tool_calls``
  (joined to the assistant message just before them).
* ``tools``: function tools in the flat shape (``{"type": "function",
  "name", "parameters", "strict"}``), and ``namespace`` tools, whose function
  tools are offered by their own names (a call of one is a ``function_call``
  with its ``namespace``). Other types are OpenAI's hosted tools (web search,
  file search, code interpreter, ...), which this server does not run: they
  are not offered to the model, and echoed by type. ``tool_choice``
  "none"/"auto"/"required" or ``{"type": "function", "name"}``;
  ``parallel_tool_calls``. With a required or named
  choice the output is tool calls only, so ``text.format`` does not apply
  to it (an agent asks for both: a forced call, then a formatted answer in
  a later turn).
* ``text.format``: ``text``, ``json_object``, or ``json_schema`` (with
  ``schema``) through the grammar path (:mod:`tserve.web._structured`).
* ``max_output_tokens`` is a ceiling: past what the context leaves after
  the prompt it is cut to that (the response may then be incomplete with
  reason "max_output_tokens" sooner). Left out, the rest of the context.
* ``background`` needs ``store`` (OpenAI's rule). ``top_logprobs``,
  ``conversation`` and ``prompt`` (stored prompts) are refused.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from tserve.nursery import InvalidRequest
from tserve.sampling import Constraint, SamplingParams
from tserve.web._bodies import JsonSchemaFormat, ResponseFormat, SamplingBody
from tserve.web._requests import ChatRequest, decode_body, keep_alive_of
from tserve.web._response_bodies import (
    FunctionToolBody,
    InputItem,
    InputPart,
    ResponsesBody,
    TextFormat,
)
from tserve.web._structured import constraint_of
from tserve.web._tools import Mode, ToolRequest, ToolSpec, build_tool_request

__all__ = ["ResponseRequest", "item_id", "normalize_items", "parse_responses"]

JSON = dict[str, Any]

_ROLES = frozenset({"user", "system", "developer", "assistant"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_DROPPED = frozenset({"reasoning"})  # earlier turns' reasoning: the template never shows it


def item_id(prefix: str) -> str:
    """A fresh item id: ``msg``, ``fc`` (function call) or ``fco`` (its output)."""
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclasses.dataclass(frozen=True, slots=True)
class ResponseRequest:
    """A validated ``/v1/responses`` body. ``items`` are this request's input items,
    normalized; ``echo`` the request parameters the response object repeats."""

    model: str | None
    items: list[JSON]
    instructions: str | None
    params: SamplingParams
    max_output_tokens: int | None
    tools: ToolRequest | None
    constraint_field: str | None
    stream: bool
    store: bool
    background: bool
    previous_response_id: str | None
    echo: JSON
    keep_alive: float | None = None  # seconds (negative: pinned); None: the default
    namespaces: dict[str, str] = dataclasses.field(default_factory=dict)  # function -> its

    def chat(self, history: list[JSON]) -> ChatRequest:
        """The chat request for this input after ``history`` (a previous response's
        conversation: its input items, then its output items). Raises InvalidRequest."""
        messages = [] if not self.instructions else [self._system(self.instructions)]
        messages += conversation_messages(history, self.items)
        return ChatRequest(
            model=self.model,
            messages=messages,
            params=self.params,
            max_tokens=self.max_output_tokens,
            max_tokens_fits=True,
            n=1,
            stream=self.stream,
            include_usage=False,
            logprobs=None,
            constraint_field=self.constraint_field,
            tools=self.tools,
            keep_alive=self.keep_alive,
        )

    @staticmethod
    def _system(text: str) -> JSON:
        return {"role": "system", "content": text}


def parse_responses(body: bytes) -> ResponseRequest:
    """Validate a ``/v1/responses`` body. Raises InvalidRequest."""
    req = decode_body(body, ResponsesBody)
    for refused in ("top_logprobs", "conversation", "prompt"):
        if getattr(req, refused) is not None:
            raise InvalidRequest(f"'{refused}' is not supported by this server", param=refused)
    if req.input is None:
        raise InvalidRequest("Missing required field 'input'", param="input")
    store = req.store is not False
    if req.background and not store:
        raise InvalidRequest(
            "background responses need 'store': true (a background response is polled from "
            "the store)",
            param="background",
        )
    items = normalize_items(req.input)
    if not items and req.previous_response_id is None:
        raise InvalidRequest("'input' must not be empty", param="input")
    constraint, field, fmt = _text_format(req)
    namespaces: dict[str, str] = {}
    tools = _tools(req, namespaces)
    if tools is not None and tools.enforced:
        constraint = field = None  # the output is calls only: no text to format
    params = SamplingParams(
        max_tokens=req.max_output_tokens or 1,  # set again once the prompt length is known
        temperature=req.temperature,
        top_p=req.top_p,
        constraint=constraint,
    )
    return ResponseRequest(
        model=req.model,
        items=items,
        instructions=req.instructions,
        params=params,
        max_output_tokens=req.max_output_tokens,
        tools=tools,
        constraint_field=field,
        stream=bool(req.stream),
        store=store,
        background=bool(req.background),
        previous_response_id=req.previous_response_id,
        echo=_echo(req, store, fmt),
        keep_alive=keep_alive_of(req.keep_alive),
        namespaces=namespaces,
    )


def _echo(req: ResponsesBody, store: bool, fmt: JSON) -> JSON:
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": [_tool_echo(tool) for tool in req.tools or ()],
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "text": {"format": fmt},
        "previous_response_id": req.previous_response_id,
        "store": store,
        "background": bool(req.background),
        "metadata": req.metadata or {},
        "user": req.user,
    }


def _tool_echo(tool: FunctionToolBody) -> JSON:
    if tool.type == "namespace":
        inner = [_tool_echo(t) for t in tool.tools or ()]
        return {
            "type": "namespace",
            "name": tool.name,
            "description": tool.description,
            "tools": inner,
        }
    if tool.type != "function":
        return {"type": tool.type}
    return {
        "type": "function",
        "name": tool.name,
        "description": tool.description,
        "parameters": tool.parameters,
        "strict": tool.strict if tool.strict is not None else True,
    }


# -- input items ---------------------------------------------------------------------


def normalize_items(raw: str | list[InputItem]) -> list[JSON]:
    """``input`` as stored items (module docstring). Raises InvalidRequest naming the field."""
    if isinstance(raw, str):
        return [_message("user", [{"type": "input_text", "text": raw}], None)]
    out = []
    for i, item in enumerate(raw):
        param = f"input[{i}]"
        kind = item.type or "message"
        if kind == "message":
            out.append(_message_item(item, param))
        elif kind == "function_call":
            out.append(_call_item(item, param))
        elif kind == "function_call_output":
            out.append(_output_item(item, param))
        elif kind not in _DROPPED:
            raise InvalidRequest(
                f"'{param}.type': input items of type {kind!r} are not supported by this server",
                param=f"{param}.type",
            )
    return out


def _message(role: str, content: list[JSON], given_id: str | None) -> JSON:
    return {
        "type": "message",
        "id": given_id or item_id("msg"),
        "role": role,
        "content": content,
        "status": "completed",
    }


def _message_item(item: InputItem, param: str) -> JSON:
    if item.role not in _ROLES:
        raise InvalidRequest(
            f"'{param}.role' must be one of user, system, developer, assistant",
            param=f"{param}.role",
        )
    if item.content is None:
        raise InvalidRequest(f"Missing required field '{param}.content'", param=f"{param}.content")
    kind = "output_text" if item.role == "assistant" else "input_text"
    parts = (
        [InputPart(type=kind, text=item.content)] if isinstance(item.content, str) else item.content
    )
    content = []
    for j, part in enumerate(parts):
        where = f"{param}.content[{j}]"
        text = _part_text(part, where)
        shown: JSON = {"type": kind, "text": text}
        if kind == "output_text":
            shown["annotations"] = []
        content.append(shown)
    return _message(item.role, content, item.id)


def _part_text(part: InputPart, where: str) -> str:
    if part.type not in _TEXT_PARTS:
        raise InvalidRequest(
            f"'{where}.type': content parts of type {part.type!r} are not supported by this server",
            param=f"{where}.type",
        )
    if part.text is None:
        raise InvalidRequest(f"Missing required field '{where}.text'", param=f"{where}.text")
    return part.text


def _call_item(item: InputItem, param: str) -> JSON:
    for field in ("call_id", "name", "arguments"):
        if getattr(item, field) is None:
            raise InvalidRequest(
                f"Missing required field '{param}.{field}'", param=f"{param}.{field}"
            )
    assert item.arguments is not None
    try:
        arguments = json.loads(item.arguments)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise InvalidRequest(
            f"'{param}.arguments' must be a JSON object, as text", param=f"{param}.arguments"
        )
    call = {
        "type": "function_call",
        "id": item.id or item_id("fc"),
        "call_id": item.call_id,
        "name": item.name,
        "arguments": item.arguments,
        "status": "completed",
    }
    if item.namespace is not None:
        call["namespace"] = item.namespace
    return call


def _output_item(item: InputItem, param: str) -> JSON:
    if item.call_id is None:
        raise InvalidRequest(f"Missing required field '{param}.call_id'", param=f"{param}.call_id")
    if item.output is None:
        raise InvalidRequest(f"Missing required field '{param}.output'", param=f"{param}.output")
    if isinstance(item.output, str):
        output = item.output
    else:
        output = "".join(
            _part_text(part, f"{param}.output[{j}]") for j, part in enumerate(item.output)
        )
    return {
        "type": "function_call_output",
        "id": item.id or item_id("fco"),
        "call_id": item.call_id,
        "output": output,
        "status": "completed",
    }


def conversation_messages(history: list[JSON], items: list[JSON]) -> list[JSON]:
    """Chat messages for the template from stored ``history`` and this request's
    ``items`` (both normalized). A function_call_output of ``items`` must answer a
    function_call before it (400 naming it)."""
    out: list[JSON] = []
    names: dict[str, str] = {}  # call_id -> the function's name, of every call so far
    for i, item in enumerate([*history, *items]):
        if item["type"] in _DROPPED:  # a stored response's reasoning
            continue
        if item["type"] == "message":
            text = "".join(part["text"] for part in item["content"])
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": text})
        elif item["type"] == "function_call":
            names[item["call_id"]] = item["name"]
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": _arguments(item["arguments"])},
            }
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
        else:
            call_id = item["call_id"]
            if call_id not in names:
                param = f"input[{i - len(history)}].call_id"
                raise InvalidRequest(
                    f"'{param}': no function_call with call_id {call_id!r} was found before this "
                    "function_call_output",
                    param=param,
                )
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "name": names[call_id],
                    "content": item["output"],
                }
            )
    return out


def _arguments(text: str) -> dict[str, Any]:
    """A call's arguments for the template; ``{}`` for a stored call that was cut short
    (an input call was checked already)."""
    try:
        arguments = json.loads(text)
    except ValueError:
        return {}
    return arguments if isinstance(arguments, dict) else {}


# -- tools and the text format -------------------------------------------------------


def _tools(req: ResponsesBody, namespaces: dict[str, str]) -> ToolRequest | None:
    """The function tools offered (``namespaces`` filled: function name -> namespace)."""
    specs: list[ToolSpec] = []
    params: list[str] = []  # the name field of each spec, for a duplicate's 400
    for i, tool in enumerate(req.tools or ()):
        if tool.type == "function":
            specs.append(_spec(tool, f"tools[{i}]"))
            params.append(f"tools[{i}].name")
        elif tool.type == "namespace":
            if tool.name is None:
                raise InvalidRequest(
                    f"Missing required field 'tools[{i}].name'", param=f"tools[{i}].name"
                )
            for j, inner in enumerate(tool.tools or ()):
                where = f"tools[{i}].tools[{j}]"
                if inner.type != "function":
                    raise InvalidRequest(
                        f"'{where}.type': a namespace holds function tools only here",
                        param=f"{where}.type",
                    )
                specs.append(_spec(inner, where))
                params.append(f"{where}.name")
                namespaces[specs[-1].name] = tool.name
    names = [spec.name for spec in specs]
    for k, name in enumerate(names):
        if name in names[:k]:
            raise InvalidRequest(f"'{params[k]}': {name!r} is defined twice", param=params[k])
    return build_tool_request(
        specs,
        _choice(req.tool_choice),
        parallel=req.parallel_tool_calls is not False,
        name_param="tools[{i}].name",
        choice_param="tool_choice.name",
    )


def _spec(tool: FunctionToolBody, where: str) -> ToolSpec:
    if tool.name is None:
        raise InvalidRequest(f"Missing required field '{where}.name'", param=f"{where}.name")
    function: JSON = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    if tool.parameters is not None:
        function["parameters"] = tool.parameters
    return ToolSpec(tool.name, tool.parameters, {"type": "function", "function": function})


def _choice(raw: Any) -> Mode | str | None:
    if raw is None:
        return None
    if raw in ("none", "auto", "required"):
        mode: Mode = raw
        return mode
    if isinstance(raw, dict) and raw.get("type") == "function":
        name = raw.get("name")
        if not isinstance(name, str):
            raise InvalidRequest("'tool_choice.name' must name a tool", param="tool_choice.name")
        return name
    raise InvalidRequest(
        '\'tool_choice\' must be "none", "auto", "required" or {"type": "function", "name": ...}',
        param="tool_choice",
    )


def _text_format(req: ResponsesBody) -> tuple[Constraint | None, str | None, JSON]:
    """The constraint ``text.format`` stands for, its field, and the format as echoed."""
    fmt: TextFormat | None = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None, None, {"type": "text"}
    if fmt.type == "json_schema":
        if fmt.schema is None:
            raise InvalidRequest(
                "'text.format' of type json_schema needs a 'schema'",
                param="text.format.schema",
            )
        if fmt.name is None:
            raise InvalidRequest(
                "Missing required field 'text.format.name'", param="text.format.name"
            )
        schema = JsonSchemaFormat(name=fmt.name, schema=fmt.schema, strict=fmt.strict)
        body = SamplingBody(response_format=ResponseFormat(type="json_schema", json_schema=schema))
        echo: JSON = {
            "type": "json_schema",
            "name": fmt.name,
            "schema": fmt.schema,
            "strict": fmt.strict,
            "description": fmt.description,
        }
    elif fmt.type == "json_object":
        body = SamplingBody(response_format=ResponseFormat(type="json_object"))
        echo = {"type": "json_object"}
    else:
        raise InvalidRequest(
            f"'text.format.type' must be text, json_object or json_schema, not {fmt.type!r}",
            param="text.format.type",
        )
    constrained = constraint_of(body)
    assert constrained is not None
    return constrained.constraint, "text.format", echo
