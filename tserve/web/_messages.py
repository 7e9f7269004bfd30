"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API.

A thin mapping on the chat machinery: the body becomes a :class:`ChatRequest`
(:mod:`._message_requests`), :meth:`Generation.run_chat` runs it exactly as
it runs a chat completion (admission, tools and their grammar, abort on
hang-up, the drain, metrics), and a :class:`MessageOutput`
(:mod:`._message_events`) shapes the answer. Errors are Anthropic's
(:func:`anthropic_error_reply`, set on the routes). ``anthropic-version``
and ``anthropic-beta`` headers are accepted and not checked.
"""

from __future__ import annotations

from functools import partial

from quart import Response

from tserve.nursery import InvalidRequest
from tserve.web._generation import Generation
from tserve.web._message_events import MessageOutput
from tserve.web._message_requests import parse_count_tokens, parse_messages
from tserve.web._metrics import RequestRecord
from tserve.web._model_lookup import ServedModel
from tserve.web._reasoning import thinking_off
from tserve.web._requests import ChatRequest
from tserve.web._routing import json_response, read_body
from tserve.web._tools import ToolPlan

__all__ = ["Messages"]


class Messages:
    """The two Messages handlers of one app, over its :class:`Generation`."""

    def __init__(self, generation: Generation) -> None:
        self._generation = generation

    async def create(self, record: RequestRecord) -> Response:
        req = parse_messages(await read_body())
        output = partial(_output, req=req, show=not thinking_off(req.template_kwargs))
        try:
            return await self._generation.run_chat(record, req, output)
        except InvalidRequest as exc:
            if exc.param != "prompt":
                raise
            raise InvalidRequest(str(exc), param="messages") from None  # the prompt's field here

    async def count_tokens(self, record: RequestRecord) -> Response:
        req = parse_count_tokens(await read_body())
        return json_response({"input_tokens": await self._generation.count_chat_tokens(req)})


def _output(
    model: str,
    plan: ToolPlan | None,
    count: int,
    served: ServedModel,
    *,
    req: ChatRequest,
    show: bool,
) -> MessageOutput:
    assert count == 1, "a Messages request runs one stream"
    reasoning = served.reasoning_for(req.template_kwargs)
    return MessageOutput(model, plan, reasoning, show_thinking=show)
