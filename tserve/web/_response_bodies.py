"""OpenAI Responses API request bodies as clients send them: typed msgspec Structs.

As :mod:`tserve.web._bodies` does for chat: ranges are checked while
decoding, unknown fields are ignored (``include``, ``reasoning``,
``prompt_cache_key``, ``service_tier``, ``truncation``, ...). An input item
is one Struct with every item type's fields, and a content part one Struct
with every part type's; which fields a type needs is the rule of
:mod:`tserve.web._response_requests`.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from tserve.web._bodies import MAX_MESSAGES, MAX_TOOLS

__all__ = [
    "FunctionToolBody",
    "InputItem",
    "InputPart",
    "ResponsesBody",
    "TextConfig",
    "TextFormat",
]

_INT64_MAX = 2**63 - 1
MAX_METADATA = 16  # OpenAI's: at most 16 pairs, keys of 64 and values of 512 characters


class InputPart(msgspec.Struct, kw_only=True):
    """One content part of a message item, or of a function call's output."""

    type: str
    text: str | None = None


class InputItem(msgspec.Struct, kw_only=True):
    """One item of ``input``, of any type (``type`` absent: a message)."""

    type: str | None = None
    id: str | None = None
    role: str | None = None  # message
    content: str | list[InputPart] | None = None  # message
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call: a JSON object, as text
    namespace: str | None = None  # function_call: the namespace tool its function is in
    output: str | list[InputPart] | None = None  # function_call_output
    status: str | None = None


class FunctionToolBody(msgspec.Struct, kw_only=True):
    """A tool in the Responses shape (flat): ``{"type": "function", "name", "parameters"}``,
    a ``namespace`` of function tools (``tools``), or a hosted tool (only ``type`` read)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    tools: Annotated[list[FunctionToolBody], msgspec.Meta(max_length=MAX_TOOLS)] | None = None


class TextFormat(msgspec.Struct, kw_only=True):
    """``text.format``: text, json_object, or json_schema with its name and schema."""

    type: str
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted, not honoured


_Metadata = Annotated[
    dict[Annotated[str, msgspec.Meta(max_length=64)], Annotated[str, msgspec.Meta(max_length=512)]],
    msgspec.Meta(max_length=MAX_METADATA),
]


class ResponsesBody(msgspec.Struct, kw_only=True):
    """``POST /v1/responses``."""

    model: str | None = None
    keep_alive: float | str | None = None  # Ollama's: seconds or a duration; -1 pins
    input: str | Annotated[list[InputItem], msgspec.Meta(max_length=MAX_MESSAGES)] | None = None
    instructions: str | None = None
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1, le=_INT64_MAX)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    tools: Annotated[list[FunctionToolBody], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "name"}
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: _Metadata | None = None
    user: str | None = None
    stream: bool | None = None
    store: bool | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    max_tool_calls: Annotated[int, msgspec.Meta(ge=1)] | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    conversation: Any = None
    prompt: Any = None
