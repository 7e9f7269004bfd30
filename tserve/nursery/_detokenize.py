"""Token ids to text, one delta at a time, and stop strings. Sans-IO.

Two small state machines, both fed in order and both O(window) per push:

* :class:`IncrementalDetokenizer` turns a growing list of token ids into text
  deltas whose concatenation equals decoding the whole list at once. A byte
  that begins a multi-byte UTF-8 character decodes as U+FFFD until the rest
  arrives; such a tail is held back, never emitted broken.
* :class:`StopMatcher` cuts the text before the first stop string to be
  completed (whatever the split into deltas). It holds back
  any tail that could be the start of a stop string, so text past a stop
  string is never emitted even when the stop string is split across deltas.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["IncrementalDetokenizer", "StopMatcher"]

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas for a stream of token ids.

    Each push decodes only the tokens since ``prefix`` (a few tokens of
    context, so tokenizers that strip a leading space on the first token
    decode the same as in the full text) and returns what the new tokens add.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        """``decode`` turns token ids into text (special tokens skipped or not)."""
        self._decode_ids = decode
        self._ids: list[int] = []
        # Invariant: prefix <= read <= len(ids); ids[:read] have been emitted
        # as text; ids[prefix:read] is the context decoded again each push.
        self._prefix = 0
        self._read = 0

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    def push(self, token_ids: Sequence[int]) -> str:
        """Append ids; return the text they complete (may be "" while held)."""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The held-back tail, at the end of the stream, whatever it holds."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if not final and text.endswith(_REPLACEMENT):
            return ""  # an incomplete UTF-8 character: wait for its other bytes
        delta = text[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids) if ids else ""


class StopMatcher:
    """Cut streamed text at the first of some stop strings (not included)."""

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = tuple(s for s in stop if s)
        self._longest = max((len(s) for s in self._stop), default=0)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that matched, once stopped

    def push(self, text: str) -> str:
        """Return the text that is safe to emit; sets ``stopped`` on a match."""
        if self.stopped:
            return ""
        if not self._stop:
            return text
        buffer = self._held + text
        # The first stop string to END wins (then the longest of those), so
        # the cut does not depend on how the text was split into deltas.
        matches = [(i + len(s), i, s) for s in self._stop if (i := buffer.find(s)) >= 0]
        if matches:
            _, cut, self.matched = min(matches)
            self.stopped = True
            self._held = ""
            return buffer[:cut]
        keep = self._partial_tail(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """At the end of the stream the held tail was not a stop string after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_tail(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that starts a stop string."""
        for size in range(min(self._longest - 1, len(buffer)), 0, -1):
            tail = buffer[-size:]
            if any(s.startswith(tail) for s in self._stop):
                return size
        return 0
