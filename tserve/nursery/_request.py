"""One request, from admission to its last delta: the IO shell around ``_output.py``.

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

A stream admitted without a free slot holds a ticket instead; its first
``__anext__`` tokenizes and then waits for a slot (``Admission.wait``)
before it submits, so a waiting stream holds no mailbox and nothing in
the engine.

``close`` is synchronous: it closes the mailbox (never blocks, never awaits)
and gives back the admission slot or ticket, so cleanup never waits on an
unshielded checkpoint and a second cancel cannot skip it. Whether an Abort
goes with it is decided in one place, the request's
:class:`~tserve.mux.Lifecycle` (``tserve/mux/_lifecycle.py``), which the
stream makes at once and hands to its mailbox: only a request the engine may
still run gets one, and only one (a request whose final output has arrived
is finished, read or not). What each output means for the caller is
:class:`~tserve.nursery._output.OutputMapper`'s.

The stream reaches its client only through a :class:`RequestSeam`, which
the client (``LLM``) hands in: the mux, the decoder, the prompt check, the
admission (wait for a slot, give it back) and the event loop's call-soon.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable
from typing import NoReturn, Self

import anyio
import msgspec

from tserve.mux import EngineDeadError, Lifecycle, Mailbox, Mux, MuxClosedError, RequestState
from tserve.nursery._admission import Admission
from tserve.nursery._deadline import Deadline
from tserve.nursery._output import OutputMapper, mux_error
from tserve.nursery._results import Delta
from tserve.protocol import AddRequest, RequestOutput
from tserve.sampling import Constraint, SamplingParams

__all__ = ["Prompt", "RequestSeam", "RequestStream", "loop_caller"]

Prompt = str | list[int]


@dataclasses.dataclass(frozen=True, slots=True)
class RequestSeam:
    """All a :class:`RequestStream` uses of the client that admitted it.

    Only ``admission.wait`` and ``check_constraint`` block (see :class:`Admission`,
    :class:`~tserve.nursery._constraint.ConstraintCheck`)."""

    mux: Mux  # open_mailbox, submit and abort (synchronous)
    decode: Callable[[list[int]], str]  # token ids to text, special tokens skipped
    check_prompt: Callable[[list[int], SamplingParams], None]  # raises InvalidRequest
    # Raises InvalidRequest; a checkpoint unless its verdict is remembered.
    check_constraint: Callable[[Constraint], Awaitable[None]]
    admission: Admission  # wait (a stream holding a ticket), leave (once per stream)
    call_soon: Callable[[Callable[[], object]], None]  # thread-safe; see loop_caller
    # Around the awaits before the request reaches the engine: the engine's
    # death ends them with EngineDeadError (EngineClient.before_engine).
    before_engine: Callable[[], contextlib.AbstractContextManager[None]]


class RequestStream:
    """An async iterator of :class:`Delta` for one request; also an async
    context manager whose exit closes the request.

    ``__anext__`` is a checkpoint. The first call tokenizes the prompt (on
    the loop if it is short, else in a worker thread: ``LLM.tokenize``),
    checks its constraint if it has one (a worker thread unless the verdict
    is remembered) and submits the request. If a call is cancelled, or the
    request's deadline passes (RequestTimeout), or it raises, the request is
    over: it is aborted in the engine and the stream is closed; a later
    ``__anext__`` raises ``StopAsyncIteration``. The engine's death raises
    EngineDeadError; leaving ``open_llm`` while a request streams raises
    ShuttingDown in it.
    """

    __slots__ = (
        "__weakref__",
        "_deadline",
        "_done",
        "_holds_slot",
        "_life",
        "_mailbox",
        "_make_prompt",
        "_mapper",
        "_params",
        "_seam",
        "prompt_token_ids",
        "request_id",
    )

    def __init__(
        self,
        seam: RequestSeam,
        request_id: str,
        make_prompt: Callable[[], Awaitable[list[int]]] | list[int],
        params: SamplingParams,
        timeout: float | None,
        *,
        holds_slot: bool = True,
    ) -> None:
        self._done = True  # until fully built: __del__ must find nothing to do
        # True: it holds an admission slot; False: a ticket, until _submit waits.
        self._holds_slot = holds_slot
        self.request_id = request_id
        self._seam = seam
        # Token ids, or an async function that makes them (LLM.tokenize).
        self._make_prompt = make_prompt
        self._params = params
        self._deadline = Deadline.after(timeout)
        self._mapper = OutputMapper(
            seam.decode, params.stop, has_deadline=self._deadline.is_set, request_id=request_id
        )
        self._life = Lifecycle(params.max_tokens)  # the one state of the request
        self._mailbox: Mailbox | None = None
        self.prompt_token_ids: list[int] = []
        self._done = False

    def __repr__(self) -> str:
        return f"<RequestStream {self.request_id!r} {self.state.value}>"

    @property
    def state(self) -> RequestState:
        return self._life.state

    def __aiter__(self) -> Self:
        return self

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    async def aclose(self) -> None:
        """Same as :meth:`close` (for ``contextlib.aclosing``); not a checkpoint."""
        self.close()

    def __del__(self) -> None:
        # `break` out of `async for` drops the last reference at once, so an
        # abandoned stream is aborted without waiting for the cyclic GC.
        if not self._done:
            self._seam.call_soon(self.close)

    async def __anext__(self) -> Delta:
        if self._done:
            raise StopAsyncIteration
        try:
            if not self._deadline.is_set:  # the common case: no cancel scope to build
                return await self._next()
            with anyio.CancelScope(deadline=self._deadline.loop) as scope:
                return await self._next()
            assert scope.cancelled_caught
            raise self._mapper.timed_out()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """End the request now. Synchronous, idempotent, never raises.

        Sends one Abort if the engine may still be running the request (see
        the module docstring), and gives back its admission slot or ticket.
        """
        if self._done:
            return
        self._done = True
        if self._mailbox is not None:
            self._mailbox.close()  # the lifecycle's close, carried out by the mux
        else:
            self._life.close()  # not sent: nothing to carry out
        self._seam.admission.leave(held=self._holds_slot)

    # -- internals ---------------------------------------------------------------

    async def _next(self) -> Delta:
        if self._mailbox is None:
            await self._submit()
        assert self._mailbox is not None
        while True:
            outcome = self._mapper.push(await self._receive(self._mailbox))
            if outcome.error is not None:
                raise outcome.error
            if outcome.delta is not None:
                if outcome.over:
                    self.close()  # aborts a request a stop string ended
                return outcome.delta

    async def _submit(self) -> None:
        seam = self._seam
        try:
            with seam.before_engine():
                make = self._make_prompt
                prompt = make if isinstance(make, list) else await make()
                seam.check_prompt(prompt, self._params)
                if self._params.constraint is not None:
                    await seam.check_constraint(self._params.constraint)
                self.prompt_token_ids = prompt
                if not self._holds_slot:
                    await seam.admission.wait(tokens=len(prompt))
                    self._holds_slot = True  # no checkpoint between the hand-off and this
        except (EngineDeadError, MuxClosedError) as exc:
            self._raise(exc, "the LLM is closed")
        mux = seam.mux
        try:
            self._mailbox = mux.open_mailbox(self.request_id, self._params.max_tokens, self._life)
            params = self._params
            if params.stop:  # the engine never sees text
                params = msgspec.structs.replace(params, stop=())
            mux.submit(AddRequest(self.request_id, prompt, params, self._deadline.engine))
        except (EngineDeadError, MuxClosedError) as exc:
            self._raise(exc, "the LLM is closed")
        self._mapper.submitted(len(prompt))

    async def _receive(self, mailbox: Mailbox) -> RequestOutput:
        try:
            return await mailbox.get()
        except (EngineDeadError, MuxClosedError) as exc:
            # On MuxClosedError open_llm is being left; the mux queued the abort.
            self._raise(exc, "the LLM was closed while the request ran")

    def _raise(self, exc: EngineDeadError | MuxClosedError, closed: str) -> NoReturn:
        self._life.fail(engine_alive=False)  # FAILED if the mux had not failed it yet
        error = mux_error(exc, closed)
        if error is exc:
            raise exc
        raise error from None


def loop_caller() -> Callable[[Callable[[], object]], None]:
    """A thread-safe, non-blocking "run this soon on the current event loop".

    For finalizers (:meth:`RequestStream.__del__`), which may run in any
    thread and at any point of the loop thread's own code. Once the loop has
    finished, the call is dropped: what it would have cleaned up is gone
    with the loop. Call it on the event loop.
    """
    try:
        soon: Callable[[Callable[[], object]], object] = (
            asyncio.get_running_loop().call_soon_threadsafe
        )
    except RuntimeError:  # not asyncio: trio
        import trio

        soon = trio.lowlevel.current_trio_token().run_sync_soon

    def call_soon(callback: Callable[[], object]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has finished or is closed
            soon(callback)

    return call_soon
