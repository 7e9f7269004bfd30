"""What one streaming completion got back, from its raw response (sans-IO).

The load generator feeds a response's bytes to a :class:`ResponseReader` as
they arrive and asks for its :class:`Outcome` at the end. The HTTP framing is
:class:`tserve.bench._http.ResponseParser`'s, the events are
:class:`tserve.bench._sse.SSEDecoder`'s and each event's JSON is read by
:class:`tserve.bench._metrics.StreamRecorder`; what this module adds is the
benchmark's stricter idea of success:

* a 200 whose body is complete,
* whose events carry no ``error`` and no bytes that are not a chunk,
* with a usage chunk (``usage.completion_tokens``),
* and ``data: [DONE]`` as the last event.

Anything else is an error of its own kind (the ``kind`` of :class:`Outcome`):
``no_response``, ``truncated_head``, ``protocol_error``, ``http_<status>``,
``truncated_body``, ``bad_json``, ``sse_error_event``, ``data_after_done``,
``no_done`` or ``no_usage``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tserve.bench._http import ProtocolError, ResponseParser
from tserve.bench._metrics import StreamRecorder
from tserve.bench._sse import SSEDecoder

__all__ = ["Outcome", "ResponseReader"]

# StreamRecorder's failure kinds, as this benchmark has always named them.
_EVENT_ERRORS = {"bad_event": "bad_json", "stream_error": "sse_error_event"}


@dataclass(frozen=True)
class Outcome:
    """One completion's end: ``kind`` is ``ok`` or an error kind."""

    kind: str
    status: int = 0
    tokens: int = -1  # usage.completion_tokens; -1 when no usage chunk arrived


class ResponseReader:
    """One response as its bytes arrive: :meth:`feed` them, then ask :meth:`outcome`.

    Reading may stop once :attr:`done` is true (the response's framing ended,
    or it is not HTTP) or at EOF. The body is kept whole until the end: a
    streamed completion of this benchmark is a few kilobytes.
    """

    def __init__(self) -> None:
        self._parser = ResponseParser()
        self._body = bytearray()
        self._got_bytes = False
        self._not_http = False  # the parser raised: nothing more is read into it

    @property
    def done(self) -> bool:
        return self._parser.done or self._not_http

    def feed(self, data: bytes) -> None:
        """Take the next bytes read from the connection."""
        self._got_bytes = self._got_bytes or bool(data)
        if self.done:
            return
        try:
            self._body += self._parser.feed(data)
        except ProtocolError:
            self._not_http = True

    def outcome(self) -> Outcome:
        """Classify the response, as far as it got (call at :attr:`done` or at EOF)."""
        if not self._got_bytes:
            return Outcome("no_response")
        if self._not_http:
            return Outcome("protocol_error")
        status = self._parser.status
        if not status:
            return Outcome("truncated_head")
        if status != 200:
            return Outcome(f"http_{status}", status)
        try:
            self._parser.eof()  # a no-op once the framing ended
        except ProtocolError:
            return Outcome("truncated_body", status)
        decoder = SSEDecoder()
        return _classify_events([*decoder.feed(bytes(self._body)), *decoder.flush()])


def _classify_events(payloads: list[bytes]) -> Outcome:
    """The outcome of a complete 200 response with these event payloads."""
    # The response is parsed once it is complete, so the recorder's clock is unused.
    recorder = StreamRecorder(0.0, origin=0.0, prompt_tokens=0)
    done = False
    for payload in payloads:
        if done:
            return Outcome("data_after_done", 200, _tokens(recorder))
        done = payload == b"[DONE]"
        recorder.on_payload(payload, 0.0)
        if recorder.error is not None:
            return Outcome(_EVENT_ERRORS.get(recorder.error, recorder.error), 200)
    if not done:
        return Outcome("no_done", 200, _tokens(recorder))
    if recorder.usage_tokens is None:
        return Outcome("no_usage", 200)
    return Outcome("ok", 200, recorder.usage_tokens)


def _tokens(recorder: StreamRecorder) -> int:
    return -1 if recorder.usage_tokens is None else recorder.usage_tokens
