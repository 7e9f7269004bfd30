"""Anthropic Messages API request bodies as clients send them: typed msgspec Structs.

As :mod:`tserve.web._bodies` does for OpenAI's: ranges are checked while
decoding, unknown fields are ignored (``cache_control``, ``metadata`` keys,
``service_tier``, ...). A content block is one Struct with every block
type's fields; which fields a type needs, and where it may appear, are the
rules of :mod:`tserve.web._message_requests`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from tserve.web._bodies import MAX_MESSAGES, MAX_TOOLS

__all__ = [
    "ContentBlock",
    "CountTokensBody",
    "MessageParam",
    "MessagesBody",
    "SystemBlock",
    "ThinkingConfig",
    "ToolChoiceBody",
    "ToolParam",
]

_INT64_MAX = 2**63 - 1
# Anthropic's stop sequences: non-empty; tserve's bound on the length of one.
_StopSequence = Annotated[str, msgspec.Meta(min_length=1, max_length=1000)]


class SystemBlock(msgspec.Struct, kw_only=True):
    """One block of ``system``: text only (``cache_control`` ignored)."""

    type: Literal["text"]
    text: str


class ContentBlock(msgspec.Struct, kw_only=True):
    """One block of a message's content, of any type (see the module docstring)."""

    type: str
    text: str | None = None  # text
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[ContentBlock] | None = None  # tool_result
    is_error: bool | None = None  # tool_result


class MessageParam(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant", "system"]  # system: Claude Code's mid-conversation notes
    content: str | list[ContentBlock]


class ToolParam(msgspec.Struct, kw_only=True):
    """A client tool. ``type`` absent or "custom"; Anthropic's server tools are refused."""

    name: Annotated[str, msgspec.Meta(pattern="^[A-Za-z0-9_-]{1,128}$")]
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None


class ToolChoiceBody(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(msgspec.Struct, kw_only=True):
    type: str  # "enabled", "disabled", "adaptive" (what Claude Code sends), ...
    budget_tokens: int | None = None


_Messages = Annotated[list[MessageParam], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)]
_Tools = Annotated[list[ToolParam], msgspec.Meta(max_length=MAX_TOOLS)]


class CountTokensBody(msgspec.Struct, kw_only=True):
    """``POST /v1/messages/count_tokens``: what shapes the prompt."""

    model: str
    keep_alive: float | str | None = None  # Ollama's: seconds or a duration; -1 pins
    messages: _Messages
    system: str | list[SystemBlock] | None = None
    tools: _Tools | None = None
    tool_choice: ToolChoiceBody | None = None
    thinking: ThinkingConfig | None = None


class MessagesBody(CountTokensBody, kw_only=True):
    """``POST /v1/messages``."""

    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=_INT64_MAX)]
    stop_sequences: list[_StopSequence] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0, le=_INT64_MAX)] | None = None
    metadata: dict[str, Any] | None = None
    stream: bool | None = None
