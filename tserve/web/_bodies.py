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
    "TokenizeBody",
]

MAX_CHOICES = 128  # n * len(prompts) per HTTP request
MAX_STOP = 16  # stop strings per request; past it, 400 naming "stop"
MAX_STOP_LENGTH = 1000  # characters per stop string; past it, 400 naming "stop"
MAX_MESSAGES = 2048  # chat messages per request (also /tokenize); past it, 400 naming "messages"
MAX_STOP_TOKEN_IDS = 256
MAX_EMBEDDING_INPUTS = 2048

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_Int64 = Annotated[int, msgspec.Meta(ge=_INT64_MIN, le=_INT64_MAX)]
_TokenId = Annotated[int, msgspec.Meta(ge=0, le=_INT64_MAX)]
_Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
_StopString = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_LENGTH)]
_Logprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)]


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # accepted, not honoured


class SamplingBody(msgspec.Struct, kw_only=True):
    """Fields shared by both endpoints."""

    model: str | None = None
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
    # known, refused unless harmless
    logit_bias: dict[str, float] | None = None
    best_of: Annotated[int, msgspec.Meta(ge=1)] | None = None


class CompletionBody(SamplingBody, kw_only=True):
    prompt: str | list[str | _TokenId | list[_TokenId]]
    echo: bool | None = None
    logprobs: _Logprobs | None = None
    suffix: str | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class MessageBody(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Any = None
    tool_call_id: str | None = None


_Messages = Annotated[list[MessageBody], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)]


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str


class ChatBody(SamplingBody, kw_only=True):
    messages: _Messages
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1, le=_INT64_MAX)] | None = None
    logprobs: bool | None = None
    top_logprobs: _Logprobs | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: ResponseFormat | None = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    parallel_tool_calls: bool | None = None


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
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None
    user: str | None = None
