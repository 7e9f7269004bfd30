"""Anthropic Messages bodies in, the chat machinery's :class:`ChatRequest` out. Sans-IO.

Rules (each refusal is a 400 naming the field):

* ``system`` (a string, or text blocks joined by a blank line) becomes the
  first message, of role system.
* ``messages``: roles ``user`` and ``assistant``, and ``system`` (text
  only: Claude Code sends notes so mid-conversation); content a string or
  blocks. A user message holds ``text`` and ``tool_result`` blocks, the
  ``tool_result`` blocks first; an assistant message holds ``text`` and
  ``tool_use`` blocks (``thinking`` and ``redacted_thinking`` blocks of an
  earlier turn are dropped: the template never shows them). Other block
  types (images, documents, server tools) are refused.
* Tool history, as Anthropic enforces it: every ``tool_use`` of an
  assistant message has its ``tool_result`` in the very next message, and a
  ``tool_result`` answers a ``tool_use`` of the message just before it. A
  ``tool_use`` becomes an assistant tool call (its ``input`` the arguments
  object); a ``tool_result`` a message of role tool (its content a string or
  text blocks; ``is_error`` puts "Error: " before it).
* The last message other than system notes must be the user's: tserve
  does not continue an assistant message (prefill).
* ``tools``: client tools (``input_schema`` a JSON Schema object); a tool
  with another ``type`` is one of Anthropic's server tools, refused.
  ``tool_choice`` ``auto``/``any``/``tool``/``none`` are chat's
  auto/required/named/none, with ``disable_parallel_tool_use``.
* ``max_tokens`` is required; past what the context leaves after the
  prompt it is cut to that (Claude Code asks for 64,000 whatever the
  model), and the message may then end with "max_tokens" sooner.
  ``stop_sequences`` at most ``MAX_STOP``. ``temperature`` (0 to 1),
  ``top_p``, ``top_k``; left out, the engine's defaults. ``metadata`` is
  accepted and unused.
* ``thinking``: ``enabled`` (its ``budget_tokens`` accepted, not enforced:
  the thinking counts against ``max_tokens``) or ``adaptive`` asks for the
  model's thinking as ``thinking`` blocks; absent, ``disabled`` or any other
  type, the template gets ``enable_thinking`` false (a template that reads
  it does not open the thinking) and thinking the model writes anyway is
  dropped from the answer.
"""

from __future__ import annotations

from typing import Any

from tserve.nursery import InvalidRequest
from tserve.sampling import SamplingParams
from tserve.web._bodies import MAX_STOP
from tserve.web._message_bodies import (
    ContentBlock,
    CountTokensBody,
    MessageParam,
    MessagesBody,
    ToolChoiceBody,
)
from tserve.web._requests import ChatRequest, decode_body, keep_alive_of
from tserve.web._tools import Mode, ToolRequest, ToolSpec, build_tool_request

__all__ = ["parse_count_tokens", "parse_messages"]

JSON = dict[str, Any]

_DROPPED = frozenset({"thinking", "redacted_thinking"})  # earlier turns' reasoning
_THINKING_ON = frozenset({"enabled", "adaptive"})  # thinking.type values that show it


def parse_messages(body: bytes) -> ChatRequest:
    """Validate a ``/v1/messages`` body into the chat request it stands for. Raises
    InvalidRequest."""
    req = decode_body(body, MessagesBody)
    if req.stop_sequences is not None and len(req.stop_sequences) > MAX_STOP:
        raise InvalidRequest(
            f"'stop_sequences' holds at most {MAX_STOP} strings", param="stop_sequences"
        )
    params = SamplingParams(
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stop=tuple(req.stop_sequences or ()),
    )
    return _chat_request(req, params, max_tokens=req.max_tokens, stream=bool(req.stream))


