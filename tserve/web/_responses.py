"""OpenAI response bodies and stream chunks from :class:`tserve.Delta`. Sans-IO.

A *choice* accumulates the deltas of one generated sequence. ``push(delta)``
returns that delta as the choice object of a stream chunk; ``final()``
returns the choice object of the whole (non-streaming) response. A choice
made with ``keep=False`` (a streamed one) keeps no text and no logprobs:
nothing asks for them after their chunk, and ``n=128`` choices with
``top_logprobs=20`` would otherwise hold every alternative of every token
until the stream ends. Only its finish reason and usage stay. An
:class:`Envelope` wraps choice objects with the id, model and usage.

Shapes follow OpenAI's API reference:

* completions logprobs: ``{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}``, one entry per token; ``top_logprobs`` maps token text to
  logprob.
* chat logprobs: ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}]}], "refusal": None}``.
* tool calls (a chat choice given a :class:`ToolPlan`): the message's
  ``tool_calls`` are ``[{"id": "call_...", "type": "function", "function":
  {"name", "arguments"}}]`` (``arguments`` JSON text of an object), its
  ``content`` None when only tools were called, and a ``"stop"`` finish
  becomes ``"tool_calls"``. Streamed, each chunk's delta carries
  ``tool_calls: [{"index", "id", "type", "function": {"name", "arguments"}}]``
  with ``id``, ``type`` and ``name`` only in a call's first entry, then
  ``{"index", "function": {"arguments": fragment}}``; ``content`` is None in
  a chunk without text once tools are in play.

Reasoning (a chat choice given a :class:`ReasoningSyntax`), as vLLM writes
it: the thinking goes to the message's ``reasoning_content`` (None when the
model did not think) and ``content`` holds only the answer, which is all the
tool-call parser sees. Streamed, a chunk's delta has ``reasoning_content``
when it carries thinking, and ``content`` None when it carries no answer.
Usage is unchanged: the thinking counts as completion tokens.

A token's text is the tokenizer's decoding of that one token; a token that
is only part of a UTF-8 character decodes to U+FFFD. Logprobs of -inf (and
NaN) are reported as -9999.0, as OpenAI does.

Embeddings: ``encoding_format="base64"`` is the base64 of the vector's
little-endian float32 bytes, as OpenAI sends it (the SDK decodes it so).
"""

from __future__ import annotations

import base64
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Final

from tserve.nursery import Delta, EmbeddingResult, Usage
from tserve.protocol import TokenLogprob
from tserve.web._reasoning import ReasoningSyntax, Split
from tserve.web._tool_formats import parse_output
from tserve.web._tool_stream import Arguments, CallStarted, Content, Event
from tserve.web._tools import ToolPlan, new_call_id

__all__ = [
    "CHAT",
    "COMPLETION",
    "ChatChoice",
    "CompletionChoice",
    "Envelope",
    "ObjectNames",
    "TokenText",
    "embedding_response",
    "total_usage",
    "usage_dict",
]

TokenText = Callable[[int], str]
"""The text of one token id (see the module docstring)."""

JSON = dict[str, Any]

_MIN_LOGPROB = -9999.0


def _lp(value: float) -> float:
    return value if math.isfinite(value) else _MIN_LOGPROB


def usage_dict(usage: Usage) -> JSON:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


class _Choice:
    """What both kinds of choice keep: the text so far, and how it finished."""

    def __init__(
        self, index: int, token_text: TokenText, *, logprobs: bool, keep: bool = True
    ) -> None:
        self.index = index
        self.finish_reason: str | None = None
        self.usage: Usage | None = None  # set by the last delta
        self._token_text = token_text
        self._logprobs = logprobs
        # Invariant: with keep False, _parts (and the subclasses' logprobs) stay empty.
        self._keep = keep
        self._parts: list[str] = []

    def _object(self, key: str, value: Any, logprobs: JSON | None, finish: str | None) -> JSON:
        """A choice object: ``key`` is "text", "delta" or "message"."""
        return {"index": self.index, key: value, "logprobs": logprobs, "finish_reason": finish}

    def _record(self, delta: Delta, text: str | None = None) -> None:
        """Keep ``text`` (default ``delta``'s, if this choice keeps), and its finish if
        it is the last."""
        if self._keep:
            self._parts.append(delta.text if text is None else text)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.usage = delta.usage


