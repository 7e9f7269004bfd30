"""One request, from admission to its last delta.

A :class:`RequestStream` is consumed by the caller's task: that task IS the
request task, so cancelling it (a cancel scope, a client disconnect in the
web layer, a deadline) cancels the request. Every way out — the last delta,
``break`` out of ``async for``, an exception, a cancel, engine death, garbage
collection — goes through :meth:`RequestStream.close`, which is synchronous:
it sends at most one Abort with ``mux.abort`` (``send_nowait``, no await) and
releases the admission slot. Cleanup therefore never waits on an unshielded
checkpoint and cannot be skipped by a second cancel.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Self

import anyio
import msgspec

from tserve.mux import EngineDeadError, Mailbox
from tserve.nursery._detokenize import IncrementalDetokenizer, StopMatcher
from tserve.nursery._errors import RequestFailed, RequestTimeout
from tserve.nursery._results import Delta, Usage
from tserve.nursery._state import RequestState, needs_abort, transition
from tserve.protocol import AddRequest, FinishReason, RequestOutput, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from tserve.nursery._llm import LLM

__all__ = ["RequestStream"]

Prompt = str | list[int]


class RequestStream:
    """An async iterator of :class:`Delta` for one request; also an async
    context manager whose exit closes the request.

    ``__anext__`` is a checkpoint. If it is cancelled (or its deadline
    passes), the request is over: it is aborted in the engine and the
    stream is closed; a later ``__anext__`` raises ``StopAsyncIteration``.
    """

    def __init__(
        self,
        llm: LLM,
        request_id: str,
        make_prompt: Callable[[], list[int]],
        params: SamplingParams,
        deadline: float | None,
    ) -> None:
        self.request_id = request_id
        self._llm = llm
        self._make_prompt = make_prompt
        self._params = params
        self._deadline = deadline  # time.time() after which the request times out
        self._state = RequestState.ADMITTED
        self._mailbox: Mailbox | None = None
        self._detok = IncrementalDetokenizer(llm.decode)
        self._stop = StopMatcher(params.stop)
        self.prompt_token_ids: list[int] = []
        self._num_tokens = 0
        self._done = False

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
        self.close()

    def __del__(self) -> None:
        # `break` out of `async for` drops the last reference at once (CPython),
        # so an abandoned stream is aborted without waiting for the GC.
        if not self._done:
            self.close()

    async def __anext__(self) -> Delta:
        if self._done:
            raise StopAsyncIteration
        try:
            if self._state is RequestState.ADMITTED:
                await self._submit()
            return await self._next_delta()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """End the request now. Synchronous, idempotent, never raises."""
        if self._done:
            return
        self._done = True
        if needs_abort(self._state):
            self._llm._mux.abort(self.request_id)
            self._state = transition(self._state, RequestState.ABORTED)
        elif self._state is RequestState.ADMITTED:
            self._state = transition(self._state, RequestState.CLOSED)
        if self._mailbox is not None:
            self._mailbox.close()
        self._llm._release(self)

    # -- internals ---------------------------------------------------------------

    async def _submit(self) -> None:
        prompt = await anyio.to_thread.run_sync(self._make_prompt)
        self._llm._check_prompt(prompt, self._params)
        self.prompt_token_ids = prompt
        mux = self._llm._mux
        self._mailbox = mux.open_mailbox(self.request_id, self._params.max_tokens)
        wire_params = msgspec.structs.replace(self._params, stop=())
        mux.submit(AddRequest(self.request_id, prompt, wire_params, self._deadline))
        self._state = transition(self._state, RequestState.SUBMITTED)

    async def _next_delta(self) -> Delta:
        assert self._mailbox is not None
        while True:
            output = await self._receive(self._mailbox)
            if self._state is RequestState.SUBMITTED and output.token_ids:
                self._state = transition(self._state, RequestState.STREAMING)
            delta = self._to_delta(output)
            if delta is not None:
                return delta

    async def _receive(self, mailbox: Mailbox) -> RequestOutput:
        timeout = math.inf if self._deadline is None else self._deadline - time.time()
        try:
            with anyio.fail_after(max(0.0, timeout)):
                return await mailbox.get()
        except TimeoutError:
            raise RequestTimeout(f"request {self.request_id} passed its deadline") from None
        except EngineDeadError:
            self._state = transition(self._state, RequestState.FAILED)
            raise

    def _to_delta(self, output: RequestOutput) -> Delta | None:
        """Text for the new tokens; None when there is nothing to tell yet."""
        self._num_tokens += len(output.token_ids)
        finish = output.finish_reason
        if finish is FinishReason.ERROR:
            self._state = transition(self._state, RequestState.FAILED)
            raise RequestFailed(output.error or "the engine failed this request")
        text = self._stop.push(self._detok.push(output.token_ids))
        if self._stop.stopped:
            reason: str | None = "stop"
            if finish is None:  # the engine is still generating: tell it to stop
                self._llm._mux.abort(self.request_id)
                self._state = transition(self._state, RequestState.ABORTED)
            else:
                self._state = transition(self._state, RequestState.FINISHED)
        elif finish is not None:
            text += self._stop.push(self._detok.flush()) + self._stop.flush()
            reason = finish.openai
            self._state = transition(self._state, RequestState.FINISHED)
        else:
            reason = None
            if not text and not output.token_ids:
                return None
        usage = None
        if reason is not None:
            usage = Usage(len(self.prompt_token_ids), self._num_tokens)
            self.close()
        return Delta(text, list(output.token_ids), _logprobs(output), reason, usage)


def _logprobs(output: RequestOutput) -> list[TokenLogprob] | None:
    return None if output.logprobs is None else list(output.logprobs)
