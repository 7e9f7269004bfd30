"""The residency rules of ``_residency.py`` applied to a registry's model slots.

A :class:`Keeper` decides, a :class:`~tserve.nursery._registry.ModelRegistry`
loads and stops: before each load the keeper makes room in the memory budget
(:meth:`Keeper.place`), after it measures the new engine (:meth:`Keeper.loaded`),
and its one timer task (:meth:`Keeper.expire_idle`) unloads idle models whose
keep-alive has passed. Loads are placed one at a time, in arrival order, each
waiting at most ``fit_timeout`` for room, then failing with :class:`ModelsBusy`.
Engines' RSS is read from ``/proc`` when a model has loaded and again whenever
the budget is applied or figures are read.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Iterable, Mapping
from typing import Final, NoReturn

import anyio

from tserve.nursery._errors import Overloaded
from tserve.nursery._memory import default_memory_budget, resident_bytes, weight_bytes
from tserve.nursery._model_slot import ModelSlot, ModelSpec
from tserve.nursery._model_state import ModelState
from tserve.nursery._residency import DEFAULT_KEEP_ALIVE, Occupant, expiry, plan_room

__all__ = ["DEFAULT_FIT_TIMEOUT", "Keeper", "ModelFigures", "ModelsBusy"]

log = logging.getLogger("tserve")

DEFAULT_FIT_TIMEOUT: Final = 30.0
"""Seconds a load waits for room in the memory budget before ModelsBusy."""


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


class Keeper:
    """The residency rules over ``slots`` (the registry's, by name); call from
    the registry's event loop.

    ``keep_alive``: rule 1's default, in seconds (negative: pinned).
    ``memory_budget``: bytes of RSS that the models' engines may hold
    together (None: ``DEFAULT_BUDGET_FRACTION`` of the machine's memory).
    ``fit_timeout``: seconds a load waits for room.
    """

    def __init__(
        self,
        slots: Mapping[str, ModelSlot],
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
        self._slots = slots
        self.keep_alive = keep_alive
        self.memory_budget = default_memory_budget() if memory_budget is None else memory_budget
        self._fit_timeout = fit_timeout
        self._placing = anyio.Lock()  # one load placed at a time, first come first served
        self.waiting_for_room = 0  # calls in place(); bound: one per calling task
        # Set and replaced whenever a model goes idle, loads or is gone, or a keep-alive
        # changes: what the keep-alive timer and loads waiting for room wait on.
        self._changed = anyio.Event()
        # Rule 3's engine floor: the least RSS beyond its weights of any engine
        # measured right after its load; None until one was.
        self._floor: int | None = None

    def notify(self) -> None:
        """Something the timer or a waiting load may care about changed. Synchronous."""
        self._changed.set()
        self._changed = anyio.Event()

    def asked(self, slot: ModelSlot, keep_alive: float | None) -> None:
        """A call asked for ``slot``: its keep-alive becomes the model's (rule 1)."""
        if keep_alive is not None and math.isnan(keep_alive):
            raise ValueError("keep_alive must be a number of seconds, not NaN")
        keep = self.keep_alive if keep_alive is None else keep_alive
        if keep != slot.keep_alive:
            slot.keep_alive = keep
            self.notify()  # a shorter keep-alive may be due sooner

    async def place(self, slot: ModelSlot) -> int | None:
        """Make room for ``slot``'s load (rules 3-5 of ``_residency.py``):
        unload idle models for it, least recently used first, and wait until
        they are gone. Returns the bytes the load counts while it runs, to be
        started before the caller's next checkpoint; None if another call
        moved the model on meanwhile (it loads or unloads: look again).

        Waits in line behind other loads being placed, then for a busy model
        to go idle, at most ``fit_timeout`` s in all: ModelsBusy. Waiting for
        the models it unloads to stop is bounded by their stop bound instead.
        Cancellable; models already unloaded for it stay unloaded.
        """
        if slot.weights is None:
            slot.weights = await anyio.to_thread.run_sync(_weights, slot.spec)
        deadline = anyio.current_time() + self._fit_timeout
        self.waiting_for_room += 1
        try:
            in_line = False
            with anyio.move_on_at(deadline):
                await self._placing.acquire()
                in_line = True
            if not in_line:
                raise self._busy(slot)
            try:
                return await self._room_for(slot, deadline)
            finally:
                self._placing.release()
        finally:
            self.waiting_for_room -= 1

    async def _room_for(self, slot: ModelSlot, deadline: float) -> int | None:
        """:meth:`place`'s loop, under its lock: plan; unload the idle models the
        plan names and wait until they are gone, or wait for a change (until
        ``deadline``: ModelsBusy); until there is room or the model moved on."""
        while slot.life.state in (ModelState.UNLOADED, ModelState.FAILED):
            changed = self._changed
            need = self._estimate(slot)
            victims = plan_room(need, self.memory_budget, self._others(slot))
            if victims is None:
                with anyio.move_on_at(deadline) as waiting:
                    await changed.wait()
                if waiting.cancelled_caught:
                    raise self._busy(slot)
            elif not victims:
                if need > self.memory_budget:
                    log.warning("model %r: %d bytes, over the budget: loads alone", slot.name, need)
                return need
            else:
                for victim in victims:
                    log.info("model %r unloaded to make room for %r", victim, slot.name)
                    self._slots[victim].unload()
                for victim in victims:
                    await self._slots[victim].gone.wait()
        return None

    def _busy(self, slot: ModelSlot) -> ModelsBusy:
        """The error for a load of ``slot`` that found no room, naming the models that hold it."""
        holders = (s for s in self._slots.values() if s is not slot and s.resident_bytes)
        busy = [s.name for s in holders if s.held or s.life.state is not ModelState.LOADED]
        return ModelsBusy(slot.name, busy, self._fit_timeout)

    def loaded(self, slot: ModelSlot) -> None:
        """``slot``'s engine is LOADED: its RSS, the engine floor (rule 3), its
        keep-alive's start; then, if its estimate was short and the budget is
        now exceeded, the idle models that make it fit are unloaded (rule 5)."""
        self.measure(slot)
        beyond = max(0, slot.resident_bytes - (slot.weights or 0))
        self._floor = beyond if self._floor is None else min(self._floor, beyond)
        slot.last_used = anyio.current_time()
        victims = plan_room(slot.resident_bytes, self.memory_budget, self._others(slot))
        if victims is None:
            log.warning("models over the memory budget of %d bytes while busy", self.memory_budget)
        for victim in victims or ():
            log.info("model %r unloaded: %r needed more room", victim, slot.name)
            self._slots[victim].unload()
        self.notify()

    def gone(self, slot: ModelSlot) -> None:
        """``slot``'s engine process is gone: it holds nothing."""
        slot.resident_bytes = 0
        self.notify()

    def _estimate(self, slot: ModelSlot) -> int:
        """Rule 3: what ``slot`` will hold once loaded."""
        if slot.estimate is not None:
            return slot.estimate
        return (slot.weights or 0) + (self._floor or 0)

    def _others(self, slot: ModelSlot) -> list[Occupant]:
        """Every model but ``slot`` as the budget sees it (rule 2), RSS measured afresh."""
        others = []
        for other in self._slots.values():
            if other is not slot:
                self.measure(other)
                evictable = other.life.state is ModelState.LOADED and not other.held
                others.append(
                    Occupant(other.name, other.resident_bytes, evictable, other.last_used)
                )
        return others

    @staticmethod
    def measure(slot: ModelSlot) -> None:
        """Read the RSS of ``slot``'s engines while it is LOADED; an engine
        that has just died (0 bytes) leaves the last figure."""
        llm = slot.llm
        if llm is None or slot.life.state is not ModelState.LOADED:
            return
        pids = [llm.engine_pid] + ([] if llm.embedder is None else [llm.embedder.engine_pid])
        if measured := sum(resident_bytes(pid) for pid in pids):
            slot.resident_bytes = slot.estimate = measured

    def figures(self, slot: ModelSlot) -> ModelFigures:
        """``slot``'s figures now, its RSS measured afresh. Not a checkpoint."""
        self.measure(slot)
        now, wall = anyio.current_time(), time.time()
        due = self._expiry(slot)
        return ModelFigures(
            name=slot.name,
            state=slot.life.state,
            loads=slot.life.loads,
            unloads=slot.life.unloads,
            load_seconds=slot.load_seconds,
            resident_bytes=slot.resident_bytes,
            in_flight=slot.in_flight,
            keep_alive=slot.keep_alive,
            last_used=None if slot.last_used == -math.inf else wall - (now - slot.last_used),
            expires_at=None if due is None else wall + (due - now),
        )

    @staticmethod
    def _expiry(slot: ModelSlot) -> float | None:
        """When the keep-alive timer unloads ``slot`` (loop clock); None if not due."""
        if slot.life.state is not ModelState.LOADED or slot.held:
            return None
        return expiry(slot.last_used, slot.keep_alive)

    async def expire_idle(self) -> NoReturn:
        """The one keep-alive timer (rule 1): unloads each idle model whose
        keep-alive has passed. Sleeps until the next one is due or something
        changes (:meth:`notify`); runs until cancelled."""
        while True:
            changed = self._changed
            now, due = anyio.current_time(), math.inf
            for slot in self._slots.values():
                at = self._expiry(slot)
                if at is not None and at <= now:
                    log.info("model %r unloaded after its keep-alive", slot.name)
                    slot.unload()
                elif at is not None:
                    due = min(due, at)
            with anyio.move_on_at(due):
                await changed.wait()


def _weights(spec: ModelSpec) -> int:
    """What the model's engines load from disk (rule 3 of ``_residency.py``). Blocks (stats)."""
    paths = [spec.config.model, spec.embedding_model]
    return sum(weight_bytes(path) for path in paths if path is not None and path != "default")
