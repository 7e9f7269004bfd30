"""The models one server serves: each one's engine, its link and its load state.

A :class:`ModelRegistry` owns one task per model that has an engine, in the
task group of :func:`open_registry`; that task alone starts the model's
engine (an :class:`~tserve.nursery._open.EngineOwner`'s ``open_llm``),
reports it ready, waits for the word to unload it or for its death, and
stops it. Its state moves by the table of ``_model_state.py``.

Requests never own an engine: :meth:`ModelRegistry.acquire` starts a load
when the model has none and waits for it. However many requests wait, one
load runs (rule 1 of ``_model_state.py``); each waiter can be cancelled,
and a load that the last of its waiters left is cancelled too, its process
stopped, so that a cancelled request leaves nothing behind. A load that
fails fails every request waiting for it with :class:`ModelLoadFailed`
naming the model; the next request starts a new load.

Which models stay loaded follows the rules of ``_residency.py``: each
model's keep-alive, ended by the registry's one timer task, and the memory
budget, applied before each load (loads are placed one at a time, in
arrival order, each waiting at most ``fit_timeout`` for room and then
failing with :class:`ModelsBusy`). Each engine's RSS is measured once it
has loaded and again whenever the budget is applied or figures are read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

import anyio
import anyio.abc

from tserve._errors import LLMError
from tserve.nursery._admission import Overload
from tserve.nursery._client import ClientSettings
from tserve.nursery._errors import Overloaded, ShuttingDown
from tserve.nursery._llm import LLM
from tserve.nursery._memory import default_memory_budget, resident_bytes, weight_bytes
from tserve.nursery._model_state import ModelLifecycle, ModelState
from tserve.nursery._open import EngineOwner
from tserve.nursery._residency import DEFAULT_KEEP_ALIVE, Occupant, expiry, plan_room
from tserve.nursery._session import unwrap
from tserve.protocol import EngineConfig

__all__ = [
    "DEFAULT_FIT_TIMEOUT",
    "ModelFigures",
    "ModelLoadFailed",
    "ModelNotServed",
    "ModelRegistry",
    "ModelSpec",
    "ModelsBusy",
    "open_models",
    "open_registry",
]

log = logging.getLogger("tserve")

DEFAULT_FIT_TIMEOUT = 30.0
"""Seconds a load waits for room in the memory budget before ModelsBusy."""


class ModelNotServed(LLMError):
    """No model of this name is served; ``names`` are the ones that are."""

    def __init__(self, name: str, names: Iterable[str]) -> None:
        self.names = tuple(names)
        super().__init__(f"The model '{name}' does not exist; served: {', '.join(self.names)}")


class ModelLoadFailed(LLMError):
    """The model's engine could not be started; ``model`` names it. A later call may retry."""

    def __init__(self, model: str, reason: str) -> None:
        super().__init__(f"the model '{model}' failed to load: {reason}")
        self.model = model
        self.reason = reason


class ModelsBusy(Overloaded):
    """No room in the memory budget to load ``model``: the models holding it
    (``busy``) stayed busy for the whole wait. Retry after ``retry_after`` s;
    an Overloaded, so the server answers 503 with ``Retry-After``."""

    def __init__(self, model: str, busy: Iterable[str], waited: float) -> None:
        self.model = model
        self.busy = tuple(busy)
        holders = ", ".join(repr(name) for name in self.busy) or "the loads ahead of it"
        super().__init__(
            f"no room to load the model '{model}' in the memory budget: "
            f"{holders} stayed busy for {waited:g} s",
            retry_after=max(1.0, waited),  # no sooner than they have already held it
        )


@dataclasses.dataclass(frozen=True, slots=True)
class ModelSpec:
    """One served model: the name requests use, its engine, its embedding engine if any."""

    name: str
    config: EngineConfig
    embedding_model: str | None = None


class _Load:
    """One load of one model, as its waiters see it."""

    def __init__(self) -> None:
        self.done = anyio.Event()  # set once the model is LOADED, FAILED or the load cancelled
        self.error: str | None = None  # why it failed; None if it loaded (or was cancelled)
        # Callers in acquire() waiting for it; the last one to leave early cancels it.
        # Bound: one per waiting call (each holds its own task).
        self.waiters = 0
        self.pinned = False  # a preload or an admin load: runs to its end with no waiter
        self.scope = anyio.CancelScope()  # the owner task's, cancelled to cancel the load


