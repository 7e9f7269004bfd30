"""OpenAI request bodies in, validated requests out. Sans-IO: no quart, no trio.

Rules:

* A body is decoded by msgspec straight into a typed Struct; a wrong type or
  a value out of range raises :class:`InvalidRequest` whose ``param`` is the
  JSON path of the field (``max_tokens``, ``messages[2].content``).
* Unknown fields are ignored (clients send many). Known fields that tserve
  cannot honour are refused with a 400 naming the field rather than ignored
  silently: ``best_of > 1``, ``suffix``, ``echo`` with ``logprobs``,
  ``min_tokens > 0``, ``functions``/``function_call`` (the deprecated form
  of tools), ``audio``, non-text ``modalities``, ``prediction``, and
  message content parts other than text.
* Structured outputs and ``logit_bias`` are :mod:`tserve.web._structured`'s
  rules; ``tools``, ``tool_choice`` and ``parallel_tool_calls`` are
  :mod:`tserve.web._tools`'s.
* Chat history: an assistant message's ``tool_calls`` reach the template
  with each ``arguments`` decoded (a JSON object, else a 400 naming it); a
  ``tool`` message needs its ``tool_call_id``.
* vLLM-style extras are accepted: ``top_k``, ``ignore_eos``,
  ``stop_token_ids``, ``structured_outputs``, the ``guided_*`` fields, and
  ``chat_template_kwargs`` (more variables of the chat template, such as
  ``enable_thinking``; one that would replace ``messages``, ``tools``,
  ``documents`` or ``add_generation_prompt`` is a 400 naming it).
* ``temperature``, ``top_p`` and ``top_k`` left out stay unset: the engine
  gives them the model's recommended values (``EngineReady.sampling_defaults``),
  else OpenAI's.
* Bounds (:mod:`tserve.web._bodies` holds them): ``n`` times the number of
  prompts is at most ``MAX_CHOICES``, at most ``MAX_STOP`` stop strings of at
  most ``MAX_STOP_LENGTH`` characters, at most ``MAX_MESSAGES`` chat messages,
  ``logprobs``/``top_logprobs`` at most ``MAX_LOGPROBS``, at most
  ``MAX_EMBEDDING_INPUTS`` inputs per ``/v1/embeddings`` request (OpenAI's
  limit), none of them empty.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Literal, TypeVar

import msgspec

from tserve.nursery import InvalidRequest, parse_keep_alive
from tserve.sampling import SamplingParams
from tserve.web._bodies import (
    MAX_CHOICES,
    MAX_EMBEDDING_INPUTS,
    MAX_STOP,
    MAX_STOP_TOKEN_IDS,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    EmbeddingBody,
    MessageBody,
    SamplingBody,
    TokenizeBody,
    ToolCallBody,
)
from tserve.web._structured import Constrained, constraint_of, logit_bias_of
from tserve.web._tools import ToolRequest, tool_request

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "EmbeddingRequest",
    "TokenizeRequest",
    "decode_body",
    "parse_chat",
    "parse_completion",
    "parse_detokenize",
    "parse_embeddings",
    "parse_tokenize",
]

# -- validated requests -------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A validated ``/v1/completions`` body.

    ``prompts`` holds one entry per prompt: text, or token ids. Choice
    ``i * n + j`` is sample ``j`` of prompt ``i``.
    """

    model: str | None
    prompts: list[str] | list[list[int]]
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None  # top alternatives per token; None = off
    constraint_field: str | None = None  # the field params.constraint came from
    keep_alive: float | None = None  # seconds (negative: pinned); None: the default


@dataclasses.dataclass(frozen=True, slots=True)
class ChatRequest:
    """A validated ``/v1/chat/completions`` body.

    ``max_tokens`` None means "what is left of the context": the caller sets
    it in ``params`` once the prompt length is known; ``max_tokens_fits``
    cuts a larger ``max_tokens`` to that too (Anthropic's ``max_tokens`` is
    a ceiling, and clients ask for more than any context holds).
    """

    model: str | None
    messages: list[dict[str, Any]]
    params: SamplingParams
    max_tokens: int | None
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None
    constraint_field: str | None = None  # the field params.constraint came from
    tools: ToolRequest | None = None  # None: no tool may be called
    max_tokens_fits: bool = False
    template_kwargs: dict[str, Any] | None = None  # more variables of the chat template
    keep_alive: float | None = None  # seconds (negative: pinned); None: the default


@dataclasses.dataclass(frozen=True, slots=True)
class TokenizeRequest:
    model: str | None
    prompt: str | None
    messages: list[dict[str, Any]] | None


@dataclasses.dataclass(frozen=True, slots=True)
class DetokenizeRequest:
    model: str | None
    tokens: list[int]


