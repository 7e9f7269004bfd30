"""One served model's slot in a registry: its spec, its lifecycle, its current
load, its LLM while LOADED, and what the residency rules track about it.

Plain records with their invariants beside the fields; the registry
(``_registry.py``) and its keeper (``_keeper.py``) move them.
"""

from __future__ import annotations

import dataclasses
import math

import anyio

from tserve.nursery._llm import LLM
from tserve.nursery._model_state import ModelLifecycle, ModelState
from tserve.nursery._residency import DEFAULT_KEEP_ALIVE
from tserve.protocol import EngineConfig

__all__ = ["Load", "ModelSlot", "ModelSpec", "Placement"]


@dataclasses.dataclass(frozen=True, slots=True)
class ModelSpec:
    """One served model: the name requests use, its engine, its embedding engine if any."""

    name: str
    config: EngineConfig
    embedding_model: str | None = None


class Load:
    """One load of one model, as its waiters see it."""

    def __init__(self) -> None:
        self.done = anyio.Event()  # set once the model is LOADED, FAILED or the load cancelled
        self.error: str | None = None  # why it failed; None if it loaded (or was cancelled)
        # Callers in acquire() waiting for it; the last one to leave early cancels it.
        # Bound: one per waiting call (each holds its own task).
        self.waiters = 0
        self.pinned = False  # a preload or an admin load: runs to its end with no waiter
        self.scope = anyio.CancelScope()  # the owner task's, cancelled to cancel the load


class Placement:
    """One call making room for a model's load, as the other callers for it see it."""

    def __init__(self) -> None:
        self.done = anyio.Event()  # set once its load started, or the call failed or left
        self.error: Exception | None = None  # ModelsBusy: no room; the others fail alike


class ModelSlot:
    """One model's engine slot: its spec, lifecycle, current load and its LLM when LOADED."""

    def __init__(self, spec: ModelSpec, keep_alive: float = DEFAULT_KEEP_ALIVE) -> None:
        self.spec = spec
        self.life = ModelLifecycle(spec.name)
        self.llm: LLM | None = None  # set exactly while LOADED
        self.load: Load | None = None  # the load under way, or the last one
        # The one call making room for its next load while UNLOADED or FAILED;
        # every other caller waits for it instead of queueing for room itself.
        self.placement: Placement | None = None
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
        self.keep_alive = keep_alive
        self.last_used = -math.inf  # loop clock: its last acquire, or its last use block's end
        # Its engines' RSS while it has a process (LOADED, UNLOADING), else 0;
        # while LOADING, what the budget counts for it (rule 3's estimate).
        self.resident_bytes = 0
        self.estimate: int | None = None  # the RSS measured in its last residency
        self.weights: int | None = None  # its weights' bytes on disk, once looked up

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def held(self) -> bool:
        """Requests in flight, or callers about to receive it from its load: not idle."""
        return (
            self.in_flight > 0
            or (self.load is not None and self.load.waiters > 0)
            or self.placement is not None
        )

    def start_load(self) -> Load:
        """Move to LOADING with a fresh load; its owner task is the caller's to start."""
        self.life.load()
        self.load = Load()
        self.release = anyio.Event()
        self.gone = anyio.Event()
        return self.load

    def unload(self) -> None:
        """Move a LOADED model to UNLOADING and tell its owner task to stop the engine."""
        assert self.life.state is ModelState.LOADED
        self.life.unload()
        self.release.set()