class _Model:
    """One model's engine slot: its spec, lifecycle, current load and its LLM when LOADED."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.life = ModelLifecycle(spec.name)
        self.llm: LLM | None = None  # set exactly while LOADED
        self.load: _Load | None = None  # the load under way, or the last one
        self.release = anyio.Event()  # set, with the move to UNLOADING, to stop the engine
        # Calls inside use() on this model's LLM; unload() waits for 0 (never
        # under a request). Bound: one per caller task. ``idle`` is set while 0.
        self.in_flight = 0
        self.idle = anyio.Event()
        self.idle.set()
        self.gone = anyio.Event()  # set when its owner task has ended (no process)
        self.gone.set()
        self.load_seconds = 0.0  # the last load's duration
        # Residency (rules of _residency.py). ``keep_alive``: the latest call's (rule 1).
        self.keep_alive = DEFAULT_KEEP_ALIVE
        self.last_used = -math.inf  # loop clock: its last acquire, or its last use block's end
        # Its engines' RSS while it has a process (LOADED, UNLOADING), else 0;
        # while LOADING, what the budget counts for it (rule 3's estimate).
        self.resident_bytes = 0
        self.estimate: int | None = None  # the RSS measured in its last residency
        self.weights: int | None = None  # its weights' bytes on disk, once looked up

    @property
    def held(self) -> bool:
        """Requests in flight, or callers about to receive it from its load: not idle."""
        return self.in_flight > 0 or (self.load is not None and self.load.waiters > 0)


@dataclasses.dataclass(frozen=True, slots=True)
class ModelFigures:
    """One model's figures at one moment, for metrics. Times are Unix times."""

    name: str
    state: ModelState
    loads: int  # loads that reached LOADED
    unloads: int  # LOADED engines that stopped (asked to, idle, evicted, or dead)
    load_seconds: float  # the last load's duration; 0.0 before any
    resident_bytes: int  # its engines' RSS now; 0 with no engine (LOADING: its estimate)
    in_flight: int  # use() blocks inside it now
    keep_alive: float  # seconds idle before it is unloaded; negative: pinned
    last_used: float | None  # its last acquire or use block's end; None before any
    expires_at: float | None  # when its keep-alive unloads it if it stays idle; None if not due