class CompletionChoice(_Choice):
    """One choice of ``/v1/completions``. ``prefix`` is the echoed prompt, if any."""

    def __init__(
        self,
        index: int,
        token_text: TokenText,
        *,
        logprobs: bool,
        prefix: str = "",
        keep: bool = True,
    ) -> None:
        super().__init__(index, token_text, logprobs=logprobs, keep=keep)
        if prefix and keep:
            self._parts.append(prefix)
        self._pending_prefix = prefix  # sent with the first chunk
        # Invariant: _offset == total length of the text emitted so far.
        self._offset = len(prefix)
        self._lp: JSON = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def push(self, delta: Delta) -> JSON:
        """Take one delta; return it as a stream chunk's choice object."""
        text = self._pending_prefix + delta.text
        self._pending_prefix = ""
        lp = self._take_logprobs(delta) if self._logprobs else None
        self._record(delta)
        self._offset += len(delta.text)
        return self._object("text", text, lp, delta.finish_reason)

    def final(self) -> JSON:
        """The choice object of the whole response (a choice that keeps only)."""
        assert self._keep, "final() of a streamed choice"
        lp = self._lp if self._logprobs else None
        return self._object("text", "".join(self._parts), lp, self.finish_reason)

    def _take_logprobs(self, delta: Delta) -> JSON:
        out: JSON = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = self._offset
        for entry in delta.logprobs or ():
            token = self._token_text(entry.token_id)
            out["tokens"].append(token)
            out["token_logprobs"].append(_lp(entry.logprob))
            out["top_logprobs"].append({self._token_text(t): _lp(v) for t, v in entry.top})
            out["text_offset"].append(offset)
            offset += len(token)
        if self._keep:
            for key, values in out.items():
                self._lp[key].extend(values)
        return out


class ChatChoice(_Choice):
    """One choice of ``/v1/chat/completions``; with ``tools``, tool calls are
    parsed out of its text (see the module docstring)."""

    def __init__(
        self,
        index: int,
        token_text: TokenText,
        *,
        logprobs: bool,
        keep: bool = True,
        tools: ToolPlan | None = None,
        reasoning: ReasoningSyntax | None = None,
    ) -> None:
        super().__init__(index, token_text, logprobs=logprobs, keep=keep)
        self._content: list[JSON] = []
        self._first = True
        self._tools = tools
        self._calls = None if tools is None or keep else tools.stream()
        self._thinking = None if reasoning is None else reasoning.parser()
        # Invariant: with keep False, _reasoning stays empty (as _parts does).
        self._reasoning: list[str] = []

    def push(self, delta: Delta) -> JSON:
        """Take one delta; return it as a stream chunk's choice object."""
        split = self._split(delta)
        message: JSON = {"content": split.content}
        if self._thinking is not None:
            message = {"content": split.content or None}
            if split.reasoning:
                message["reasoning_content"] = split.reasoning
        finish = delta.finish_reason
        if self._calls is not None:
            events = self._calls.push(split.content)
            if finish is not None:
                events += self._calls.finish()
                finish = _tool_finish(finish, self._calls.calls)
            message = {**message, **_tool_delta(events)}
        if self._first:
            message = {"role": "assistant", **message}
            self._first = False
        lp = None
        if self._logprobs:
            entries = [self._entry(e) for e in delta.logprobs or ()]
            if self._keep:
                self._content.extend(entries)
            lp = {"content": entries, "refusal": None}
        self._record(delta, split.content)
        if finish is not None:
            self.finish_reason = finish
        return self._object("delta", message, lp, finish)

    def _split(self, delta: Delta) -> Split:
        """``delta``'s text as thinking and answer (all answer without a syntax)."""
        if self._thinking is None:
            return Split(content=delta.text)
        split = self._thinking.push(delta.text, final=delta.finish_reason is not None)
        if self._keep:
            self._reasoning.append(split.reasoning)
        return split

    def final(self) -> JSON:
        """The choice object of the whole response (a choice that keeps only)."""
        assert self._keep, "final() of a streamed choice"
        text = "".join(self._parts)
        message: JSON = {"role": "assistant", "content": text, "refusal": None}
        if self._thinking is not None:
            message["reasoning_content"] = "".join(self._reasoning) or None
        finish = self.finish_reason
        if self._tools is not None:
            parsed = parse_output(text, self._tools.format, self._tools.names)
            if parsed.calls:
                message["content"] = parsed.content
                message["tool_calls"] = [
                    _call(new_call_id(), c.name, c.arguments) for c in parsed.calls
                ]
                finish = _tool_finish(finish, len(parsed.calls))
        lp = {"content": self._content, "refusal": None} if self._logprobs else None
        return self._object("message", message, lp, finish)

    def _entry(self, entry: TokenLogprob) -> JSON:
        token = self._token_text(entry.token_id)
        return {
            "token": token,
            "logprob": _lp(entry.logprob),
            "bytes": list(token.encode()),
            "top_logprobs": [self._top(t, v) for t, v in entry.top],
        }

    def _top(self, token_id: int, logprob: float) -> JSON:
        token = self._token_text(token_id)
        return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode())}