@dataclasses.dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    """A validated ``/v1/embeddings`` body: texts, or token ids, one entry per input."""

    model: str | None
    inputs: list[str] | list[list[int]]
    encoding_format: Literal["float", "base64"]
    dimensions: int | None
    keep_alive: float | None = None  # seconds (negative: pinned); None: the default


# -- parsing -----------------------------------------------------------------------

_T = TypeVar("_T")
_AT = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`")


def decode_body(body: bytes, kind: type[_T]) -> _T:
    """Decode JSON ``body`` into ``kind``; raise InvalidRequest naming the field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        message = str(exc)
        at = _AT.search(message)
        path = at.group("path") if at else ""
        missing = _MISSING.match(message)
        if missing:
            path = f"{path}.{missing.group('field')}" if path else missing.group("field")
        detail = _AT.sub("", message)
        if missing:
            raise InvalidRequest(f"Missing required field '{path}'", param=path) from None
        if path:
            raise InvalidRequest(f"Invalid value for '{path}': {detail}", param=path) from None
        raise InvalidRequest(f"Invalid request body: {detail}") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"The body is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec's depth guard; the stack is unwound already
        raise InvalidRequest("The body is nested too deeply to decode") from None


def keep_alive_of(value: float | str | None) -> float | None:
    """A body's ``keep_alive`` in seconds (``tserve.nursery.parse_keep_alive``: a
    number, or a duration such as "5m"; any negative value is -1, pinned); None when
    absent. InvalidRequest naming the field for anything else."""
    if value is None:
        return None
    try:
        return parse_keep_alive(value)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="keep_alive") from None


def _refuse(param: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"'{param}' is not supported by this server: {why}", param=param)


def _check_common(body: SamplingBody) -> None:
    if body.best_of is not None and body.best_of > 1:
        raise _refuse("best_of", "only best_of=1 is implemented")
    if body.min_tokens:
        raise _refuse("min_tokens", "min_tokens is not implemented")
    if isinstance(body.stop, list) and len(body.stop) > MAX_STOP:
        raise InvalidRequest(f"'stop' holds at most {MAX_STOP} strings", param="stop")
    if body.stop_token_ids is not None and len(body.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            f"'stop_token_ids' holds at most {MAX_STOP_TOKEN_IDS} ids", param="stop_token_ids"
        )


def _params(
    body: SamplingBody, max_tokens: int, logprobs: int | None, constrained: Constrained | None
) -> SamplingParams:
    stop = body.stop
    return SamplingParams(
        max_tokens=max_tokens,
        # Unset: the engine's defaults (the model's recommendation, else OpenAI's).
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=None if body.top_k is None else max(body.top_k, 0),
        seed=body.seed,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=bool(body.ignore_eos),
        logprobs=logprobs,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        logit_bias=logit_bias_of(body),
        constraint=None if constrained is None else constrained.constraint,
    )


def _include_usage(body: SamplingBody) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


def _prompts(
    prompt: str | list[str | int | list[int]], field: str = "prompt"
) -> list[str] | list[list[int]]:
    """One of: a string, strings, token ids, lists of token ids; nothing mixed."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequest(f"'{field}' must not be an empty list", param=field)
    if all(isinstance(p, int) for p in prompt):
        return [[p for p in prompt if isinstance(p, int)]]
    if all(isinstance(p, str) for p in prompt):
        return [p for p in prompt if isinstance(p, str)]
    if all(isinstance(p, list) for p in prompt):
        lists = [p for p in prompt if isinstance(p, list)]
        for i, ids in enumerate(lists):
            if not ids:
                raise InvalidRequest(f"'{field}[{i}]' is an empty list", param=f"{field}[{i}]")
        return lists
    raise InvalidRequest(
        f"'{field}' must be a string, a list of strings, a list of token ids, or a list of "
        "lists of token ids (not a mix)",
        param=field,
    )


def parse_completion(body: bytes) -> CompletionRequest:
    """Validate a ``/v1/completions`` body. Raises InvalidRequest."""
    req = decode_body(body, CompletionBody)
    _check_common(req)
    if req.suffix:
        raise _refuse("suffix", "insertion (suffix) is not implemented")
    if req.echo and req.logprobs is not None:
        raise _refuse("echo", "echo with logprobs needs prompt logprobs, not implemented")
    prompts = _prompts(req.prompt)
    n = req.n or 1
    if n * len(prompts) > MAX_CHOICES:
        raise InvalidRequest(
            f"n ({n}) times the number of prompts ({len(prompts)}) exceeds {MAX_CHOICES}",
            param="n",
        )
    constrained = constraint_of(req)
    return CompletionRequest(
        model=req.model,
        prompts=prompts,
        params=_params(req, req.max_tokens or 16, req.logprobs, constrained),
        n=n,
        stream=bool(req.stream),
        include_usage=_include_usage(req),
        echo=bool(req.echo),
        logprobs=req.logprobs,
        constraint_field=None if constrained is None else constrained.field,
        keep_alive=keep_alive_of(req.keep_alive),
    )


def _messages(messages: list[MessageBody]) -> list[dict[str, Any]]:
    """Plain dicts for the chat template; content parts joined into one string."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    param = f"messages[{i}].content[{j}]"
                    raise _refuse(f"{param}.type", f"content parts of type {part.type!r}")
            content = "".join(part.text or "" for part in content)
        message: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        elif m.role == "tool":
            raise InvalidRequest(
                f"'messages[{i}]' of role tool needs 'tool_call_id'",
                param=f"messages[{i}].tool_call_id",
            )
        if m.tool_calls is not None:
            if m.role != "assistant":
                raise InvalidRequest(
                    f"'messages[{i}].tool_calls': only assistant messages make tool calls",
                    param=f"messages[{i}].tool_calls",
                )
            message["tool_calls"] = _history_calls(m.tool_calls, i)
        out.append(message)
    return out


def _history_calls(calls: list[ToolCallBody], i: int) -> list[dict[str, Any]]:
    """An assistant message's calls for the template, each ``arguments`` decoded."""
    out = []
    for j, call in enumerate(calls):
        field = f"messages[{i}].tool_calls[{j}].function.arguments"
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise InvalidRequest(f"'{field}' must be a JSON object, as text", param=field)
        function = {"name": call.function.name, "arguments": arguments}
        out.append({"id": call.id, "type": "function", "function": function})
    return out


_TEMPLATE_OWN = ("messages", "tools", "documents", "add_generation_prompt")


def _template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """``chat_template_kwargs``, none of them a variable the server sets itself."""
    for key in _TEMPLATE_OWN:
        if kwargs is not None and key in kwargs:
            param = f"chat_template_kwargs.{key}"
            raise InvalidRequest(
                f"'{param}' is set by the server; it cannot be a template kwarg", param=param
            )
    return kwargs


def _check_chat_only(req: ChatBody) -> None:
    if req.functions:
        raise _refuse("functions", "use 'tools' (functions is OpenAI's deprecated form)")
    if req.function_call not in (None, "none"):
        raise _refuse("function_call", "use 'tool_choice' (OpenAI's deprecated form)")
    if req.audio is not None:
        raise _refuse("audio", "audio output is not implemented")
    if req.modalities is not None and req.modalities != ["text"]:
        raise _refuse("modalities", "only text output is implemented")
    if req.prediction is not None:
        raise _refuse("prediction", "predicted outputs are not implemented")
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("'top_logprobs' requires 'logprobs': true", param="top_logprobs")


def parse_chat(body: bytes) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` body. Raises InvalidRequest."""
    req = decode_body(body, ChatBody)
    _check_common(req)
    _check_chat_only(req)
    messages = _messages(req.messages)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens or req.max_tokens
    constrained = constraint_of(req)
    return ChatRequest(
        model=req.model,
        messages=messages,
        params=_params(req, max_tokens or 1, logprobs, constrained),
        max_tokens=max_tokens,
        n=req.n or 1,
        stream=bool(req.stream),
        include_usage=_include_usage(req),
        logprobs=logprobs,
        constraint_field=None if constrained is None else constrained.field,
        tools=tool_request(req),
        template_kwargs=_template_kwargs(req.chat_template_kwargs),
        keep_alive=keep_alive_of(req.keep_alive),
    )


def parse_tokenize(body: bytes) -> TokenizeRequest:
    """Validate a ``/tokenize`` body: exactly one of ``prompt`` and ``messages``."""
    req = decode_body(body, TokenizeBody)
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequest("give exactly one of 'prompt' and 'messages'", param="prompt")
    messages = None if req.messages is None else _messages(req.messages)
    return TokenizeRequest(req.model, req.prompt, messages)


def parse_detokenize(body: bytes) -> DetokenizeRequest:
    """Validate a ``/detokenize`` body."""
    req = decode_body(body, DetokenizeBody)
    return DetokenizeRequest(req.model, list(req.tokens))


def parse_embeddings(body: bytes) -> EmbeddingRequest:
    """Validate a ``/v1/embeddings`` body. Raises InvalidRequest.

    Lengths in tokens are checked later, against the embedding model.
    """
    req = decode_body(body, EmbeddingBody)
    inputs = _prompts(req.input, "input")
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise InvalidRequest(
            f"'input' holds {len(inputs)} inputs; at most {MAX_EMBEDDING_INPUTS} per request",
            param="input",
        )
    for i, item in enumerate(inputs):
        if isinstance(item, str) and not item:
            where = "input" if isinstance(req.input, str) else f"input[{i}]"
            raise InvalidRequest(f"'{where}' is an empty string", param=where)
    return EmbeddingRequest(
        req.model,
        inputs,
        req.encoding_format or "float",
        req.dimensions,
        keep_alive=keep_alive_of(req.keep_alive),
    )
