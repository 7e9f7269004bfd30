"""Running the request streams of one HTTP request and merging their choices.

One HTTP request owns ``k >= 1`` :class:`RequestStream` s (``n`` samples of
each prompt); choice ``i`` is fed by stream ``i``. Two ways to run them:

* :func:`collect` (non-streaming): a nursery inside the handler drains every
  stream into its choice. The first error cancels the others and is raised.
* :class:`SSEBody` (streaming): the response body. Quart enters it with
  ``async with body`` after sending the headers and iterates it in the same
  task; its nursery lives exactly that long, so a client disconnect (quart-
  trio cancels the request task) cancels every stream still running, which
  aborts it in the engine. Its pumps buffer the events (:class:`SendBuffer`),
  so a slow reader does not keep a finished request admitted. Before that,
  :func:`first_deltas` pulls each stream's first delta inside the handler,
  so a request that fails at once (prompt too long, overload, dead engine)
  still gets a proper status code instead of a 200 followed by an error
  event.

Every stream is closed on every path out (``async with stream`` in the
pumps, and ``SSEBody.__aexit__`` for streams never pumped).

What the client sees is an API's sans-IO mapping, an :class:`Output`: its
choices take the deltas, its ``response()`` is the whole JSON body, its
``events()`` the SSE encoder (:class:`StreamEvents`). Chat completions,
completions and Anthropic's Messages are three outputs of this one machinery.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, Protocol

import trio
from quart.wrappers.response import ResponseBody

from tserve.nursery import Delta, RequestStream
from tserve.web._errors import RequestAborted
from tserve.web._metrics import RequestRecord
from tserve.web._send_buffer import BufferBudget, SendBuffer

__all__ = [
    "Choice",
    "Output",
    "SSEBody",
    "StreamEvents",
    "closed_on_error",
    "collect",
    "first_deltas",
]


class Choice(Protocol):
    """Accumulates the deltas of one generated sequence (one stream)."""

    def push(self, delta: Delta) -> Any:
        """Take the stream's next delta (what it returns is the API's business)."""
        ...


class StreamEvents(Protocol):
    """An API's SSE encoder for one response: deltas in, bytes out, in its legal
    order. Synchronous; an illegal call raises (a bug in the caller)."""

    status: int  # 200, or the status of the error event once one went out

    @property
    def unfinished(self) -> int:
        """How many choices have not had their finishing event."""
        ...

    def chunk(self, index: int, delta: Delta) -> bytes:
        """Choice ``index``'s next delta as its events."""
        ...

    def close(self, error: Exception | None = None) -> list[bytes]:
        """The events that end the stream now, after ``error`` if it failed; with
        no error and choices still running it was cut short (an error event)."""
        ...


class Output(Protocol):
    """An API's sans-IO mapping of one run's output: what the shared machinery fills."""

    @property
    def choices(self) -> Sequence[Choice]:
        """Choice ``i`` takes stream ``i``'s deltas."""
        ...

    def response(self) -> Any:
        """The whole JSON body, once :func:`collect` has run every choice to its end."""
        ...

    def events(self, streams: Sequence[RequestStream], request_id: str) -> StreamEvents:
        """The SSE encoder, made after every stream's first delta was pulled (so
        ``stream.prompt_token_ids`` is known); error events name ``request_id``."""
        ...


def _checked(delta: Delta) -> Delta:
    if delta.finish_reason == "abort":
        raise RequestAborted("the engine aborted this request")
    return delta


async def _next(stream: RequestStream) -> Delta:
    """The stream's next delta; a stream that ends without a finish is a bug."""
    try:
        return _checked(await stream.__anext__())
    except StopAsyncIteration:
        raise RuntimeError(f"request {stream.request_id} ended without a finish") from None


@contextlib.contextmanager
def closed_on_error(streams: Sequence[RequestStream]) -> Iterator[None]:
    """Close every stream in ``streams`` (as it is then) if the block raises,
    cancellation included; re-raise. Synchronous."""
    try:
        yield
    except BaseException:
        for stream in streams:
            stream.close()
        raise