def _call(call_id: str, name: str, arguments: str) -> JSON:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_finish(finish: str | None, calls: int) -> str | None:
    """A choice that stopped after calling tools finished with "tool_calls"."""
    return "tool_calls" if finish == "stop" and calls else finish


def _tool_delta(events: list[Event]) -> JSON:
    """A chunk's delta from a tool stream's events: the text, and one entry per call touched."""
    text = "".join(e.text for e in events if isinstance(e, Content))
    entries: dict[int, JSON] = {}
    for event in events:
        if isinstance(event, CallStarted):
            entries[event.index] = {"index": event.index, **_call(event.id, event.name, "")}
        elif isinstance(event, Arguments):
            entry = entries.setdefault(event.index, {"index": event.index, "function": {}})
            function = entry["function"]
            function["arguments"] = function.get("arguments", "") + event.text
    delta: JSON = {"content": text or None}
    if entries:
        delta["tool_calls"] = [entries[i] for i in sorted(entries)]
    return delta


def total_usage(choices: Sequence[CompletionChoice | ChatChoice], n: int) -> Usage:
    """Usage of a whole HTTP request: each prompt counted once (choice ``i * n``)."""
    done = [c.usage for c in choices if c.usage is not None]
    prompt = sum(c.usage.prompt_tokens for c in choices if c.usage and c.index % n == 0)
    return Usage(prompt, sum(u.completion_tokens for u in done))


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectNames:
    """The ``object`` of an endpoint's whole response and of its stream chunks."""

    response: str
    chunk: str


COMPLETION: Final = ObjectNames("text_completion", "text_completion")
CHAT: Final = ObjectNames("chat.completion", "chat.completion.chunk")


@dataclasses.dataclass(frozen=True, slots=True)
class Envelope:
    """What every response body and stream chunk of one request starts with, up to its choices."""

    rid: str
    created: int
    model: str
    names: ObjectNames

    def response(self, choices: Sequence[CompletionChoice | ChatChoice], usage: Usage) -> JSON:
        """The whole (non-streaming) response body."""
        body = self._wrap(self.names.response, [c.final() for c in choices])
        body["usage"] = usage_dict(usage)
        return body

    def chunk(self, choice: JSON, *, include_usage: bool) -> JSON:
        """A stream chunk carrying one choice object (``"usage": null`` when usage comes last)."""
        chunk = self._wrap(self.names.chunk, [choice])
        if include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, usage: Usage) -> JSON:
        """The last chunk of a stream with ``stream_options.include_usage``: no choices."""
        chunk = self._wrap(self.names.chunk, [])
        chunk["usage"] = usage_dict(usage)
        return chunk

    def _wrap(self, obj: str, choices: list[JSON]) -> JSON:
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }


def embedding_response(model: str, result: EmbeddingResult, encoding_format: str) -> JSON:
    """The body of a ``/v1/embeddings`` response (``encoding_format`` "float" or "base64")."""
    if encoding_format == "base64":
        vectors: list[Any] = [base64.b64encode(raw).decode("ascii") for raw in result.raw]
    else:
        vectors = result.vectors()
    data = [
        {"object": "embedding", "index": i, "embedding": vector} for i, vector in enumerate(vectors)
    ]
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}
