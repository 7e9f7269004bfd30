"""Server-sent events as OpenAI streams them, in their one legal order. Sans-IO.

The encoder: :func:`event` turns a payload into one ``data: {json}`` event,
:data:`DONE` is the ``data: [DONE]`` that ends every stream; :func:`named_event`
is the ``event: NAME`` kind the Messages and Responses streams send, whose
order their own modules keep (:class:`NamedPhase`, :func:`closing_error`).

The order (:class:`SSEEvents`), for a response of ``k`` choices::

    chunk*  ->  ( error | usage )?  ->  [DONE]

* **chunk**: one delta of one choice, wrapped as a stream chunk. Legal while
  the stream is ``STREAMING`` and that choice has not finished; the chunk
  that carries a choice's finish reason is that choice's last.
* **error**: ``data: {"error": {...}}``, the stream failed after its headers
  were sent (the status is already 200). Legal while ``STREAMING``, whatever
  the choices; it replaces the usage chunk. Then ``ENDING``.
* **usage**: a chunk with no choices and the whole request's usage. Legal
  only when the client asked for it (``stream_options.include_usage``) and
  every choice has finished. Then ``ENDING``.
* **[DONE]**: always last. Legal in ``ENDING``, or in ``STREAMING`` when
  every choice has finished and no usage was asked. Then ``DONE``.

Anything else raises :class:`SSEOrderError` (a bug in the caller, never a
client's fault). :meth:`SSEEvents.close` writes the legal ending for each way
a stream stops: every choice finished (usage chunk if asked, [DONE]), or an
error, or a stream cut short with choices still running (an error event, the
given one or ShuttingDown, then [DONE]: a stream never ends silently).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any, Final

import msgspec

from tserve.nursery import Delta, ShuttingDown, Usage
from tserve.web._errors import error_reply
from tserve.web._responses import ChatChoice, CompletionChoice, total_usage

__all__ = [
    "DONE",
    "NamedPhase",
    "SSEEvents",
    "SSEOrderError",
    "StreamPhase",
    "closing_error",
    "event",
    "named_event",
]

DONE: Final = b"data: [DONE]\n\n"

_ENCODER: Final = msgspec.json.Encoder()

JSON = dict[str, Any]


def event(payload: Any) -> bytes:
    """One SSE event carrying ``payload`` as JSON."""
    return b"data: " + _ENCODER.encode(payload) + b"\n\n"


def named_event(name: str, payload: Any) -> bytes:
    """One SSE event ``name`` carrying ``payload`` as JSON."""
    return b"event: " + name.encode() + b"\ndata: " + _ENCODER.encode(payload) + b"\n\n"


class SSEOrderError(RuntimeError):
    """An event out of the order in the module docstring."""


class NamedPhase(enum.Enum):
    """Where a named-event stream (Messages, Responses) is."""

    START = "start"  # nothing sent
    STREAMING = "streaming"  # the opening events went out; the output's events
    DONE = "done"  # the last event, or the error event, went out: nothing is left


def closing_error(
    error: Exception | None, *, unfinished: int, phase: NamedPhase
) -> Exception | None:
    """The error a named-event stream (Messages, Responses) ends with on ``close``.

    ``error``; ShuttingDown when it is None but choices still run (the stream
    was cut short); None for a stream that finished (phase ``DONE``). Raises
    SSEOrderError for a finished stream closed before its end, or an error
    after its end.
    """
    done = phase is NamedPhase.DONE
    if error is None and unfinished:
        error = ShuttingDown("the stream was cut short")
    if error is None:
        if not done:
            raise SSEOrderError(f"a finished stream closed in phase {phase.value}")
        return None
    if done:
        raise SSEOrderError("an error event after the end of the stream")
    return error


class StreamPhase(enum.Enum):
    STREAMING = "streaming"  # chunks; then an error event, the usage chunk or [DONE]
    ENDING = "ending"  # an error event or the usage chunk went out: only [DONE] is left
    DONE = "done"  # [DONE] went out: nothing is left


class SSEEvents:
    """The events of one streaming response, as bytes, in their legal order.

    ``choices[i]`` accumulates choice ``i``'s deltas; ``chunk`` wraps a choice
    object into a stream chunk; ``usage_chunk`` (``None`` when the client did
    not ask for usage) makes the usage chunk from the request's usage, whose
    prompts count once per ``n`` choices. Error events name ``request_id``.
    Every method is synchronous; an illegal one raises SSEOrderError and
    changes nothing.
    """

    def __init__(
        self,
        choices: Sequence[CompletionChoice | ChatChoice],
        *,
        chunk: Callable[[JSON], JSON],
        usage_chunk: Callable[[Usage], JSON] | None,
        n: int,
        request_id: str,
    ) -> None:
        self._choices = choices
        self._chunk = chunk
        self._usage_chunk = usage_chunk
        self._n = n
        self._request_id = request_id
        self.phase = StreamPhase.STREAMING
        # Invariant: _running[i] until choice i's finishing chunk went out.
        self._running = [True] * len(choices)
        self.status = 200  # 200, or the status of the error event once one went out

    @property
    def unfinished(self) -> int:
        """How many choices have not had their finishing chunk."""
        return sum(self._running)

    def chunk(self, index: int, delta: Delta) -> bytes:
        """Choice ``index``'s next delta as a chunk event."""
        self._require("a chunk", StreamPhase.STREAMING)
        if not self._running[index]:
            raise SSEOrderError(f"a chunk for choice {index} after its finish")
        data = event(self._chunk(self._choices[index].push(delta)))
        if delta.finish_reason is not None:
            self._running[index] = False
        return data

    def error(self, exc: Exception) -> bytes:
        """``exc`` as the stream's error event (its status becomes :attr:`status`)."""
        self._require("an error event", StreamPhase.STREAMING)
        reply = error_reply(exc, self._request_id)
        self.status = reply.status
        self.phase = StreamPhase.ENDING
        return event(reply.body)

    def usage(self) -> bytes:
        """The usage chunk of the whole request."""
        self._require("the usage chunk", StreamPhase.STREAMING)
        if self._usage_chunk is None:
            raise SSEOrderError("a usage chunk that the client did not ask for")
        if self.unfinished:
            raise SSEOrderError("the usage chunk before every choice finished")
        self.phase = StreamPhase.ENDING
        return event(self._usage_chunk(total_usage(self._choices, self._n)))

    def done(self) -> bytes:
        """The ``[DONE]`` that ends the stream."""
        self._require("[DONE]", StreamPhase.STREAMING, StreamPhase.ENDING)
        if self.phase is StreamPhase.STREAMING:
            if self.unfinished:
                raise SSEOrderError("[DONE] with choices still running and no error event")
            if self._usage_chunk is not None:
                raise SSEOrderError("[DONE] before the usage chunk the client asked for")
        self.phase = StreamPhase.DONE
        return DONE

    def close(self, error: Exception | None = None) -> list[bytes]:
        """The events that end the stream now, after ``error`` if it failed.

        With no error and choices still running, the stream was cut short:
        it ends with a ShuttingDown error event.
        """
        if error is None and self.unfinished:
            error = ShuttingDown("the stream was cut short")
        if error is not None:
            return [self.error(error), self.done()]
        if self._usage_chunk is not None:
            return [self.usage(), self.done()]
        return [self.done()]

    def _require(self, what: str, *phases: StreamPhase) -> None:
        if self.phase not in phases:
            raise SSEOrderError(f"{what} in phase {self.phase.value}")
