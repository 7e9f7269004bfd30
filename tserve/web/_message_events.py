"""Anthropic Messages responses and their SSE events from :class:`tserve.Delta`. Sans-IO.

:class:`MessageChoice` turns the output into content blocks: text, and
``tool_use`` blocks parsed by the chat machinery's tool-call stream
(:meth:`ToolPlan.stream`, the same parser chat completions use). Text
after a call opens a new text block; an empty text is no block. With a
reasoning syntax, the model's thinking is split off first (the tool-call
parser sees only the answer): shown, it is a ``thinking`` block
(``{"type": "thinking", "thinking", "signature": ""}``, streamed as
``thinking_delta``) before the answer's blocks; not shown, it is dropped. A
``tool_use`` block's ``input`` is its arguments object (``{}`` when the
output ended inside it, which only ``max_tokens`` can do).

``stop_reason``: "max_tokens" for a length finish; for a stop, "stop_sequence"
(with ``stop_sequence``, the string) when a stop string ended it, "tool_use"
when it called a tool, else "end_turn".

The stream (:class:`MessageEvents`), each event ``event: NAME`` and ``data: {json}``::

    message_start  ping  ( content_block_start  content_block_delta*  content_block_stop )*
    message_delta  message_stop

``content_block_delta`` carries ``thinking_delta``, ``text_delta`` or ``input_json_delta``;
``message_delta`` the stop reason and the output tokens. A failure after the
headers (engine death, shutdown, the engine aborting the request) ends the
stream with one ``error`` event in Anthropic's shape instead of the rest,
whatever was sent before: a stream never ends silently. Anything out of this
order raises :class:`SSEOrderError` (a bug in the caller).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from tserve.nursery import Delta, RequestStream, Usage
from tserve.web._errors import anthropic_error_reply
from tserve.web._output_parser import OutputParser
from tserve.web._reasoning import ReasoningSyntax
from tserve.web._sse import NamedPhase, SSEOrderError, closing_error, named_event
from tserve.web._tool_stream import Arguments, CallStarted, Content, Event
from tserve.web._tools import ToolPlan

__all__ = ["MessageChoice", "MessageEvents", "MessageOutput", "new_message_id"]

JSON = dict[str, Any]


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def _new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _stop_reason(delta: Delta, calls: int) -> str | None:
    if delta.finish_reason == "length":
        return "max_tokens"
    if delta.stop_string is not None:
        return "stop_sequence"
    return "tool_use" if calls else "end_turn"


class MessageChoice:
    """The content blocks of one output. ``push`` returns that delta's block events
    (``content_block_start``/``_delta``/``_stop`` payloads) in order."""

    def __init__(
        self,
        plan: ToolPlan | None,
        reasoning: ReasoningSyntax | None = None,
        *,
        show_thinking: bool = False,
    ) -> None:
        self._parser = OutputParser(plan, _new_tool_use_id, reasoning)
        self._show_thinking = show_thinking
        self.blocks: list[JSON] = []  # text blocks hold "text"; tool_use blocks "input" text
        self._open: str | None = None  # the type of the last block while it is open
        self._tool_uses = 0
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage: Usage | None = None

    def push(self, delta: Delta) -> list[JSON]:
        """Take one delta; return its block events."""
        reasoning, events = self._parser.push(delta)
        out = self._thinking_events(reasoning) if self._show_thinking else []
        out += [payload for event in events for payload in self._block_events(event)]
        if delta.finish_reason is not None:
            out += self._close()
            self.stop_reason = _stop_reason(delta, self._tool_uses)
            self.stop_sequence = delta.stop_string
            self.usage = delta.usage
        return out

    def content(self) -> list[JSON]:
        """The blocks of the whole message, each ``tool_use`` input decoded."""
        return [_final_block(block) for block in self.blocks]

    def _thinking_events(self, text: str) -> list[JSON]:
        if not text:
            return []
        out = []
        if self._open != "thinking":
            out = self._close() + self._start({"type": "thinking", "thinking": "", "signature": ""})
        self.blocks[-1]["thinking"] += text
        return [*out, _delta(len(self.blocks) - 1, {"type": "thinking_delta", "thinking": text})]

    def _block_events(self, event: Event) -> list[JSON]:
        index = len(self.blocks) - 1
        if isinstance(event, Content):
            if not event.text:
                return []
            out = []
            if self._open != "text":
                out = self._close() + self._start({"type": "text", "text": ""})
                index += 1
            self.blocks[index]["text"] += event.text
            return [*out, _delta(index, {"type": "text_delta", "text": event.text})]
        if isinstance(event, CallStarted):
            self._tool_uses += 1
            block = {"type": "tool_use", "id": event.id, "name": event.name, "input": ""}
            return self._close() + self._start(block)
        assert isinstance(event, Arguments) and self._open == "tool_use"
        self.blocks[index]["input"] += event.text
        return [_delta(index, {"type": "input_json_delta", "partial_json": event.text})]

    def _start(self, block: JSON) -> list[JSON]:
        self.blocks.append(block)
        self._open = block["type"]
        shown = {**block, "input": {}} if block["type"] == "tool_use" else block
        start = {"type": "content_block_start", "index": len(self.blocks) - 1}
        return [{**start, "content_block": dict(shown)}]

    def _close(self) -> list[JSON]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]


def _delta(index: int, delta: JSON) -> JSON:
    return {"type": "content_block_delta", "index": index, "delta": delta}


def _final_block(block: JSON) -> JSON:
    if block["type"] != "tool_use":
        return dict(block)
    try:
        arguments = json.loads(block["input"] or "{}")
    except ValueError:
        arguments = None
    return {**block, "input": arguments if isinstance(arguments, dict) else {}}


def _usage(input_tokens: int, output_tokens: int) -> JSON:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens}


class MessageOutput:
    """The Messages API's output of one run (one stream): see the module docstring."""

    def __init__(
        self,
        model: str,
        plan: ToolPlan | None,
        reasoning: ReasoningSyntax | None = None,
        *,
        show_thinking: bool = False,
    ) -> None:
        self.model = model
        self.id = new_message_id()
        self.choice = MessageChoice(plan, reasoning, show_thinking=show_thinking)

    @property
    def choices(self) -> Sequence[MessageChoice]:
        return [self.choice]

    def message(self, content: list[JSON], usage: JSON) -> JSON:
        """A message object; ``content`` and the stop fields as they are now."""
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": self.choice.stop_reason,
            "stop_sequence": self.choice.stop_sequence,
            "usage": usage,
        }

    def response(self) -> JSON:
        usage = self.choice.usage or Usage(0, 0)
        return self.message(
            self.choice.content(), _usage(usage.prompt_tokens, usage.completion_tokens)
        )

    def events(self, streams: Sequence[RequestStream], request_id: str) -> MessageEvents:
        return MessageEvents(self, len(streams[0].prompt_token_ids), request_id)


