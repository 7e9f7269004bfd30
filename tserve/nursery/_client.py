"""What every client of an engine shares: :class:`EngineClient` and its settings.

A client (``LLM``, ``Embedder``) stands for one engine behind one mux (an
:class:`~tserve.nursery._session.EngineSession`): its identity (model, pid,
socket address), whether it is alive, request ids, and admission: the
refusal of new work once the engine is dead or the client closed, and the
client's :class:`~tserve.nursery._admission.Admission` (slots and queue);
and the engine's death as the end of every call still on its way to the
engine (:meth:`EngineClient.before_engine`): the calls in the engine fail
through their mailboxes, these by a cancel, in the same tick.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Iterator

import anyio

from tserve.mux import EngineDeadError
from tserve.nursery._admission import Admission, Overload
from tserve.nursery._errors import InvalidRequest, ShuttingDown
from tserve.nursery._session import EngineSession

__all__ = ["ClientSettings", "EngineClient"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ClientSettings:
    """A client's bounds, one object for every entry of ``_open.py`` (see
    :func:`tserve.open_llm` for what each does); the defaults are ``open_llm``'s."""

    max_pending: int = 1024  # running units at once; >= 1
    request_timeout: float | None = None  # s; None: no deadline
    startup_timeout: float = 600.0  # s the engine gets to become ready
    heartbeat_timeout: float = 30.0  # s of engine silence that count as its death
    overload: Overload = Overload.WAIT  # what a unit finding no free slot does
    max_queued: int = 0  # RAISE mode: units that may wait for a slot
    max_queued_tokens: int | None = None  # RAISE mode: their prompt tokens; None: no bound

    def __post_init__(self) -> None:
        if self.max_pending < 1:
            raise ValueError("max_pending must be at least 1")
        if self.max_queued < 0:
            raise ValueError("max_queued must not be negative")

    def admission(self, noun: str) -> Admission:
        """A new :class:`Admission` with these bounds; ``noun`` names its unit."""
        return Admission(
            self.max_pending,
            self.overload,
            max_queued=self.max_queued,
            max_queued_tokens=self.max_queued_tokens,
            noun=noun,
        )


class EngineClient:
    """One engine behind one mux, for a subclass to serve requests through.

    Each subclass names itself in ``_dead`` and ``_closed`` and its unit in
    ``_noun``, and admits with :meth:`_check_running`, :meth:`_check_room`
    and ``self.admission``.
    """

    _dead = "the engine is dead"  # EngineDeadError's message when the mux has none
    _closed = "the engine client is closed"  # ShuttingDown's message once the mux stopped
    _noun = "requests"  # what one admitted unit is, for Overloaded's message

    def __init__(self, session: EngineSession, settings: ClientSettings, *, id_prefix: str) -> None:
        self.session = session  # what engine_session's depends_on takes
        self._mux = session.mux
        self._engine = session.engine
        self._mux_done = session.done  # set when the mux stopped (engine dead or closed)
        self.ready = session.mux.ready
        self.request_timeout = settings.request_timeout
        self.admission = settings.admission(self._noun)
        self._ids = itertools.count()
        self._id_prefix = id_prefix
        # The scopes of calls on their way to the engine (before_engine);
        # its death cancels them. Bound: one per live or queued unit, which
        # admission caps.
        self._on_the_way: set[anyio.CancelScope] = set()
        self._mux.death_listeners.append(self._engine_died)

    @property
    def max_pending(self) -> int:
        """Units that run at once (see :class:`~tserve.nursery._admission.Admission`)."""
        return self.admission.max_pending

    @max_pending.setter
    def max_pending(self, value: int) -> None:
        self.admission.max_pending = value

    @property
    def model(self) -> str:
        return self.ready.model

    @property
    def engine_alive(self) -> bool:
        """False once the engine is known to be dead, or the client closed; never True again."""
        return not (self._mux.dead or self._mux_done.is_set())

    @property
    def engine_dead_reason(self) -> str | None:
        return self._mux.dead_reason

    @property
    def engine_pid(self) -> int:
        """The engine's process on this host: what :func:`attach_llm` takes.
        ValueError for an engine reached by address alone (``tserve engine``)."""
        if self._engine.pid is None:
            raise ValueError(f"the engine at {self._engine.address} is no process of this host")
        return self._engine.pid

    @property
    def engine_address(self) -> str:
        """The engine's socket address: what :func:`attach_llm` (or ``attach_embedder``) takes."""
        return self._engine.address

    def kill_engine(self) -> None:
        """SIGKILL the engine process: for fault-injection tests and drills
        (ValueError for an engine that is not a process of this host)."""
        self._engine.kill()

    @contextlib.contextmanager
    def before_engine(self) -> Iterator[None]:
        """Run the block, a call's awaits before it reaches the engine
        (tokenizing, waiting for a slot); the engine's death ends it at once
        with EngineDeadError, by cancelling what it awaits. Synchronous to
        enter and leave. Work already running in a worker thread finishes
        there first; its result is dropped.
        """
        self._check_running()
        scope = anyio.CancelScope()
        self._on_the_way.add(scope)
        try:
            with scope:
                yield
        finally:
            self._on_the_way.discard(scope)
        if scope.cancel_called:  # the engine died: whatever the block did is moot
            raise EngineDeadError(self._mux.dead_reason or self._dead)

    def _engine_died(self, reason: str) -> None:
        """The mux's death listener: end every call on its way (see before_engine)."""
        for scope in self._on_the_way:
            scope.cancel()

    def _check_running(self) -> None:
        """Raise EngineDeadError if the engine is dead, ShuttingDown if the client is closed."""
        if self._mux.dead:
            raise EngineDeadError(self._mux.dead_reason or self._dead)
        if self._mux_done.is_set():
            raise ShuttingDown(self._closed)

    def _check_room(self, count: int, *, too_many: str, param: str) -> None:
        """Raise InvalidRequest(``too_many``, ``param``) when ``count`` units exceed
        ``max_pending`` itself, Overloaded when admission would refuse them now."""
        if count > self.max_pending:
            raise InvalidRequest(too_many, param=param)
        self.admission.check(count)

    def _next_request_id(self) -> str:
        return f"{self._id_prefix}-{next(self._ids)}"
