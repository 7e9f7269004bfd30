"""The load state of one served model, as a state machine. Sans-IO.

Every model a :class:`~tserve.nursery._registry.ModelRegistry` serves has one
:class:`ModelLifecycle`; the registry's task that owns the model's engine
feeds it what that engine does, and nothing else moves it.

States and the only legal moves (event: from -> to)::

    load      UNLOADED, FAILED -> LOADING   (a request, a preload or an admin asks for it)
    loaded    LOADING -> LOADED             (the engine is ready, its tokenizer loaded)
    fail      LOADING, LOADED -> FAILED     (the load failed; the engine died)
    cancel    LOADING -> UNLOADED           (nobody waits for the load any more)
    unload    LOADED -> UNLOADING           (asked to; the engine stops)
    unloaded  UNLOADING, FAILED -> UNLOADED (the engine process is gone)

Rules:

1. **One load at a time.** Only UNLOADED and FAILED may start a load, so
   however many requests find a model unloaded at once, one load runs and
   the rest wait for it.
2. **A failure names its reason and is not final.** FAILED keeps the
   reason (:attr:`ModelLifecycle.reason`) until the next load starts, which
   any later request may do: the server never gives up on a model.
3. **UNLOADED means no engine process.** An unload, a cancelled load and a
   dead engine reach UNLOADED only once the process is gone. A failed load
   stays FAILED (its reason shown) with no process left; a dead engine is
   FAILED while it is reaped, then UNLOADED.
4. Any other move raises :class:`IllegalModelTransition`.
"""

from __future__ import annotations

import enum
from typing import Final

from tserve._errors import LLMError

__all__ = ["IllegalModelTransition", "ModelLifecycle", "ModelState"]


class IllegalModelTransition(LLMError):
    """A model was asked to move between states its lifecycle forbids (a bug)."""


class ModelState(enum.Enum):
    UNLOADED = "unloaded"  # no engine process
    LOADING = "loading"  # its engine starts; requests for it wait
    LOADED = "loaded"  # its engine serves
    UNLOADING = "unloading"  # its engine stops; requests for it wait, then load it again
    FAILED = "failed"  # the last load failed, or its engine died; see ModelLifecycle.reason


_S = ModelState
_MOVES: Final[dict[str, tuple[frozenset[ModelState], ModelState]]] = {
    "load": (frozenset({_S.UNLOADED, _S.FAILED}), _S.LOADING),
    "loaded": (frozenset({_S.LOADING}), _S.LOADED),
    "fail": (frozenset({_S.LOADING, _S.LOADED}), _S.FAILED),
    "cancel": (frozenset({_S.LOADING}), _S.UNLOADED),
    "unload": (frozenset({_S.LOADED}), _S.UNLOADING),
    "unloaded": (frozenset({_S.UNLOADING, _S.FAILED}), _S.UNLOADED),
}


class ModelLifecycle:
    """One model's state; each method is one event of the module's table."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.state = ModelState.UNLOADED
        self.reason: str | None = None  # why it FAILED; None in every other state
        self.attempts = 0  # loads started
        self.loads = 0  # loads that reached LOADED
        self.unloads = 0  # LOADED engines that stopped (asked to, or dead)

    def _move(self, event: str) -> None:
        sources, target = _MOVES[event]
        if self.state not in sources:
            raise IllegalModelTransition(f"model {self.name!r}: {event} in {self.state.value}")
        self.state = target

    def load(self) -> None:
        self._move("load")
        self.attempts += 1
        self.reason = None

    def loaded(self) -> None:
        self._move("loaded")
        self.loads += 1

    def fail(self, reason: str) -> None:
        if self.state is ModelState.LOADED:
            self.unloads += 1
        self._move("fail")
        self.reason = reason

    def cancel(self) -> None:
        self._move("cancel")

    def unload(self) -> None:
        self._move("unload")
        self.unloads += 1

    def unloaded(self) -> None:
        """The engine is gone. FAILED keeps its reason for whoever asks next."""
        self._move("unloaded")
