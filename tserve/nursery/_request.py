"""One request, from admission to its last delta.

A :class:`RequestStream` is consumed by the caller's task: that task IS the
request task, so cancelling it (a cancel scope, a client disconnect in the
web layer, a deadline) cancels the request. Every way out goes through
:meth:`RequestStream.close`:

* the last delta (the engine finished it: no abort);
* an exception or a cancel inside ``__anext__`` (``close`` in its handler);
* ``async with`` / ``aclose`` / ``close`` by the caller;
* ``break`` out of ``async for`` without keeping a reference: the stream is
  garbage at once (CPython refcounting) and ``__del__`` schedules ``close``
  on the event loop (it never runs it inside the finalizer, which may run
  in any thread and in the middle of the mux's bookkeeping);
* engine death and shutdown fail the mailbox; the mux itself queues the
  abort of a request it cancels at shutdown.

``close`` is synchronous: it queues at most one Abort with ``mux.abort``
(never blocks, never awaits) and releases the admission slot, so cleanup
never waits on an unshielded checkpoint and a second cancel cannot skip it.
Whether an abort is due is decided by the state machine (``_state.py``):
only a request the engine may still be running gets one, and the mux adds
one more filter: a request whose final output has already arrived is
finished in the engine, so it is not aborted.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING, Self

import anyio
import msgspec

from tserve.mux import EngineDeadError, Mailbox, MuxClosedError
from tserve.nursery._detokenize import IncrementalDetokenizer, StopMatcher
from tserve.nursery._errors import RequestFailed, RequestTimeout, ShuttingDown
from tserve.nursery._results import Delta, Usage
from tserve.nursery._state import RequestState, needs_abort, transition
from tserve.protocol import AddRequest, FinishReason, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from tserve.nursery._llm import LLM

__all__ = ["Prompt", "RequestStream"]

Prompt = str | list[int]

# The engine's copy of a deadline is a backstop for an API process that
# cannot act (a stalled event loop): it expires this much later than the
# caller's deadline, so normally our own timer fires first and ends the
# request with exactly one Abort.
ENGINE_DEADLINE_SLACK = 1.0


class RequestStream:
    """An async iterator of :class:`Delta` for one request; also an async
    context manager whose exit closes the request.

    ``__anext__`` is a checkpoint. The first call tokenizes the prompt (on
    the loop if it is short, else in a worker thread: ``LLM.tokenize``) and
    submits the request. If a call is cancelled, or the
    request's deadline passes (RequestTimeout), or it raises, the request is
    over: it is aborted in the engine and the stream is closed; a later
    ``__anext__`` raises ``StopAsyncIteration``. The engine's death raises
    EngineDeadError; leaving ``open_llm`` while a request streams raises
    ShuttingDown in it.
    """

    __slots__ = (
        "__weakref__",
        "_deadline",
        "_deadline_wall",
        "_detok",
        "_done",
        "_llm",
        "_mailbox",
        "_make_prompt",
        "_num_tokens",
        "_params",
        "_state",
        "_stop",
        "prompt_token_ids",
        "request_id",
    )

    def __init__(
        self,
        llm: LLM,
        request_id: str,
        make_prompt: Callable[[], Awaitable[list[int]]] | list[int],
        params: SamplingParams,
        timeout: float | None,
    ) -> None:
        self._done = True  # until fully built: __del__ must find nothing to do
        self.request_id = request_id
        self._llm = llm
        # Token ids, or an async function that makes them (LLM.tokenize).
        self._make_prompt = make_prompt
        self._params = params
        # The deadline on the event loop's clock, and the same instant on the
        # wall clock for the engine (which runs in another process).
        self._deadline = math.inf if timeout is None else anyio.current_time() + timeout
        self._deadline_wall = None if timeout is None else time.time() + timeout
        self._state = RequestState.ADMITTED
        self._mailbox: Mailbox | None = None
        self._detok = IncrementalDetokenizer(llm.decode)
        self._stop = StopMatcher(params.stop)
        self.prompt_token_ids: list[int] = []
        self._num_tokens = 0
        self._done = False

    def __repr__(self) -> str:
        return f"<RequestStream {self.request_id!r} {self._state.value}>"

    @property
    def state(self) -> RequestState:
        return self._state

    def __aiter__(self) -> Self:
        return self

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def aclose(self) -> None:
        """Same as :meth:`close` (for ``contextlib.aclosing``); not a checkpoint."""
        self.close()

    def __del__(self) -> None:
        # `break` out of `async for` drops the last reference at once, so an
        # abandoned stream is aborted without waiting for the cyclic GC.
        if not self._done:
            self._llm._call_soon(self.close)

    async def __anext__(self) -> Delta:
        if self._done:
            raise StopAsyncIteration
        try:
            if self._deadline_wall is None:  # the common case: no cancel scope to build
                return await self._next()
            with anyio.CancelScope(deadline=self._deadline) as scope:
                return await self._next()
            assert scope.cancelled_caught
            raise RequestTimeout(f"request {self.request_id} passed its deadline")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """End the request now. Synchronous, idempotent, never raises.

        Sends one Abort if the engine may still be running the request (see
        the module docstring), and releases the admission slot.
        """
        if self._done:
            return
        self._done = True
        if needs_abort(self._state):
            self._end(RequestState.ABORTED)
        elif self._state is RequestState.ADMITTED:
            self._end(RequestState.CLOSED)
        if self._mailbox is not None:
            self._mailbox.close()  # the mux forgets the id; no second abort
        self._llm._release(self)

    # -- internals ---------------------------------------------------------------

    def _end(self, state: RequestState) -> None:
        """Move to a terminal state; the move to ABORTED sends the Abort.

        This is the only place an Abort is sent. ``transition`` allows
        ABORTED only from SUBMITTED and STREAMING, and a terminal state has no
        way out, so a request is aborted at most once; ``mux.abort`` sends
        nothing for a request whose final output has already arrived.
        """
        self._state = transition(self._state, state)
        if state is RequestState.ABORTED:
            self._llm._mux.abort(self.request_id)

    async def _next(self) -> Delta:
        if self._state is RequestState.ADMITTED:
            await self._submit()
        assert self._mailbox is not None
        while True:
            delta = self._to_delta(await self._receive(self._mailbox))
            if delta is not None:
                return delta

    async def _submit(self) -> None:
        make = self._make_prompt
        prompt = make if isinstance(make, list) else await make()
        self._llm._check_prompt(prompt, self._params)
        self.prompt_token_ids = prompt
        mux = self._llm._mux
        try:
            self._mailbox = mux.open_mailbox(self.request_id, self._params.max_tokens)
            params = self._params
            if params.stop:  # the engine never sees text
                params = msgspec.structs.replace(params, stop=())
            deadline = self._deadline_wall
            if deadline is not None:
                deadline += ENGINE_DEADLINE_SLACK
            mux.submit(AddRequest(self.request_id, prompt, params, deadline))
        except EngineDeadError:
            self._end(RequestState.FAILED)
            raise
        except MuxClosedError:
            self._end(RequestState.FAILED)
            raise ShuttingDown("the LLM is closed") from None
        self._state = transition(self._state, RequestState.SUBMITTED)

    async def _receive(self, mailbox: Mailbox) -> RequestOutput:
        try:
            return await mailbox.get()
        except EngineDeadError:
            self._end(RequestState.FAILED)
            raise
        except MuxClosedError:
            # open_llm is being left; the mux queued this request's abort.
            self._end(RequestState.FAILED)
            raise ShuttingDown("the LLM was closed while the request ran") from None

    def _to_delta(self, output: RequestOutput) -> Delta | None:
        """Text for the new tokens; None when there is nothing to tell yet."""
        if self._state is RequestState.SUBMITTED and output.token_ids:
            self._state = transition(self._state, RequestState.STREAMING)
        self._num_tokens += len(output.token_ids)
        finish = output.finish_reason
        if finish is FinishReason.ERROR:
            self._end(RequestState.FAILED)
            raise RequestFailed(output.error or "the engine failed this request")
        if finish is FinishReason.ABORT and self._deadline_wall is not None:
            # We did not abort it (we would not be reading): the engine's
            # copy of the deadline expired first.
            self._end(RequestState.FINISHED)
            raise RequestTimeout(f"request {self.request_id} passed its deadline")
        text = self._stop.push(self._detok.push(output.token_ids))
        reason: str | None = None
        if self._stop.stopped:
            reason = "stop"
            # Still generating in the engine: this abort tells it to stop.
            self._end(RequestState.ABORTED if finish is None else RequestState.FINISHED)
        elif finish is not None:
            text += self._stop.push(self._detok.flush()) + self._stop.flush()
            reason = finish.openai
            self._end(RequestState.FINISHED)
        elif not text and not output.token_ids:
            return None
        usage = None
        if reason is not None:
            usage = Usage(len(self.prompt_token_ids), self._num_tokens)
            self.close()
        return Delta(text, output.token_ids, output.logprobs, reason, usage)