def parse_count_tokens(body: bytes) -> ChatRequest:
    """Validate a ``/v1/messages/count_tokens`` body (the prompt's fields only)."""
    req = decode_body(body, CountTokensBody)
    return _chat_request(req, SamplingParams(max_tokens=1), max_tokens=None, stream=False)


def _chat_request(
    req: CountTokensBody, params: SamplingParams, *, max_tokens: int | None, stream: bool
) -> ChatRequest:
    messages = _system(req.system) + _messages(req.messages)
    thinking = req.thinking is not None and req.thinking.type in _THINKING_ON
    return ChatRequest(
        model=req.model,
        messages=messages,
        params=params,
        max_tokens=max_tokens,
        max_tokens_fits=True,
        n=1,
        stream=stream,
        include_usage=False,
        logprobs=None,
        tools=_tools(req),
        template_kwargs=None if thinking else {"enable_thinking": False},
        keep_alive=keep_alive_of(req.keep_alive),
    )


def _system(system: str | list[Any] | None) -> list[JSON]:
    if system is None:
        return []
    text = system if isinstance(system, str) else "\n\n".join(block.text for block in system)
    return [{"role": "system", "content": text}] if text else []


def _messages(messages: list[MessageParam]) -> list[JSON]:
    out: list[JSON] = []
    open_calls: dict[str, str] = {}  # the tool_use ids (-> names) of message `caller`
    caller = -1
    for i, message in enumerate(messages):
        if message.role == "system":
            out.append({"role": "system", "content": _system_text(message.content, i)})
        elif message.role == "assistant":
            _unanswered(open_calls, caller)
            assistant, open_calls = _assistant(message.content, i)
            caller = i
            out.append(assistant)
        else:
            answered: set[str] = set()
            out.extend(_user(message.content, i, open_calls, answered))
            _unanswered({k: v for k, v in open_calls.items() if k not in answered}, caller)
            open_calls = {}
    _unanswered(open_calls, caller)
    last = max(i for i, m in enumerate(messages) if m.role != "system" or i == 0)
    if messages[last].role != "user":
        raise InvalidRequest(
            f"'messages[{last}]': the last message must be the user's (this server does not "
            "continue an assistant message)",
            param=f"messages[{last}].role",
        )
    return out


def _system_text(content: str | list[ContentBlock], i: int) -> str:
    texts = []
    for j, block in enumerate(_blocks(content)):
        param = f"messages[{i}].content[{j}]"
        if block.type != "text":
            raise _refuse_type(block, param, "system")
        texts.append(_text_of(block, param))
    return "".join(texts)


def _unanswered(open_calls: dict[str, str], caller: int) -> None:
    """Every tool_use of message ``caller`` needs its tool_result in the next message."""
    if open_calls:
        ids = ", ".join(sorted(open_calls))
        raise InvalidRequest(
            f"'messages[{caller}]': tool_use ids were found without tool_result blocks "
            f"immediately after: {ids}. Each tool_use block must have a tool_result block "
            "in the next message",
            param=f"messages[{caller}].content",
        )


def _blocks(content: str | list[ContentBlock]) -> list[ContentBlock]:
    return [ContentBlock(type="text", text=content)] if isinstance(content, str) else content


def _text_of(block: ContentBlock, param: str) -> str:
    if block.text is None:
        raise InvalidRequest(f"'{param}.text' is required in a text block", param=f"{param}.text")
    return block.text


def _refuse_type(block: ContentBlock, param: str, role: str) -> InvalidRequest:
    return InvalidRequest(
        f"'{param}.type': blocks of type {block.type!r} are not supported in a {role} message "
        "by this server",
        param=f"{param}.type",
    )