async def first_deltas(streams: Sequence[RequestStream]) -> list[Delta]:
    """The first delta of every stream, pulled concurrently.

    A checkpoint. On any error (or cancellation) every stream is closed and
    the first error is raised as itself, not as a group.
    """
    firsts: list[Delta | None] = [None] * len(streams)
    errors: list[Exception] = []

    async def first(i: int, scope: trio.CancelScope) -> None:
        try:
            firsts[i] = await _next(streams[i])
        except Exception as exc:
            errors.append(exc)
            scope.cancel()

    with closed_on_error(streams):
        if len(streams) == 1:
            return [await _next(streams[0])]
        async with trio.open_nursery() as nursery:
            for i in range(len(streams)):
                nursery.start_soon(first, i, nursery.cancel_scope)
        if errors:
            raise errors[0]
    return [d for d in firsts if d is not None]


async def collect(
    streams: Sequence[RequestStream], choices: Sequence[Choice], record: RequestRecord
) -> None:
    """Run every stream to its end into its choice. A checkpoint.

    The first error cancels the other streams and is raised as itself.
    """
    errors: list[Exception] = []

    async def drain(i: int) -> None:
        try:
            async with streams[i] as stream:
                async for delta in stream:
                    record.delta(i, _checked(delta))
                    choices[i].push(delta)
        except Exception as exc:
            errors.append(exc)
            nursery.cancel_scope.cancel()

    try:
        async with trio.open_nursery() as nursery:
            for i in range(len(streams)):
                nursery.start_soon(drain, i)
    finally:
        for stream in streams:
            stream.close()
    if errors:
        raise errors[0]


class SSEBody(ResponseBody):
    """The body of a streaming response: its events in the order its :class:`StreamEvents` keeps.

    Quart enters it after sending the headers and iterates it in the request
    task; its nursery (the pumps) lives exactly that long. The pumps read
    every stream to its end into a :class:`SendBuffer` (its bounds are
    written there), so a stream is closed, and its admission slot free, once
    the engine has finished it, however slowly the client reads; iteration
    yields what the buffer holds. A failure after the headers ends the stream
    with one error event (then ``[DONE]`` for OpenAI); :meth:`abort` (server shutdown
    past its timeout) does the same with its reason. ``on_close`` runs once,
    when quart leaves the body; ``name_error`` maps a stream's failure to the
    error its event reports (naming the request's field).
    """

    def __init__(
        self,
        streams: Sequence[RequestStream],
        firsts: Sequence[Delta],
        events: StreamEvents,
        *,
        record: RequestRecord,
        budget: BufferBudget,
        on_close: Callable[[SSEBody], None],
        name_error: Callable[[Exception], Exception] = lambda exc: exc,
    ) -> None:
        self._streams, self._firsts, self._sse = streams, firsts, events
        self._record, self._on_close, self._name_error = record, on_close, name_error
        self._error: Exception | None = None  # the first failure, or the abort's reason
        self._pumps = trio.CancelScope()
        self._nursery_manager = trio.open_nursery()
        self._buffer = SendBuffer(budget)

    async def __aenter__(self) -> SSEBody:
        nursery = await self._nursery_manager.__aenter__()
        nursery.start_soon(self._run_pumps)
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        """Cancel the pumps, wait for them, close every stream. A checkpoint."""
        self._pumps.cancel()  # the client may be gone with choices still running
        try:
            await self._nursery_manager.__aexit__(*exc_info)
        finally:
            for stream in self._streams:
                stream.close()
            self._buffer.discard()
            self._record.done(self._sse.status if exc_info[1] is None else 499)
            self._on_close(self)

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._buffer

    def abort(self, reason: Exception) -> None:
        """End the stream now with ``reason`` as its final error event. Synchronous."""
        if self._error is None:
            self._error = reason
        self._pumps.cancel()

    async def _run_pumps(self) -> None:
        """The firsts, then every unfinished stream pumped to its end (or to the
        first failure, or the abort), then the closing events."""
        for i, delta in enumerate(self._firsts):
            self._buffer.put_nowait(self._chunk(i, delta))
        with self._pumps:
            async with trio.open_nursery() as pumps:
                for i, stream in enumerate(self._streams):
                    if self._firsts[i].finish_reason is None:
                        pumps.start_soon(self._pump, i, stream)
        for closing in self._sse.close(self._error if self._sse.unfinished else None):
            self._buffer.put_nowait(closing)
        self._buffer.close()

    async def _pump(self, i: int, stream: RequestStream) -> None:
        try:
            async with stream:
                async for delta in stream:
                    await self._buffer.put(self._chunk(i, _checked(delta)))
        except Exception as exc:
            if self._error is None:
                self._error = self._name_error(exc)
            self._pumps.cancel()

    def _chunk(self, i: int, delta: Delta) -> bytes:
        self._record.delta(i, delta)
        return self._sse.chunk(i, delta)
