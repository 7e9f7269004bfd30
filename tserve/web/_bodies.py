"""OpenAI request bodies as clients send them: typed msgspec Structs, and their bounds.

The field types carry the ranges msgspec checks while decoding (a token id
is a non-negative int64, a penalty lies in [-2, 2], ...); unknown fields are
ignored. A body nested deeper than msgspec's recursion limit is a 400 too
(:mod:`tserve.web._requests` maps its RecursionError). What a field means,
and the rules across fields, are :mod:`tserve.web._requests`'s.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from tserve.validity import MAX_LOGPROBS

__all__ = [
    "MAX_CHOICES",
    "MAX_EMBEDDING_INPUTS",
    "MAX_LOGPROBS",
    "MAX_MESSAGES",
    "MAX_STOP",
    "MAX_STOP_LENGTH",
    "MAX_STOP_TOKEN_IDS",
    "ChatBody",
    "CompletionBody",
    "DetokenizeBody",
    "EmbeddingBody",
    "MessageBody",
    "SamplingBody",
    "StructuredOutputsBody",
    "TokenizeBody",
    "ToolBody",
    "ToolCallBody",
]

MAX_CHOICES = 128  # n * len(prompts) per HTTP request
MAX_STOP = 16  # stop strings per request; past it, 400 naming "stop"
MAX_STOP_LENGTH = 1000  # characters per stop string; past it, 400 naming "stop"
MAX_MESSAGES = 2048  # chat messages per request (also /tokenize); past it, 400 naming "messages"
MAX_STOP_TOKEN_IDS = 256
MAX_EMBEDDING_INPUTS = 2048
MAX_TOOLS = 512  # tools per chat request; past it, 400 naming "tools"
MAX_CHOICE_STRINGS = 4096  # strings of a "choice" constraint; past it, 400 naming the field

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_Int64 = Annotated[int, msgspec.Meta(ge=_INT64_MIN, le=_INT64_MAX)]
_TokenId = Annotated[int, msgspec.Meta(ge=0, le=_INT64_MAX)]
_Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
_StopString = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_LENGTH)]
_Logprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)]


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # accepted, not honoured


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """``response_format.json_schema``: what the ``openai`` SDK's ``parse()`` sends."""

    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(msgspec.Struct, kw_only=True):
    """vLLM's ``structured_outputs``: at most one of these may be set."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: Annotated[list[str], msgspec.Meta(max_length=MAX_CHOICE_STRINGS)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None


class SamplingBody(msgspec.Struct, kw_only=True):
    """Fields shared by both endpoints."""

    model: str | None = None
    keep_alive: float | str | None = None  # Ollama's: seconds or a duration; -1 pins
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=_INT64_MAX)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=_INT64_MAX)] | None = None
    seed: _Int64 | None = None
    stop: _StopString | list[_StopString] | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHOICES)] | None = None
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None
    user: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # vLLM-style extras
    ignore_eos: bool | None = None
    stop_token_ids: list[_TokenId] | None = None
    min_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    # structured outputs: OpenAI's, vLLM's, and vLLM's older top-level names
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], msgspec.Meta(max_length=MAX_CHOICE_STRINGS)] | None = None
    guided_grammar: str | None = None
    # known, refused unless harmless
    best_of: Annotated[int, msgspec.Meta(ge=1)] | None = None


class CompletionBody(SamplingBody, kw_only=True):
    prompt: str | list[str | _TokenId | list[_TokenId]]
    echo: bool | None = None
    logprobs: _Logprobs | None = None
    suffix: str | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class FunctionCallBody(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ToolCallBody(msgspec.Struct, kw_only=True):
    """One call of an assistant message's ``tool_calls`` (a conversation's history)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallBody


class MessageBody(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallBody] | None = None
    tool_call_id: str | None = None


_Messages = Annotated[list[MessageBody], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)]


class FunctionBody(msgspec.Struct, kw_only=True):
    """A tool's function: ``parameters`` is a JSON Schema (None = no arguments)."""

    name: Annotated[str, msgspec.Meta(pattern="^[A-Za-z0-9_.:-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolBody(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionBody


class ChatBody(SamplingBody, kw_only=True):
    messages: _Messages
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1, le=_INT64_MAX)] | None = None
    logprobs: bool | None = None
    top_logprobs: _Logprobs | None = None
    tools: Annotated[list[ToolBody], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type", "function": {"name"}}
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # more variables of the chat template


class TokenizeBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: _Messages | None = None


class DetokenizeBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[_TokenId]


class EmbeddingBody(msgspec.Struct, kw_only=True):
    input: str | list[str | _TokenId | list[_TokenId]]
    model: str | None = None
    keep_alive: float | str | None = None  # Ollama's: seconds or a duration; -1 pins
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None
    user: str | None = None


class ModelAdminBody(msgspec.Struct, kw_only=True):
    """``POST /models/load`` and ``/models/unload`` (llama.cpp's router names)."""

    model: str