class ModelRegistry:
    """The served models by name. Create with :func:`open_registry`; call from its event loop.

    ``keep_alive``: the default of rule 1 of ``_residency.py``, in seconds
    (negative: pinned). ``memory_budget``: bytes of RSS that the models'
    engines may hold together (None: ``DEFAULT_BUDGET_FRACTION`` of the
    machine's memory). ``fit_timeout``: seconds a load waits for room.
    """

    def __init__(
        self,
        owner: EngineOwner,
        specs: Iterable[ModelSpec],
        tg: anyio.abc.TaskGroup,
        *,
        keep_alive: float = DEFAULT_KEEP_ALIVE,
        memory_budget: int | None = None,
        fit_timeout: float = DEFAULT_FIT_TIMEOUT,
    ) -> None:
        if math.isnan(keep_alive):
            raise ValueError("keep_alive must be a number of seconds, not NaN")
        if memory_budget is not None and memory_budget <= 0:
            raise ValueError(f"memory_budget must be > 0 bytes, not {memory_budget}")
        if not fit_timeout > 0:
            raise ValueError(f"fit_timeout must be > 0 seconds, not {fit_timeout}")
        self._owner = owner
        self._tg = tg
        self._keep_alive = keep_alive
        self._budget = default_memory_budget() if memory_budget is None else memory_budget
        self._fit_timeout = fit_timeout
        self._models: dict[str, _Model] = {}
        for spec in specs:
            if spec.name in self._models:
                raise ValueError(f"two models are named {spec.name!r}")
            self._models[spec.name] = _Model(spec)
            self._models[spec.name].keep_alive = keep_alive
        if not self._models:
            raise ValueError("a registry needs at least one model")
        self._closed = False
        self._placing = anyio.Lock()  # one load placed at a time, first come first served
        self._waiting = 0  # calls in _place; bound: one per calling task
        # Set and replaced whenever a model goes idle, loads or is gone, or a keep-alive
        # changes: what the keep-alive timer and loads waiting for room wait on.
        self._changed = anyio.Event()
        # Rule 3's engine floor: the least RSS beyond its weights of any engine
        # measured right after its load; None until one was.
        self._floor: int | None = None
        tg.start_soon(self._expire_idle, name="model keep-alive")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._models)

    @property
    def memory_budget(self) -> int:
        """Bytes of RSS the models' engines may hold together (rules 4-5 of ``_residency.py``)."""
        return self._budget

    @property
    def waiting_for_room(self) -> int:
        """Calls whose load waits to be placed now: in line, or for room in the budget."""
        return self._waiting

    @property
    def keep_alive(self) -> float:
        """The default keep-alive in seconds, for calls that give none (negative: pinned)."""
        return self._keep_alive

    def state(self, name: str) -> ModelState:
        return self._model(name).life.state

    def lifecycle(self, name: str) -> ModelLifecycle:
        """The model's lifecycle (state, failure reason, load and unload counts); read only."""
        return self._model(name).life

    def loaded(self, name: str) -> LLM | None:
        """The model's LLM if it is LOADED now, else None. Not a checkpoint."""
        return self._model(name).llm

    def specs(self) -> Mapping[str, ModelSpec]:
        return {name: model.spec for name, model in self._models.items()}

    def figures(self, name: str) -> ModelFigures:
        """The model's figures now, its RSS measured afresh. Not a checkpoint."""
        model = self._model(name)
        self._measure(model)
        now, wall = anyio.current_time(), time.time()
        due = self._expiry(model)
        return ModelFigures(
            name=name,
            state=model.life.state,
            loads=model.life.loads,
            unloads=model.life.unloads,
            load_seconds=model.load_seconds,
            resident_bytes=model.resident_bytes,
            in_flight=model.in_flight,
            keep_alive=model.keep_alive,
            last_used=None if model.last_used == -math.inf else wall - (now - model.last_used),
            expires_at=None if due is None else wall + (due - now),
        )

    def _model(self, name: str) -> _Model:
        model = self._models.get(name)
        if model is None:
            raise ModelNotServed(name, self._models)
        return model

    async def acquire(
        self, name: str, *, pin: bool = False, keep_alive: float | None = None
    ) -> LLM:
        """The model's LLM, loading it first if it has no engine. A checkpoint.

        ``keep_alive`` (seconds; 0: unload once idle; negative: pinned; None:
        the registry's default) becomes the model's, as the latest call's
        (rule 1 of ``_residency.py``). The LLM returned is not held: an idle
        model may be unloaded under a caller that keeps it past its
        keep-alive; :meth:`use` holds it.

        Blocks while the model loads or unloads; the load's own bound
        (``startup_timeout`` of the registry's client settings) bounds the
        wait. A load first waits for room in the memory budget, unloading
        idle models least recently used first (rules 4-5), at most
        ``fit_timeout`` s: ModelsBusy when the models holding the budget
        stayed busy. Cancellable: a cancelled call leaves the load to the
        others waiting for it, and cancels it when it was the last (``pin``:
        this load runs to its end whoever leaves, for a preload). Raises
        ModelNotServed, ModelLoadFailed naming the model and the reason,
        ModelsBusy, ShuttingDown once the registry is closing.
        """
        model = self._model(name)
        if keep_alive is not None and math.isnan(keep_alive):
            raise ValueError("keep_alive must be a number of seconds, not NaN")
        keep = self._keep_alive if keep_alive is None else keep_alive
        if keep != model.keep_alive:
            model.keep_alive = keep
            self._notify()  # a shorter keep-alive may be due sooner
        while True:
            if self._closed:
                raise ShuttingDown("the server is shutting down")
            state = model.life.state
            if state is ModelState.LOADED:
                assert model.llm is not None
                # A later expiry: the timer wakes at the earlier one and looks again.
                model.last_used = anyio.current_time()
                return model.llm
            if state is ModelState.UNLOADING:
                await model.gone.wait()
                continue
            if state in (ModelState.UNLOADED, ModelState.FAILED):
                await model.gone.wait()  # a dead engine is reaped before the next load
                if model.life.state in (ModelState.UNLOADED, ModelState.FAILED):
                    await self._place(model)
                continue
            load = model.load
            assert load is not None
            load.pinned = load.pinned or pin
            await self._wait_for(load)
            if load.error is not None:
                raise ModelLoadFailed(name, load.error)

    async def _wait_for(self, load: _Load) -> None:
        load.waiters += 1
        try:
            await load.done.wait()
        finally:
            load.waiters -= 1
            if not load.done.is_set() and load.waiters == 0 and not load.pinned:
                load.scope.cancel()  # nobody wants it any more

    async def _place(self, model: _Model) -> None:
        """Start ``model``'s load once the budget has room for it (rules 3-5 of
        ``_residency.py``), unloading idle models for it and waiting until
        they are gone. Returns early if another call moved the model on.

        Waits in line behind other loads being placed, then for a busy model
        to go idle, at most ``fit_timeout`` s in all: ModelsBusy. Waiting for
        the models it unloads to stop is bounded by their stop bound instead.
        Cancellable; models already unloaded for it stay unloaded.
        """
        if model.weights is None:
            model.weights = await anyio.to_thread.run_sync(_model_weights, model.spec)
        deadline = anyio.current_time() + self._fit_timeout
        self._waiting += 1
        try:
            in_line = False
            with anyio.move_on_at(deadline):
                await self._placing.acquire()
                in_line = True
            if in_line:
                try:
                    if await self._place_when_room(model, deadline):
                        return
                finally:
                    self._placing.release()
        finally:
            self._waiting -= 1
        holders = (m for m in self._models.values() if m is not model and m.resident_bytes)
        busy = [m.spec.name for m in holders if m.held or m.life.state is not ModelState.LOADED]
        raise ModelsBusy(model.spec.name, busy, self._fit_timeout)

    async def _place_when_room(self, model: _Model, deadline: float) -> bool:
        """:meth:`_place`'s loop, under its lock: plan; unload the idle models the
        plan names and wait until they are gone, or wait (until ``deadline``:
        then False) for a change; until the load starts or another call has
        moved the model on (True)."""
        name = model.spec.name
        while model.life.state in (ModelState.UNLOADED, ModelState.FAILED):
            changed = self._changed
            need = self._estimate(model)
            others = [self._occupant(m) for m in self._models.values() if m is not model]
            victims = plan_room(need, self._budget, others)
            if victims is None:
                with anyio.move_on_at(deadline) as waiting:
                    await changed.wait()
                if waiting.cancelled_caught:
                    return False
            elif not victims:
                if need > self._budget:
                    log.warning("model %r: %d bytes, over the budget: loads alone", name, need)
                self._start_load(model, need)
                return True
            else:
                for victim in victims:
                    log.info("model %r unloaded to make room for %r", victim, name)
                    self._release(self._models[victim])
                for victim in victims:
                    await self._models[victim].gone.wait()
        return True

    def _estimate(self, model: _Model) -> int:
        """Rule 3 of ``_residency.py``: what ``model`` will hold once loaded."""
        if model.estimate is not None:
            return model.estimate
        return (model.weights or 0) + (self._floor or 0)

    def _occupant(self, model: _Model) -> Occupant:
        """``model`` as the budget sees it (rule 2), its RSS measured afresh."""
        self._measure(model)
        evictable = model.life.state is ModelState.LOADED and not model.held
        return Occupant(model.spec.name, model.resident_bytes, evictable, model.last_used)

    @staticmethod
    def _measure(model: _Model) -> None:
        """Read the RSS of ``model``'s engines while it is LOADED; an engine
        that has just died (0 bytes) leaves the last figure."""
        llm = model.llm
        if llm is None or model.life.state is not ModelState.LOADED:
            return
        pids = [llm.engine_pid] + ([] if llm.embedder is None else [llm.embedder.engine_pid])
        if measured := sum(resident_bytes(pid) for pid in pids):
            model.resident_bytes = model.estimate = measured

    def _start_load(self, model: _Model, estimate: int) -> None:
        model.life.load()
        model.load = _Load()
        model.release = anyio.Event()
        model.gone = anyio.Event()
        model.resident_bytes = estimate  # what it counts while LOADING (rule 2)
        self._tg.start_soon(self._own, model, model.load, name=f"model {model.spec.name}")

    def _release(self, model: _Model) -> None:
        """Move a LOADED ``model`` to UNLOADING and tell its owner task to stop it."""
        model.life.unload()
        model.release.set()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def _own(self, model: _Model, load: _Load) -> None:
        """The one task that owns ``model``'s engine, from its start to its exit."""
        life, spec = model.life, model.spec
        started = time.monotonic()
        try:
            with load.scope:
                try:
                    opened = self._owner.open_llm(
                        spec.config, spec.embedding_model, freeze_gc=False
                    )
                    async with opened as llm:
                        model.load_seconds = time.monotonic() - started
                        model.llm = llm
                        life.loaded()
                        self._loaded(model)
                        load.done.set()
                        self._notify()
                        log.info("model %r loaded in %.1f s", spec.name, model.load_seconds)
                        reason = await self._serve_until_released(model, llm)
                        model.llm = None
                        if life.state is ModelState.LOADED:  # died (unload() moves it first)
                            life.fail(reason or "the engine stopped")
                            log.error("model %r: its engine died (%s)", spec.name, reason)
                except Exception as exc:
                    if life.state is ModelState.LOADING:  # a bad file, an engine that exits
                        load.error = str(exc)
                        life.fail(load.error)
                        log.error("model %r failed to load: %s", spec.name, exc)
                    elif life.state is not ModelState.FAILED or not isinstance(exc, LLMError):
                        raise  # a bug, not the engine's death
        finally:
            self._settle(model, load)

    def _loaded(self, model: _Model) -> None:
        """A fresh engine's figures: its RSS, the engine floor (rule 3), its
        keep-alive's start; then, if its estimate was short and the budget is
        now exceeded, the idle models that make it fit are unloaded (rule 5)."""
        self._measure(model)
        beyond = max(0, model.resident_bytes - (model.weights or 0))
        self._floor = beyond if self._floor is None else min(self._floor, beyond)
        model.last_used = anyio.current_time()
        others = [self._occupant(m) for m in self._models.values() if m is not model]
        victims = plan_room(model.resident_bytes, self._budget, others)
        if victims is None:
            log.warning("models over the memory budget of %d bytes while busy", self._budget)
        for name in victims or ():
            log.info("model %r unloaded: %r needed more room", name, model.spec.name)
            self._release(self._models[name])

    def _settle(self, model: _Model, load: _Load) -> None:
        """The owner task's last step: its engine is gone, whichever way it ended."""
        life = model.life
        model.llm = None
        model.resident_bytes = 0
        if life.state is ModelState.LOADING:  # cancelled: nobody waited, or shutdown
            life.cancel()
            log.info("model %r: load cancelled", model.spec.name)
        elif life.state is ModelState.LOADED:  # the registry closed
            life.unload()
        if life.state is ModelState.UNLOADING or (
            life.state is ModelState.FAILED and load.error is None  # a dead engine, reaped
        ):
            life.unloaded()
        load.done.set()
        model.gone.set()
        self._notify()

    @staticmethod
    async def _serve_until_released(model: _Model, llm: LLM) -> str | None:
        """Block until ``model`` is released (None) or its engine dies (the reason)."""
        reason: str | None = None
        async with anyio.create_task_group() as tg:

            async def death() -> None:
                nonlocal reason
                reason = await llm.wait_engine_dead()
                tg.cancel_scope.cancel()

            tg.start_soon(death)
            await model.release.wait()
            tg.cancel_scope.cancel()
        return reason

    def _expiry(self, model: _Model) -> float | None:
        """When the keep-alive timer unloads ``model`` (loop clock); None if not due."""
        if model.life.state is not ModelState.LOADED or model.held:
            return None
        return expiry(model.last_used, model.keep_alive)

    async def _expire_idle(self) -> None:
        """The registry's one keep-alive timer (rule 1 of ``_residency.py``):
        unloads each idle model whose keep-alive has passed. Sleeps until the
        next one is due or a model's residency changes; runs until the
        registry's task group is cancelled."""
        while True:
            changed = self._changed
            now, due = anyio.current_time(), math.inf
            for model in self._models.values():
                at = self._expiry(model)
                if at is not None and at <= now:
                    log.info("model %r unloaded after its keep-alive", model.spec.name)
                    self._release(model)
                elif at is not None:
                    due = min(due, at)
            with anyio.move_on_at(due):
                await changed.wait()

    @contextlib.asynccontextmanager
    async def use(self, name: str, *, keep_alive: float | None = None) -> AsyncIterator[LLM]:
        """The model's LLM for the block, loaded first as :meth:`acquire` does
        (its rules, bounds and errors; ``keep_alive`` as it takes it); the
        model is not unloaded while any block is inside, and its keep-alive
        runs from the end of the last one. Leaving it is synchronous."""
        llm = await self.acquire(name, keep_alive=keep_alive)
        model = self._models[name]
        model.in_flight += 1
        model.idle = anyio.Event() if model.in_flight == 1 else model.idle
        try:
            yield llm
        finally:
            model.in_flight -= 1
            model.last_used = anyio.current_time()
            if model.in_flight == 0:
                model.idle.set()
                self._notify()

    def in_flight(self, name: str) -> int:
        """Blocks inside :meth:`use` for the model now."""
        return self._model(name).in_flight

    async def unload(self, name: str) -> None:
        """Stop the model's engine if it has one; return once it is gone. A checkpoint.

        Never under a request: waits, cancellably, until no block of
        :meth:`use` holds the model (without bound: it is the requests'
        bounds that end them). A load under way is cancelled. Then blocks at
        most the engine's stop bound (``shutdown_grace`` + the SIGTERM and
        SIGKILL fallbacks).
        """
        model = self._model(name)
        while model.life.state is ModelState.LOADED and model.in_flight:
            await model.idle.wait()
        state = model.life.state
        if state is ModelState.LOADED:  # idle: no checkpoint since the check above
            self._release(model)
        elif state is ModelState.LOADING and model.load is not None:
            model.load.scope.cancel()
        await model.gone.wait()

    def close(self) -> None:
        """Refuse every later acquire with ShuttingDown. Synchronous."""
        self._closed = True


