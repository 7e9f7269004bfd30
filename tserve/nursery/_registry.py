"""The models one server serves: each one's engine, its link and its load state.

A :class:`ModelRegistry` owns one task per model that has an engine, in the
task group of ``open_registry`` (``_open_registry.py``); that task alone
starts the model's engine (an :class:`~tserve.nursery._open.EngineOwner`'s
``open_llm``), reports it ready, waits for the word to unload it or for its
death, and stops it. Its state moves by the table of ``_model_state.py``.

Requests never own an engine: :meth:`ModelRegistry.acquire` starts a load
when the model has none and waits for it. However many requests wait, one
load runs (rule 1 of ``_model_state.py``); each waiter can be cancelled,
and a load that the last of its waiters left is cancelled too, its process
stopped, so that a cancelled request leaves nothing behind. A load that
fails fails every request waiting for it with :class:`ModelLoadFailed`
naming the model; the next request starts a new load.

Which models stay loaded follows the rules of ``_residency.py``, applied
by the registry's :class:`~tserve.nursery._keeper.Keeper`: each model's
keep-alive, and the memory budget before each load.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping

import anyio
import anyio.abc

from tserve._errors import LLMError
from tserve.nursery._errors import ShuttingDown
from tserve.nursery._keeper import DEFAULT_FIT_TIMEOUT, Keeper, ModelFigures, ModelsBusy
from tserve.nursery._llm import LLM
from tserve.nursery._model_slot import Load, ModelSlot, ModelSpec, Placement
from tserve.nursery._model_state import ModelLifecycle, ModelState
from tserve.nursery._open import EngineOwner
from tserve.nursery._residency import DEFAULT_KEEP_ALIVE

__all__ = [
    "ModelLoadFailed",
    "ModelNotServed",
    "ModelRegistry",
    "ModelSpec",
]

log = logging.getLogger("tserve")


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


class ModelRegistry:
    """The served models by name. Create with
    :func:`~tserve.nursery._open_registry.open_registry`; call from its event loop.

    ``keep_alive``, ``memory_budget`` and ``fit_timeout``: the residency
    rules (see :class:`~tserve.nursery._keeper.Keeper`).
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
        self._owner = owner
        self._tg = tg
        self._models: dict[str, ModelSlot] = {}
        for spec in specs:
            if spec.name in self._models:
                raise ValueError(f"two models are named {spec.name!r}")
            self._models[spec.name] = ModelSlot(spec, keep_alive)
        if not self._models:
            raise ValueError("a registry needs at least one model")
        self._keeper = Keeper(
            self._models,
            keep_alive=keep_alive,
            memory_budget=memory_budget,
            fit_timeout=fit_timeout,
        )
        self._closed = False
        tg.start_soon(self._keeper.expire_idle, name="model keep-alive")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._models)

    @property
    def memory_budget(self) -> int:
        """Bytes of RSS the models' engines may hold together (rules 4-5 of ``_residency.py``)."""
        return self._keeper.memory_budget

    @property
    def keep_alive(self) -> float:
        """The default keep-alive in seconds, for calls that give none (negative: pinned)."""
        return self._keeper.keep_alive

    @property
    def waiting_for_room(self) -> int:
        """Calls whose load waits to be placed now: in line, or for room in the budget."""
        return self._keeper.waiting_for_room

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
        """The model's figures now (state, loads, unloads, load time, RSS measured
        afresh, in flight, keep-alive, last use, expiry). Not a checkpoint."""
        return self._keeper.figures(self._model(name))

    def _model(self, name: str) -> ModelSlot:
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
        self._keeper.asked(model, keep_alive)
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

    async def _place(self, model: ModelSlot) -> None:
        """Make room for ``model``'s load and start it, or wait while another call
        does (however many callers, one of them queues for room). A caller that
        waited fails with the ModelsBusy of the call it waited for; when that
        call was cancelled, the next caller looks again."""
        placement = model.placement
        if placement is not None:
            await placement.done.wait()
            if placement.error is not None:
                raise placement.error
            return
        placement = model.placement = Placement()
        try:
            room = await self._keeper.place(model)
            if room is not None:  # no checkpoint since: the room is still there
                self._start_load(model, room)
        except ModelsBusy as exc:
            placement.error = exc
            raise
        finally:
            model.placement = None
            placement.done.set()

    async def _wait_for(self, load: Load) -> None:
        load.waiters += 1
        try:
            await load.done.wait()
        finally:
            load.waiters -= 1
            if not load.done.is_set() and load.waiters == 0 and not load.pinned:
                load.scope.cancel()  # nobody wants it any more

    def _start_load(self, model: ModelSlot, room: int) -> None:
        load = model.start_load()
        model.resident_bytes = room  # what the budget counts for it while LOADING
        self._tg.start_soon(self._own, model, load, name=f"model {model.name}")

    async def _own(self, model: ModelSlot, load: Load) -> None:
        """The one task that owns ``model``'s engine, from its start to its exit."""
        life, spec = model.life, model.spec
        started = time.monotonic()
        try:
            with load.scope:
                try:
                    opened = self._owner.open_llm(
                        spec.config, spec.embedding_model, freeze_gc=False, prepare_grammars=False
                    )
                    async with opened as llm:
                        model.load_seconds = time.monotonic() - started
                        model.llm = llm
                        life.loaded()
                        self._keeper.loaded(model)
                        load.done.set()
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

    def _settle(self, model: ModelSlot, load: Load) -> None:
        """The owner task's last step: its engine is gone, whichever way it ended."""
        life = model.life
        model.llm = None
        if life.state is ModelState.LOADING:  # cancelled: nobody waited, or shutdown
            life.cancel()
            log.info("model %r: load cancelled", model.name)
        elif life.state is ModelState.LOADED:  # the registry closed
            life.unload()
        if life.state is ModelState.UNLOADING or (
            life.state is ModelState.FAILED and load.error is None  # a dead engine, reaped
        ):
            life.unloaded()
        load.done.set()
        model.gone.set()
        self._keeper.gone(model)

    @staticmethod
    async def _serve_until_released(model: ModelSlot, llm: LLM) -> str | None:
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

    @contextlib.asynccontextmanager
    async def use(self, name: str, *, keep_alive: float | None = None) -> AsyncIterator[LLM]:
        """The model's LLM for the block, loaded first as :meth:`acquire` does
        (its rules, bounds and errors; ``keep_alive`` as it takes it); the
        model is not unloaded while any block is inside, and its keep-alive
        runs from the end of the last one. Leaving it is synchronous."""
        llm, release = await self.hold(name, keep_alive=keep_alive)
        try:
            yield llm
        finally:
            release()

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
            model.unload()
        elif state is ModelState.LOADING and model.load is not None:
            model.load.scope.cancel()
        await model.gone.wait()

    def close(self) -> None:
        """Refuse every later acquire with ShuttingDown. Synchronous."""
        self._closed = True

    # -- for a server: holds that outlive a block, served names that change, figures --

    async def hold(
        self, name: str, *, keep_alive: float | None = None
    ) -> tuple[LLM, Callable[[], None]]:
        """:meth:`use` without a block, for a hold that outlives its caller's
        frame (a streamed response body): the model's LLM, loaded first as
        :meth:`acquire` does (its rules, bounds and errors), and the release
        that ends the hold (synchronous, idempotent). The model is not
        unloaded while held; its keep-alive runs from the last release."""
        llm = await self.acquire(name, keep_alive=keep_alive)
        model = self._models[name]
        model.in_flight += 1
        model.idle = anyio.Event() if model.in_flight == 1 else model.idle
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                model.in_flight -= 1
                model.last_used = anyio.current_time()
                if model.in_flight == 0:
                    model.idle.set()
                    self._keeper.notify()

        return llm, release

    def add(self, spec: ModelSpec) -> None:
        """Serve ``spec`` too, unloaded (a new file in a models directory). Synchronous."""
        if spec.name in self._models:
            raise ValueError(f"two models are named {spec.name!r}")
        self._models[spec.name] = ModelSlot(spec, self._keeper.keep_alive)
        self._keeper.notify()

    def remove(self, name: str) -> bool:
        """Stop serving ``name`` if it has no engine, no load and no caller; whether
        it was removed (a loaded model stays until it is unloaded). Synchronous."""
        model = self._model(name)
        if (
            model.life.state not in (ModelState.UNLOADED, ModelState.FAILED)
            or not model.gone.is_set()
            or model.in_flight
            or (model.load is not None and model.load.waiters)
        ):
            return False
        del self._models[name]
        return True

    def load_seconds(self, name: str) -> float:
        """How long the model's last load took (0.0 before any). Not a checkpoint."""
        return self._model(name).load_seconds
