"""The multiplexer: one task owns the API process's only socket to the engine.

Every request in the API process reaches the engine through here:

* The request task opens a :class:`Mailbox` (``open_mailbox``), hands the mux
  an ``AddRequest`` (``submit``), reads its mailbox, and on any way out calls
  ``abort`` / ``Mailbox.close``. All of these are synchronous and never block;
  the bookkeeping behind them is the sans-IO :class:`Router` (``_router.py``).
* The mux's sender sends every add and abort pending in its inbox as ONE
  ``EngineInput`` frame; its receiver routes each ``RequestOutput`` of every
  ``StepOutputs`` frame to the mailbox of its request id.
* Engine death (an ``EngineDead`` message, silence longer than the heartbeat
  timeout, a malformed frame, or ``engine_died`` from whoever watches the
  process) fails every open mailbox at once with ``EngineDeadError``, calls
  the ``death_listeners`` and ends the mux; later submits raise it.

The socket is a DEALER connected to the engine's ROUTER (which uses
``ROUTER_MANDATORY``). Its SNDHWM and RCVHWM are finite (``hwm`` frames): at
the send bound the sender waits (submits keep accumulating in the inbox and go
out in the next frame); at the receive bound the engine coalesces. Nothing is
dropped anywhere. An engine reached by address alone (a :class:`Link`: CURVE,
heartbeats, a monitor whose events can be its death) also sends the model's
tokenizer files in the handshake (:attr:`Mux.tokenizer_bundle`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import zmq
from anyio.abc import TaskStatus

from tserve.mux._errors import EngineDeadError, MuxClosedError, MuxError
from tserve.mux._heartbeat import SilenceClock, watch_silence
from tserve.mux._lifecycle import Lifecycle
from tserve.mux._link import Link, engine_socket, watch_link
from tserve.mux._mailbox import Mailbox
from tserve.mux._router import Router
from tserve.mux._zmqio import ZmqChannel
from tserve.protocol import (
    AddRequest,
    EngineDead,
    EngineReady,
    EngineStats,
    Heartbeat,
    Hello,
    ProtocolError,
    Shutdown,
    StepOutputs,
    TokenizerBundle,
    decode,
    encode,
)

__all__ = ["Mux", "MuxStats"]

_FromEngine = EngineReady | StepOutputs | Heartbeat | EngineDead | TokenizerBundle


@dataclass(slots=True)
class MuxStats:
    """Counters since the mux started; the mux updates them in place."""

    frames_sent: int = 0
    frames_received: int = 0
    adds_sent: int = 0
    aborts_sent: int = 0
    deltas_routed: int = 0
    unknown_deltas: int = 0  # for ids already finished, aborted or closed


class Mux:
    """The one owner of the API process's socket to the engine.

    Run it with ``await task_group.start(mux.run, address)`` (or ``open_mux``);
    it is ready once the engine answered ``Hello`` with ``EngineReady``. All
    methods other than :meth:`run` and :meth:`wait_ready` are synchronous and
    never block, so a request's ``finally`` can call them without an await.
    ``hwm`` is the socket's SNDHWM and RCVHWM in frames; ``heartbeat_timeout``
    is how long silence from a ready engine may last before it is declared
    dead (the engine's silence, not the event loop's: see ``_heartbeat.py``);
    ``ready_timeout`` bounds the wait for ``EngineReady``. ``link``: the engine
    is reached by address alone (``_link.py``).
    """

    def __init__(
        self,
        *,
        heartbeat_timeout: float = 10.0,
        ready_timeout: float = 600.0,
        hwm: int = 1000,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        link: Link | None = None,
        grammars: bool = False,
    ) -> None:
        if heartbeat_timeout <= 0 or ready_timeout <= 0 or hwm < 1:
            raise ValueError("heartbeat_timeout, ready_timeout and hwm must be positive")
        self.address = ""  # set by run
        self._ready_timeout = ready_timeout
        self._hwm = hwm
        self._context = context
        self._link = link
        self._grammars = grammars  # Hello asks the engine to prepare grammars
        # With a link: the model's tokenizer files, from the handshake, until taken.
        self.tokenizer_bundle: TokenizerBundle | None = None
        self.stats = MuxStats()
        self.engine_stats = EngineStats()  # the latest, from a step or heartbeat
        self._ready: EngineReady | None = None
        self._ready_changed: anyio.Event | None = None  # ready, dead or closed
        self._dead_reason: str | None = None
        self._closed = False
        self._started = False
        self._scope: anyio.CancelScope | None = None
        # The engine's silence from when it is ready (rules in _heartbeat.py);
        # its max_lateness and excused say how late the event loop has been.
        self.silence = SilenceClock(heartbeat_timeout, 0.0)
        # Open mailboxes and the inbox (bounds stated in _router.py).
        self._router = Router(self._wake_sender)
        self._shutdown: Shutdown | None = None  # sent after the last input
        self._sender_wakeup: anyio.Event | None = None  # set iff the sender waits
        # Called by engine_died with the reason, in the same tick: one engine's
        # death can be another's with no task switch. They never block or raise.
        self.death_listeners: list[Callable[[str], object]] = []

    @property
    def ready(self) -> EngineReady:
        """The engine's ``EngineReady``. Raises MuxError before the handshake."""
        if self._ready is None:
            raise MuxError("the engine has not answered Hello yet")
        return self._ready

    @property
    def dead(self) -> bool:
        """True once the engine is known to be dead; it never becomes False."""
        return self._dead_reason is not None

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    @property
    def open_mailboxes(self) -> int:
        return len(self._router)

    def open_mailbox(
        self, request_id: str, max_tokens: int, lifecycle: Lifecycle | None = None
    ) -> Mailbox:
        """Register a mailbox for ``request_id``; outputs for it go there.

        ``lifecycle``: the request's own (new, for the same ``max_tokens``),
        for a caller that tracks the request from before it has a mailbox;
        else the mailbox makes one. Raises EngineDeadError / MuxClosedError
        when the mux cannot deliver, MuxError when the id is already open.
        """
        self._check_usable()
        return self._router.open(request_id, max_tokens, lifecycle)

    def submit(self, request: AddRequest) -> None:
        """Queue ``request`` for the engine; it goes out with the next frame.

        Its mailbox must be open and not yet submitted (else MuxError).
        Never blocks. Raises EngineDeadError / MuxClosedError when the mux
        cannot deliver. A request that cannot cross the wire intact (see
        ``wire_problem``) is not sent: its mailbox gets one
        ``FinishReason.ERROR`` output.
        """
        self._check_usable()
        self._router.submit(request)

    def abort(self, request_id: str) -> None:
        """Ask the engine to stop ``request_id``; it ends with FinishReason.ABORT.

        Synchronous, never blocks, never raises: safe in a ``finally``.
        Idempotent; harmless for an id that is unknown, finished, closed, or
        when the engine is dead. A request not yet submitted ends at once.
        Whether an Abort is sent is its lifecycle's rule 1 (``_lifecycle.py``).
        """
        self._router.abort(request_id)

    def shutdown_engine(self, reason: str = "") -> None:
        """Ask the engine to exit, after the inputs already queued. Never blocks."""
        self._shutdown = Shutdown(reason)
        self._wake_sender()

    def engine_died(self, reason: str) -> None:
        """Declare the engine dead (e.g. its process exited); see :class:`Mux`.

        Synchronous; fails every open mailbox with EngineDeadError(reason),
        calls each of ``death_listeners`` and stops :meth:`run`. Only the first
        reason is kept. A Shutdown asked for before is still sent (best
        effort), for an engine that runs on.
        """
        if self._dead_reason is not None:
            return
        self._dead_reason = reason
        self._router.fail_all(EngineDeadError(reason), engine_dead=True)
        self._notify_ready_changed()
        if self._scope is not None:
            self._scope.cancel()
        for listener in tuple(self.death_listeners):  # one may remove itself
            listener(reason)

    def _check_usable(self) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        if self._closed:
            raise MuxClosedError("the mux has stopped")

    def _wake_sender(self) -> None:
        wakeup = self._sender_wakeup
        if wakeup is not None:
            self._sender_wakeup = None
            wakeup.set()

    async def run(
        self, address: str, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Own the socket to ``address``: say Hello, then send inputs and route outputs.

        Reports readiness through ``task_status`` once ``EngineReady`` arrived
        (see :attr:`ready`); raises EngineDeadError if it did not arrive within
        ``ready_timeout``, or the engine died first. Then runs until the
        engine dies (returns normally; :attr:`dead` is True) or until
        cancelled (open mailboxes fail with MuxClosedError; queued inputs and
        a requested shutdown are flushed without waiting). Call it once.
        """
        if self._started:
            raise MuxError("Mux.run may be called only once")
        self._started = True
        self.address = address
        context = self._context or zmq.Context.instance()
        with engine_socket(context, address, hwm=self._hwm, link=self._link) as (socket, monitor):
            try:
                channel = ZmqChannel(socket)
                async with anyio.create_task_group() as tg:
                    self._scope = tg.cancel_scope
                    tg.start_soon(channel.watch)
                    if monitor is not None and self._link is not None:
                        tg.start_soon(watch_link, monitor, self._link, address, self.engine_died)
                    if await self._handshake(channel):
                        self.silence.heard(anyio.current_time())
                        tg.start_soon(watch_silence, self.silence, channel, self.engine_died)
                        tg.start_soon(self._send_inputs, channel)
                        task_status.started()
                        await self._route_outputs(channel)
                    tg.cancel_scope.cancel()
            finally:
                self._close(socket)
        if self._ready is None:  # the engine died during the handshake
            raise EngineDeadError(self._dead_reason or "the engine died before it was ready")

    async def wait_ready(self) -> EngineReady:
        """Wait until the engine is ready and return its ``EngineReady``.

        A checkpoint. Raises EngineDeadError if the engine died first,
        MuxClosedError if the mux stopped first.
        """
        while self._ready is None:
            self._check_usable()
            if self._ready_changed is None:
                self._ready_changed = anyio.Event()
            await self._ready_changed.wait()
        await anyio.lowlevel.checkpoint()
        return self._ready

    async def _handshake(self, channel: ZmqChannel) -> bool:
        """Send Hello, wait for EngineReady (and, over a link, the tokenizer's
        files right after it). False when the engine died instead."""
        bundle = self._link is not None
        await channel.send(encode(Hello(os.getpid(), tokenizer=bundle, grammars=self._grammars)))
        self.stats.frames_sent += 1
        ready: EngineReady | None = None
        with anyio.move_on_after(self._ready_timeout):
            while self._dead_reason is None:
                message = self._decode(await channel.receive())
                if isinstance(message, EngineReady):
                    ready = message
                elif isinstance(message, TokenizerBundle):
                    self.tokenizer_bundle = message
                elif isinstance(message, EngineDead):
                    self.engine_died(message.reason)
                if ready is not None and (self.tokenizer_bundle is not None or not bundle):
                    self._ready = ready
                    self._notify_ready_changed()
                    return True
            return False
        self.engine_died(f"no EngineReady from {self.address} within {self._ready_timeout:g} s")
        return False

    def _notify_ready_changed(self) -> None:
        if self._ready_changed is not None:
            self._ready_changed.set()
            self._ready_changed = None

    async def _send_inputs(self, channel: ZmqChannel) -> None:
        """The sender: one EngineInput frame per wakeup, holding the whole inbox."""
        stats = self.stats
        while True:
            if not self._router.has_inputs and self._shutdown is None:
                wakeup = self._sender_wakeup = anyio.Event()
                await wakeup.wait()
                continue
            inputs = self._router.take_inputs()
            if inputs is not None:
                await channel.send(encode(inputs))
                stats.frames_sent += 1
                stats.adds_sent += len(inputs.adds)
                stats.aborts_sent += len(inputs.aborts)
            elif self._shutdown is not None:
                await channel.send(encode(self._shutdown))
                stats.frames_sent += 1
                self._shutdown = None

    async def _route_outputs(self, channel: ZmqChannel) -> None:
        """The receiver: route every delta to its mailbox until the engine dies."""
        stats = self.stats
        while self._dead_reason is None:
            frames = await channel.receive_batch()
            self.silence.heard(anyio.current_time())
            stats.frames_received += len(frames)
            for frame in frames:
                if not self._handle(frame):
                    return

    def _handle(self, frame: bytes) -> bool:
        """Decode one engine frame and act on it; False once the engine is dead.

        A function of its own so that each decoded step is freed once routed,
        before the next is decoded: fewer live objects for the collector.
        """
        message = self._decode(frame)
        if type(message) is StepOutputs:
            self._route(message)
        elif type(message) is Heartbeat:
            self.engine_stats = message.stats
        elif type(message) is EngineDead:
            self.engine_died(message.reason)
            return False
        elif message is None:
            return False  # malformed: engine_died was called
        return True

    def _route(self, step: StepOutputs) -> None:
        self.engine_stats = step.stats
        outputs = step.outputs
        unknown = self._router.route(outputs)
        self.stats.unknown_deltas += unknown
        self.stats.deltas_routed += len(outputs) - unknown

    def _decode(self, frame: bytes) -> _FromEngine | None:
        """Decode an engine frame; a malformed one declares the engine dead."""
        try:
            message = decode(frame)
        except ProtocolError as exc:
            self.engine_died(f"malformed frame from the engine: {exc}")
            return None
        if not isinstance(message, _FromEngine):
            self.engine_died(f"unexpected {type(message).__name__} from the engine")
            return None
        return message

    def _close(self, socket: zmq.Socket[bytes]) -> None:
        """After run: fail what is open, queue what is left (the caller closes the socket)."""
        self._closed = True
        self._scope = None
        self._notify_ready_changed()
        if self._dead_reason is None:
            self._router.fail_all(MuxClosedError("the mux stopped"), engine_dead=False)
        inputs = self._router.take_inputs()
        if self._ready is not None:
            # Best effort, without waiting: LINGER gives zmq time to deliver.
            # Inputs only to a live engine; a requested Shutdown to any (one
            # declared dead for its peer's death still runs: engine_died).
            frames = []
            if inputs is not None and self._dead_reason is None:
                frames.append(encode(inputs))
            if self._shutdown is not None:
                frames.append(encode(self._shutdown))
            for frame in frames:
                try:
                    socket.send(frame, zmq.NOBLOCK)
                except zmq.ZMQError:
                    break
        self._shutdown = None