class MessageEvents:
    """The events of one streamed message, as bytes, in their legal order (module
    docstring). Synchronous; an illegal call raises SSEOrderError and changes nothing."""

    def __init__(self, output: MessageOutput, input_tokens: int, request_id: str) -> None:
        self._output = output
        self._input_tokens = input_tokens
        self._request_id = request_id
        self._phase = NamedPhase.START
        self.status = 200  # 200, or the status of the error event once one went out

    @property
    def unfinished(self) -> int:
        return 0 if self._output.choice.stop_reason is not None else 1

    def chunk(self, index: int, delta: Delta) -> bytes:
        """The next delta's events (``message_start`` and ``ping`` before the first)."""
        if self._phase is NamedPhase.DONE or index != 0:
            raise SSEOrderError(f"a delta for choice {index} in phase {self._phase.value}")
        out = []
        if self._phase is NamedPhase.START:
            start = self._output.message([], _usage(self._input_tokens, 0))
            out += [
                named_event("message_start", {"type": "message_start", "message": start}),
                named_event("ping", {"type": "ping"}),
            ]
            self._phase = NamedPhase.STREAMING
        choice = self._output.choice
        out += [named_event(e["type"], e) for e in choice.push(delta)]
        if delta.finish_reason is not None:
            usage = choice.usage or Usage(self._input_tokens, 0)
            stop = {"stop_reason": choice.stop_reason, "stop_sequence": choice.stop_sequence}
            out += [
                named_event(
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": stop,
                        "usage": {"output_tokens": usage.completion_tokens},
                    },
                ),
                named_event("message_stop", {"type": "message_stop"}),
            ]
            self._phase = NamedPhase.DONE
        return b"".join(out)

    def close(self, error: Exception | None = None) -> list[bytes]:
        """The events that end the stream now: nothing after ``message_stop``; else
        the error event (``error``, or ShuttingDown for a stream cut short)."""
        error = closing_error(error, unfinished=self.unfinished, phase=self._phase)
        if error is None:
            return []
        reply = anthropic_error_reply(error, self._request_id)
        self.status = reply.status
        self._phase = NamedPhase.DONE
        return [named_event("error", reply.body)]
