"""One output's text parsed, delta by delta, into thinking and answer events. Sans-IO.

What the Messages and Responses APIs build their blocks and items from: with a
reasoning syntax, each delta's thinking is split off first, so the tool-call
parser sees only the answer; the answer is one :class:`Content` event, or with a
tool plan the events of :meth:`ToolPlan.stream` (the parser chat completions
use). The delta that carries a finish reason flushes both parsers.
"""

from __future__ import annotations

from collections.abc import Callable

from tserve.nursery import Delta
from tserve.web._reasoning import ReasoningSyntax
from tserve.web._tool_stream import Content, Event, ToolCallStream
from tserve.web._tools import ToolPlan

__all__ = ["OutputParser"]


class OutputParser:
    """One output's parsers; ``new_id`` names each tool call it starts."""

    def __init__(
        self, plan: ToolPlan | None, new_id: Callable[[], str], reasoning: ReasoningSyntax | None
    ) -> None:
        self._calls: ToolCallStream | None = None if plan is None else plan.stream(new_id)
        self._thinking = None if reasoning is None else reasoning.parser()

    def push(self, delta: Delta) -> tuple[str, list[Event]]:
        """``delta``'s thinking (empty without a syntax) and its answer's events."""
        final = delta.finish_reason is not None
        reasoning, text = "", delta.text
        if self._thinking is not None:
            split = self._thinking.push(text, final=final)
            reasoning, text = split.reasoning, split.content
        if self._calls is None:
            return reasoning, [Content(text)]
        events = self._calls.push(text)
        if final:
            events += self._calls.finish()
        return reasoning, events
