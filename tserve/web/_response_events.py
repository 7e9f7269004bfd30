"""Responses API response objects and their SSE events from :class:`tserve.Delta`. Sans-IO.

:class:`ResponseChoice` turns the output into output items: ``message``
items (one ``output_text`` part, ``annotations`` empty) and
``function_call`` items parsed by the chat machinery's tool-call stream
(:meth:`ToolPlan.stream`, the same parser chat completions use). Text after
a call opens a new message item; an empty text is no item. With a
reasoning syntax (``--reasoning-parser``) the model's thinking is split off
first (the tool-call parser sees only the answer) and is a ``reasoning``
item (``content`` one ``reasoning_text`` part, ``summary`` empty) before the
answer's items, streamed as ``response.reasoning_text.delta``/``.done``.

``status``: "completed" for a stop; "incomplete" with
``incomplete_details.reason`` "max_output_tokens" for a length finish (the
item open then is "incomplete" too); "failed" with ``error`` when the
request failed after it started; "queued", "in_progress" and "cancelled"
belong to background responses (:mod:`tserve.web._responses_api`).

The stream (:class:`ResponseEvents`), each event ``event: TYPE`` and
``data: {json}`` with a ``sequence_number`` that counts from 0::

    response.created  response.in_progress
    ( output_item.added  reasoning_text.delta*  reasoning_text.done  output_item.done
    | output_item.added  content_part.added  output_text.delta*  output_text.done
      content_part.done  output_item.done
    | output_item.added  function_call_arguments.delta*  function_call_arguments.done
      output_item.done )*
    response.completed | response.incomplete

A failure after the headers ends the stream with ``response.failed`` (a
server-side failure: engine death, shutdown, an abort) or ``error`` (a
refusal of the request itself, 4xx) instead of the rest: a stream never
ends silently. Anything out of this order raises :class:`SSEOrderError`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from tserve.nursery import Delta, RequestStream, Usage
from tserve.web._errors import error_reply
from tserve.web._output_parser import OutputParser
from tserve.web._reasoning import ReasoningSyntax
from tserve.web._response_requests import item_id
from tserve.web._sse import NamedPhase, SSEOrderError, closing_error, named_event
from tserve.web._tool_stream import Arguments, CallStarted, Content, Event
from tserve.web._tools import ToolPlan, new_call_id

__all__ = ["ResponseChoice", "ResponseEvents", "ResponseOutput", "new_response_id", "usage"]

JSON = dict[str, Any]


def new_response_id() -> str:
    """``resp_`` and 32 hex digits: the only ids the store takes."""
    return f"resp_{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> JSON:
    """The ``usage`` object of a response."""
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ResponseChoice:
    """The output items of one output. ``push`` returns that delta's item events
    (payloads without ``sequence_number``) in order."""

    def __init__(
        self,
        plan: ToolPlan | None,
        namespaces: dict[str, str] | None = None,
        reasoning: ReasoningSyntax | None = None,
    ) -> None:
        self._parser = OutputParser(plan, new_call_id, reasoning)
        self._namespaces = namespaces or {}  # function name -> the namespace tool it is in
        self.items: list[JSON] = []  # message items hold their text in content[0]["text"]
        self._open: str | None = None  # the type of the last item while it is open
        self.finish_reason: str | None = None
        self.usage: Usage | None = None

    def push(self, delta: Delta) -> list[JSON]:
        """Take one delta; return its item events."""
        reasoning, events = self._parser.push(delta)
        out = self._reasoning_events(reasoning)
        out += [payload for event in events for payload in self._item_events(event)]
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            out += self._close("incomplete" if delta.finish_reason == "length" else "completed")
            self.usage = delta.usage
        return out

    def _item_events(self, event: Event) -> list[JSON]:
        index = len(self.items) - 1
        if isinstance(event, Content):
            if not event.text:
                return []
            out = []
            if self._open != "message":
                out = self._close("completed") + self._start_message()
                index += 1
            item = self.items[index]
            item["content"][0]["text"] += event.text
            where = {"item_id": item["id"], "output_index": index}
            delta = {"type": "response.output_text.delta", **where, "content_index": 0}
            return [*out, {**delta, "delta": event.text, "logprobs": []}]
        if isinstance(event, CallStarted):
            item = {
                "id": item_id("fc"),
                "type": "function_call",
                "status": "in_progress",
                "call_id": event.id,
                "name": event.name,
                "arguments": "",
            }
            if event.name in self._namespaces:
                item["namespace"] = self._namespaces[event.name]
            return self._close("completed") + self._start(item)
        assert isinstance(event, Arguments) and self._open == "function_call"
        item = self.items[index]
        item["arguments"] += event.text
        return [
            {
                "type": "response.function_call_arguments.delta",
                "item_id": item["id"],
                "output_index": index,
                "delta": event.text,
            }
        ]

    def _reasoning_events(self, text: str) -> list[JSON]:
        if not text:
            return []
        out: list[JSON] = []
        if self._open != "reasoning":
            item: JSON = {
                "id": item_id("rs"),
                "type": "reasoning",
                "status": "in_progress",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}],
            }
            out = self._close("completed") + self._start(item)
        index = len(self.items) - 1
        item = self.items[index]
        item["content"][0]["text"] += text
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [*out, {"type": "response.reasoning_text.delta", **where, "delta": text}]

    def _start_message(self) -> list[JSON]:
        part = {"type": "output_text", "text": "", "annotations": []}
        item = {
            "id": item_id("msg"),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [part],
        }
        out = self._start(item)
        where = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        return [*out, {"type": "response.content_part.added", **where, "part": dict(part)}]

    def _start(self, item: JSON) -> list[JSON]:
        self.items.append(item)
        self._open = item["type"]
        shown = {**item, "content": []} if "content" in item else dict(item)
        index = len(self.items) - 1
        return [{"type": "response.output_item.added", "output_index": index, "item": shown}]

    def _close(self, status: str) -> list[JSON]:
        """The events that close the open item, which ends with ``status``."""
        if self._open is None:
            return []
        self._open = None
        index = len(self.items) - 1
        item = self.items[index]
        item["status"] = status
        where = {"item_id": item["id"], "output_index": index}
        out: list[JSON] = []
        if item["type"] == "reasoning":
            done_text = {"type": "response.reasoning_text.done", **where, "content_index": 0}
            out.append({**done_text, "text": item["content"][0]["text"]})
        elif item["type"] == "message":
            part = item["content"][0]
            text = {"type": "response.output_text.done", **where, "content_index": 0}
            done = {"type": "response.content_part.done", **where, "content_index": 0}
            out += [{**text, "text": part["text"], "logprobs": []}, {**done, "part": dict(part)}]
        else:
            args = {"type": "response.function_call_arguments.done", **where}
            out.append({**args, "name": item["name"], "arguments": item["arguments"]})
        done_item = {"type": "response.output_item.done", "output_index": index}
        return [*out, {**done_item, "item": _copy(item)}]


def _copy(item: JSON) -> JSON:
    if "content" in item:
        return {**item, "content": [dict(part) for part in item["content"]]}
    return dict(item)


class ResponseOutput:
    """The Responses API's output of one run (one stream). ``on_end`` takes the final
    response object (completed, incomplete or failed) once, synchronously: the store."""

    def __init__(
        self,
        model: str,
        plan: ToolPlan | None,
        *,
        response_id: str,
        echo: JSON,
        on_end: Callable[[JSON], None] | None = None,
        namespaces: dict[str, str] | None = None,
        reasoning: ReasoningSyntax | None = None,
    ) -> None:
        self.model = model
        self.id = response_id
        self.created_at = int(time.time())
        self.echo = echo
        self.choice = ResponseChoice(plan, namespaces, reasoning)
        self.on_end = on_end

    @property
    def choices(self) -> Sequence[ResponseChoice]:
        return [self.choice]

    def obj(self, status: str, *, usage_: JSON | None = None, error: JSON | None = None) -> JSON:
        """A response object with the output items as they are now."""
        incomplete = None
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": [_copy(item) for item in self.choice.items],
            "usage": usage_,
            **self.echo,
        }

    def final(self, input_tokens: int) -> JSON:
        """The whole response once the choice finished."""
        status = "incomplete" if self.choice.finish_reason == "length" else "completed"
        found = self.choice.usage or Usage(input_tokens, 0)
        counts = (found.prompt_tokens, found.completion_tokens, found.cached_tokens)
        return self.obj(status, usage_=usage(*counts))

    def failed(self, message: str) -> JSON:
        return self.obj("failed", error={"code": "server_error", "message": message})

    def end(self, response: JSON) -> JSON:
        if self.on_end is not None:
            self.on_end(response)
        return response

    def response(self) -> JSON:
        return self.end(self.final(0))

    def events(self, streams: Sequence[RequestStream], request_id: str) -> ResponseEvents:
        return ResponseEvents(self, len(streams[0].prompt_token_ids), request_id)


class ResponseEvents:
    """The events of one streamed response, as bytes, in their legal order (module
    docstring). Synchronous; an illegal call raises SSEOrderError and changes nothing."""

    def __init__(self, output: ResponseOutput, input_tokens: int, request_id: str) -> None:
        self._output = output
        self._input_tokens = input_tokens
        self._request_id = request_id
        self._phase = NamedPhase.START
        self._sequence = 0
        self.status = 200  # 200, or the status of the error once one went out

    @property
    def unfinished(self) -> int:
        return 0 if self._output.choice.finish_reason is not None else 1

    def _encode(self, payloads: list[JSON]) -> bytes:
        out = []
        for payload in payloads:
            out.append(named_event(payload["type"], {**payload, "sequence_number": self._sequence}))
            self._sequence += 1
        return b"".join(out)

    def _start(self) -> list[JSON]:
        if self._phase is not NamedPhase.START:
            return []
        self._phase = NamedPhase.STREAMING
        created = self._output.obj("in_progress")
        return [
            {"type": "response.created", "response": created},
            {"type": "response.in_progress", "response": created},
        ]

    def chunk(self, index: int, delta: Delta) -> bytes:
        """The next delta's events (``response.created`` and ``.in_progress`` first)."""
        if self._phase is NamedPhase.DONE or index != 0:
            raise SSEOrderError(f"a delta for choice {index} in phase {self._phase.value}")
        payloads = self._start() + self._output.choice.push(delta)
        if delta.finish_reason is not None:
            final = self._output.end(self._output.final(self._input_tokens))
            kind = (
                "response.incomplete" if final["status"] == "incomplete" else "response.completed"
            )
            payloads.append({"type": kind, "response": final})
            self._phase = NamedPhase.DONE
        return self._encode(payloads)

    def close(self, error: Exception | None = None) -> list[bytes]:
        """The events that end the stream now: nothing after the final event; else
        ``response.failed`` or ``error`` (ShuttingDown for a stream cut short)."""
        error = closing_error(error, unfinished=self.unfinished, phase=self._phase)
        if error is None:
            return []
        reply = error_reply(error, self._request_id)
        self.status = reply.status
        payloads = self._start()
        body = reply.body["error"]
        if reply.status < 500:
            payloads.append(
                {
                    "type": "error",
                    "code": body["code"],
                    "message": body["message"],
                    "param": body["param"],
                }
            )
            self._output.end(self._output.failed(str(body["message"])))
        else:
            failed = self._output.end(self._output.failed(str(body["message"])))
            payloads.append({"type": "response.failed", "response": failed})
        self._phase = NamedPhase.DONE
        return [self._encode(payloads)]
