"""Tool calls parsed out of a streamed output, as OpenAI's stream deltas. Sans-IO.

:class:`ToolCallStream` takes the output's text in pieces (:meth:`push`,
any split) and returns events: :class:`Content`, :class:`CallStarted` (a
call's index, id and name: once per call) and :class:`Arguments` (the next
fragment of that call's arguments). :meth:`finish` flushes what is held.
The formats are :mod:`tserve.web._tool_formats`'s.

Rules:

* Text that is not part of a call is content, in order. Text that may still
  become a call's opener (a HERMES or MISTRAL marker cut by the split, or a
  LLAMA3/GENERIC output whose first non-blank character is ``{``) is held
  until it is decided; whitespace after a call is held and dropped at the
  end, so calls alone give no content.
* ``enforced`` (the output is a sentence of the format's grammar,
  ``tool_grammar``: compact JSON, ``name`` before the arguments): a call is
  started as soon as its name is read, and its arguments are passed on as
  they arrive, each fragment the next piece of the arguments' JSON text.
* Not enforced (``tool_choice`` "auto"): each call region is held until it
  is complete (a HERMES block at its closing tag, the other formats' region
  at :meth:`finish`) and then decided as :func:`parse_output` decides it:
  calls (each started, then its arguments in one fragment) or content.
* Whatever the split, the calls assembled from the events equal those of
  :func:`parse_output` on the whole text (arguments equal as JSON values),
  and so does the content, up to whitespace around it.
* Nothing follows :meth:`finish`: a push or finish after it raises
  :class:`ToolStreamError`.

Bound: the held text is at most one call region (a HERMES block, or the
rest of the output for the formats whose region ends with it), so at most
the request's ``max_tokens`` tokens of text.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from collections.abc import Callable
from typing import Final

from tserve.web._tool_formats import (
    HERMES_CLOSE,
    HERMES_OPEN,
    MISTRAL_OPEN,
    ToolFormat,
    calls_of_region,
)

__all__ = ["Arguments", "CallStarted", "Content", "Event", "ToolCallStream", "ToolStreamError"]


@dataclasses.dataclass(frozen=True, slots=True)
class Content:
    text: str


@dataclasses.dataclass(frozen=True, slots=True)
class CallStarted:
    index: int
    id: str
    name: str


@dataclasses.dataclass(frozen=True, slots=True)
class Arguments:
    index: int
    text: str


Event = Content | CallStarted | Arguments


class ToolStreamError(RuntimeError):
    """A push or finish after :meth:`ToolCallStream.finish` (a bug in the caller)."""


class _Phase(enum.Enum):
    TEXT = "text"  # content; looking for a call's opener
    PLAIN = "plain"  # the output is not calls: everything is content
    REGION = "region"  # (not enforced) holding a call region until it is complete
    OPENING = "opening"  # (enforced) before the first call of the region: "[" and the like
    HEADER = "header"  # (enforced) before a call's name
    ARGUMENTS = "arguments"  # (enforced) inside a call's arguments
    CLOSING = "closing"  # (enforced) after a call's arguments: its "}" and a separator
    END = "end"  # (enforced) the region is over
    FINISHED = "finished"


_STRING = r'"(?:[^"\\]|\\.)*"'
_HEADER: Final = re.compile(
    r'\s*\{\s*"name"\s*:\s*(' + _STRING + r')\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)
_OPENING: Final = {
    ToolFormat.HERMES: re.compile(r""),
    ToolFormat.LLAMA3: re.compile(r""),
    ToolFormat.MISTRAL: re.compile(r"\s*\["),
    ToolFormat.GENERIC: re.compile(r'\s*\{\s*"tool_calls"\s*:\s*\['),
}
# After a call's arguments: (pattern, next phase) in the order tried.
_CLOSING: Final = {
    ToolFormat.HERMES: ((re.compile(r"\s*\}\s*" + re.escape(HERMES_CLOSE)), _Phase.TEXT),),
    ToolFormat.LLAMA3: ((re.compile(r"\s*\}"), _Phase.END),),  # END takes a ";" to go on
    ToolFormat.MISTRAL: (
        (re.compile(r"\s*\}\s*,"), _Phase.HEADER),
        (re.compile(r"\s*\}\s*\]"), _Phase.END),
    ),
    ToolFormat.GENERIC: (
        (re.compile(r"\s*\}\s*,"), _Phase.HEADER),
        (re.compile(r"\s*\}\s*\]\s*\}"), _Phase.END),
    ),
}
_LLAMA3_NEXT: Final = re.compile(r"\s*;")
_MARKERS: Final = {ToolFormat.HERMES: HERMES_OPEN, ToolFormat.MISTRAL: MISTRAL_OPEN}


class _ObjectEnd:
    """Finds where a JSON value that starts with ``{`` or ``[`` ends, fed piece by piece."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> int | None:
        """The index in ``text`` just past the value's end, or None if it goes on."""
        for at, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return at + 1
        return None


class ToolCallStream:
    """The events of one streamed output (see the module docstring).

    ``names``: the request's tool names (a call of another is not a call).
    ``new_id``: makes each call's id (``call_...``).
    """

    def __init__(
        self,
        fmt: ToolFormat,
        names: frozenset[str],
        *,
        enforced: bool,
        new_id: Callable[[], str],
    ) -> None:
        self._fmt, self._names, self._enforced, self._new_id = fmt, names, enforced, new_id
        self._phase = _Phase.TEXT
        # Invariant: _held is text received and not yet turned into events.
        self._held = ""
        self._blank = ""  # whitespace held back from the content (see the rules)
        self._calls = 0  # calls started so far
        self._content_started = False
        self._args: _ObjectEnd | None = None  # set in ARGUMENTS

    @property
    def calls(self) -> int:
        """How many calls have started."""
        return self._calls

    def push(self, text: str) -> list[Event]:
        """The events ``text`` completes."""
        if self._phase is _Phase.FINISHED:
            raise ToolStreamError("push after finish")
        self._held += text
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[Event]:
        """The events of what is still held, the output being over."""
        events = self.push("")
        held, self._held = self._held, ""
        phase, self._phase = self._phase, _Phase.FINISHED
        if phase is _Phase.REGION:
            self._decide(self._opener() + held, held, events)
        elif held and (phase is not _Phase.END or held.strip()):
            prefix = self._opener() if phase is _Phase.OPENING else ""
            self._content(prefix + held, events)
        if not self._calls and self._blank:
            events.append(Content(self._blank))
        self._blank = ""
        return events

    # -- the steps -------------------------------------------------------------------------

    def _step(self, events: list[Event]) -> bool:
        """Take one step on the held text; False when it must wait for more."""
        phase = self._phase
        if phase is _Phase.TEXT:
            return self._text(events)
        if phase is _Phase.PLAIN:
            if self._held:
                self._content(self._held, events)
                self._held = ""
            return False
        if phase is _Phase.REGION:
            return self._region(events)
        if phase is _Phase.OPENING:
            return self._match(_OPENING[self._fmt], _Phase.HEADER)
        if phase is _Phase.HEADER:
            return self._header(events)
        if phase is _Phase.ARGUMENTS:
            return self._arguments(events)
        if phase is _Phase.CLOSING:
            return any(self._match(p, then) for p, then in _CLOSING[self._fmt])
        if self._fmt is ToolFormat.LLAMA3:  # END: calls joined by ";" go on
            return self._match(_LLAMA3_NEXT, _Phase.HEADER)
        return False  # END: the rest is held for finish

    def _text(self, events: list[Event]) -> bool:
        marker = _MARKERS.get(self._fmt)
        if marker is None:  # LLAMA3, GENERIC: calls only as the whole output
            stripped = self._held.lstrip()
            if not stripped:
                return False
            if self._content_started or self._calls or not stripped.startswith("{"):
                self._phase = _Phase.PLAIN
                return True
            self._blank += self._held[: len(self._held) - len(stripped)]
            self._held = stripped
            self._enter_region()
            return True
        at = self._held.find(marker)
        if at < 0:
            keep = _partial_suffix(self._held, marker)
            self._content(self._held[: len(self._held) - keep], events)
            self._held = self._held[len(self._held) - keep :]
            return False
        self._content(self._held[:at], events)
        self._held = self._held[at + len(marker) :]
        self._enter_region()
        return True

    def _enter_region(self) -> None:
        self._phase = _Phase.OPENING if self._enforced else _Phase.REGION

    def _region(self, events: list[Event]) -> bool:
        if self._fmt is not ToolFormat.HERMES:
            return False  # the region is the rest of the output: decided at finish
        end = self._held.find(HERMES_CLOSE)
        if end < 0:
            return False
        block = self._held[:end]
        self._held = self._held[end + len(HERMES_CLOSE) :]
        self._phase = _Phase.TEXT
        self._decide(HERMES_OPEN + block + HERMES_CLOSE, block, events)
        return True

    def _decide(self, whole: str, region: str, events: list[Event]) -> None:
        """A complete region: its calls, or ``whole`` (its text with markers) as content."""
        calls = calls_of_region(region, self._fmt, self._names)
        if calls is None:
            self._content(whole, events)
            return
        for call in calls:
            index = self._start(call.name, events)
            events.append(Arguments(index, call.arguments))

    def _header(self, events: list[Event]) -> bool:
        found = _HEADER.match(self._held)
        if found is None:
            return False
        self._start(json.loads(found.group(1)), events)
        self._held = self._held[found.end() :]
        self._args = _ObjectEnd()
        self._phase = _Phase.ARGUMENTS
        return True

    def _arguments(self, events: list[Event]) -> bool:
        assert self._args is not None  # invariant: set on entering ARGUMENTS
        if not self._held:
            return False
        end = self._args.feed(self._held)
        piece = self._held if end is None else self._held[:end]
        events.append(Arguments(self._calls - 1, piece))
        self._held = self._held[len(piece) :]
        if end is None:
            return False
        self._args = None
        self._phase = _Phase.CLOSING
        return True

    def _match(self, pattern: re.Pattern[str], then: _Phase) -> bool:
        found = pattern.match(self._held)
        if found is None:
            return False
        self._held = self._held[found.end() :]
        self._phase = then
        return True

    def _start(self, name: str, events: list[Event]) -> int:
        index = self._calls
        self._calls += 1
        events.append(CallStarted(index, self._new_id(), name))
        return index

    def _content(self, text: str, events: list[Event]) -> None:
        """``text`` as content, whitespace after a call held back (see the rules)."""
        if not text:
            return
        if not text.strip() and (self._calls or not self._content_started):
            self._blank += text
            return
        if self._calls and not self._content_started:
            text = text.lstrip()  # the blank between calls and text is not content
            self._blank = ""
        events.append(Content(self._blank + text))
        self._blank = ""
        self._content_started = True

    def _opener(self) -> str:
        return _MARKERS.get(self._fmt, "")


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