def _model_weights(spec: ModelSpec) -> int:
    """What the model's engines load from disk (rule 3 of ``_residency.py``). Blocks (stats)."""
    paths = [spec.config.model, spec.embedding_model]
    return sum(weight_bytes(path) for path in paths if path is not None and path != "default")


@contextlib.asynccontextmanager
async def open_models(
    models: Mapping[str, str | os.PathLike[str]],
    *,
    preload: Iterable[str] = (),
    keep_alive: float = DEFAULT_KEEP_ALIVE,
    memory_budget: int | None = None,
    fit_timeout: float = DEFAULT_FIT_TIMEOUT,
    max_pending: int = 1024,
    overload: str = "wait",
    max_queued: int = 0,
    max_queued_tokens: int | None = None,
    request_timeout: float | None = None,
    startup_timeout: float = 600.0,
    heartbeat_timeout: float = 30.0,
    shutdown_grace: float = 5.0,
    log_level: str = "INFO",
    **engine_options: Any,
) -> AsyncIterator[ModelRegistry]:
    """Serve several models, each loaded on first use: :func:`tserve.open_llm` for many.

    ``models`` maps the name a caller uses to a model (a directory, a .gguf
    file, or "default"); every model's engine gets ``engine_options`` and
    each LLM the admission bounds that :func:`tserve.open_llm` describes
    (per model: ``max_pending`` requests of each run at once). Yields the
    :class:`ModelRegistry`::

        async with tserve.open_models({"a": "a.gguf", "b": "b/"}) as models:
            async with models.use("a") as llm:  # loads "a" unless loaded
                print((await llm.complete("Hello")).text)

    ``use`` and ``acquire`` load a model that has no engine, and wait for it
    (cancellably; bound: ``startup_timeout``); any number of concurrent
    first calls cause one load; a failed load raises ModelLoadFailed naming
    the model, and the next call retries. ``unload`` stops a model's engine,
    never while a ``use`` block holds it. ``preload`` names are loaded
    before the block is entered. One engine's death fails only its own
    model's requests; its next call loads it again. Leaving the block in any
    way stops every engine. Runs on asyncio and trio.

    Residency (the rules of ``tserve.nursery._residency``): a model idle
    for ``keep_alive`` seconds is unloaded (0: as soon as it is idle;
    negative: never); ``use(name, keep_alive=...)`` overrides it, the
    latest call's value winning (:func:`tserve.nursery.parse_keep_alive`
    reads Ollama's forms). ``memory_budget`` bytes (None: 75% of the
    machine's memory) bound the engines' measured RSS together: before a
    load that would exceed it, idle models are unloaded least recently used
    first; when busy models hold the room, the load waits for one to go
    idle, cancellably and at most ``fit_timeout`` s, then raises ModelsBusy
    (an Overloaded, with ``retry_after``). A model in a ``use`` block is
    never unloaded; a model larger than the whole budget loads alone, once
    every other has been unloaded. The budget counts host memory only (RSS),
    not a GPU's.
    """
    settings = ClientSettings(
        max_pending=max_pending,
        request_timeout=request_timeout,
        startup_timeout=startup_timeout,
        heartbeat_timeout=heartbeat_timeout,
        overload=Overload(overload),
        max_queued=max_queued,
        max_queued_tokens=max_queued_tokens,
    )
    specs = [  # TypeError for an unknown option, before any engine starts
        ModelSpec(name, EngineConfig(model=os.fspath(model), **engine_options))
        for name, model in models.items()
    ]
    owner = EngineOwner(settings, shutdown_grace=shutdown_grace, log_level=log_level)
    async with open_registry(
        owner,
        specs,
        preload=preload,
        keep_alive=keep_alive,
        memory_budget=memory_budget,
        fit_timeout=fit_timeout,
    ) as registry:
        yield registry