def _assistant(content: str | list[ContentBlock], i: int) -> tuple[JSON, dict[str, str]]:
    """An assistant message for the template, and its tool_use ids (id -> name)."""
    texts: list[str] = []
    calls: list[JSON] = []
    ids: dict[str, str] = {}
    for j, block in enumerate(_blocks(content)):
        param = f"messages[{i}].content[{j}]"
        if block.type == "text":
            texts.append(_text_of(block, param))
        elif block.type == "tool_use":
            if block.id is None or block.name is None or block.input is None:
                raise InvalidRequest(
                    f"'{param}': a tool_use block needs 'id', 'name' and 'input' (an object)",
                    param=param,
                )
            if block.id in ids:
                raise InvalidRequest(
                    f"'{param}.id': tool_use ids must be unique ({block.id!r} is repeated)",
                    param=f"{param}.id",
                )
            ids[block.id] = block.name
            function = {"name": block.name, "arguments": block.input}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif block.type not in _DROPPED:
            raise _refuse_type(block, param, "assistant")
    message: JSON = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message, ids


def _user(
    content: str | list[ContentBlock], i: int, open_calls: dict[str, str], answered: set[str]
) -> list[JSON]:
    """A user message as tool messages (its tool_results, first) and the user's text."""
    out: list[JSON] = []
    texts: list[str] = []
    for j, block in enumerate(_blocks(content)):
        param = f"messages[{i}].content[{j}]"
        if block.type == "text":
            texts.append(_text_of(block, param))
        elif block.type == "tool_result":
            if texts:
                raise InvalidRequest(
                    f"'{param}': tool_result blocks must come first in a user message's content",
                    param=param,
                )
            out.append(_tool_message(block, param, open_calls, answered))
        else:
            raise _refuse_type(block, param, "user")
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _tool_message(
    block: ContentBlock, param: str, open_calls: dict[str, str], answered: set[str]
) -> JSON:
    call_id = block.tool_use_id
    if call_id is None:
        raise InvalidRequest(
            f"'{param}.tool_use_id' is required in a tool_result block",
            param=f"{param}.tool_use_id",
        )
    if call_id not in open_calls or call_id in answered:
        raise InvalidRequest(
            f"'{param}.tool_use_id': unexpected tool_use_id {call_id!r}: a tool_result must "
            "answer a tool_use block of the previous message",
            param=f"{param}.tool_use_id",
        )
    answered.add(call_id)
    text = _result_text(block.content, param)
    if block.is_error:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "name": open_calls[call_id], "content": text}


def _result_text(content: str | list[ContentBlock] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for k, block in enumerate(content):
        inner = f"{param}.content[{k}]"
        if block.type != "text":
            raise _refuse_type(block, inner, "tool_result")
        texts.append(_text_of(block, inner))
    return "".join(texts)


def _tools(req: CountTokensBody) -> ToolRequest | None:
    tools = req.tools or []
    specs = []
    for i, tool in enumerate(tools):
        if tool.type not in (None, "custom"):
            raise InvalidRequest(
                f"'tools[{i}].type': {tool.type!r} is one of Anthropic's server tools, which "
                "this server does not run",
                param=f"tools[{i}].type",
            )
        if tool.input_schema is None:
            raise InvalidRequest(
                f"Missing required field 'tools[{i}].input_schema'",
                param=f"tools[{i}].input_schema",
            )
        function: JSON = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        specs.append(
            ToolSpec(tool.name, tool.input_schema, {"type": "function", "function": function})
        )
    choice = req.tool_choice
    mode = _choice(choice)
    if not specs and mode in ("auto", "none"):
        return None  # Claude Code sends "tools": [] (Anthropic takes auto with no tools)
    return build_tool_request(
        specs,
        mode,
        parallel=not (choice is not None and choice.disable_parallel_tool_use),
        name_param="tools[{i}].name",
        choice_param="tool_choice.name",
    )


def _choice(choice: ToolChoiceBody | None) -> Mode | str | None:
    if choice is None:
        return None
    if choice.type == "tool":
        if choice.name is None:
            raise InvalidRequest(
                "'tool_choice.name' is required when 'tool_choice.type' is \"tool\"",
                param="tool_choice.name",
            )
        return choice.name
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]