@contextlib.asynccontextmanager
async def open_registry(
    owner: EngineOwner,
    specs: Iterable[ModelSpec],
    *,
    preload: Iterable[str] = (),
    keep_alive: float = DEFAULT_KEEP_ALIVE,
    memory_budget: int | None = None,
    fit_timeout: float = DEFAULT_FIT_TIMEOUT,
) -> AsyncIterator[ModelRegistry]:
    """A :class:`ModelRegistry` of ``specs`` for the block, ``preload`` loaded first.

    Enters once every preloaded model is LOADED (ModelNotServed for a name
    it does not serve, ModelLoadFailed if one fails, ModelsBusy if they do
    not fit the budget together, with nothing left running). ``keep_alive``
    (seconds; 0: unload once idle; negative: pinned), ``memory_budget``
    (bytes of engine RSS; None: ``DEFAULT_BUDGET_FRACTION`` of the
    machine's memory) and ``fit_timeout`` (seconds a load waits for room)
    are the registry's residency rules (``_residency.py``). Leaving the
    block in any way stops every engine (all at once; shielded, each within
    its stop bound). An exception from the block propagates unchanged (not
    in an ExceptionGroup).
    """
    specs = list(specs)
    body_error: BaseException | None = None
    try:
        async with anyio.create_task_group() as tg:
            registry = ModelRegistry(
                owner,
                specs,
                tg,
                keep_alive=keep_alive,
                memory_budget=memory_budget,
                fit_timeout=fit_timeout,
            )
            try:
                await _preload(registry, preload)
                try:
                    yield registry
                except BaseException as exc:
                    body_error = exc
                    raise
            finally:
                registry.close()
                tg.cancel_scope.cancel()  # each owner task stops its engine on the way out
    except BaseExceptionGroup as group:
        error = unwrap(group, body_error)
        if error is group:
            raise
    else:
        return
    raise error


async def _preload(registry: ModelRegistry, names: Iterable[str]) -> None:
    """Load ``names`` at once; raise the first failure once all are done."""
    names = list(dict.fromkeys(names))
    for name in names:
        registry.lifecycle(name)  # ModelNotServed before any load starts
    failures: list[ModelLoadFailed] = []

    async def load(name: str) -> None:
        try:
            await registry.acquire(name, pin=True)
        except ModelLoadFailed as exc:
            failures.append(exc)

    async with anyio.create_task_group() as loads:
        for name in names:
            loads.start_soon(load, name)
    if failures:
        raise failures[0]
