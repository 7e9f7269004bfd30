"""Which engine answers a request's ``model``: the one lookup every route that takes one uses.

Two lookups, one interface (:class:`ModelLookup`):

* :class:`OneModel`: one :class:`~tserve.nursery.LLM` under one or more
  names, loaded before the server starts and never unloaded (``serve(llm)``,
  ``--api-processes``, ``--engine``).
* :class:`ManyModels`: the models of a
  :class:`~tserve.nursery._registry.ModelRegistry`, each loaded on demand.

A route asks :meth:`ModelLookup.hold` for the request's model and works
inside the block with the :class:`ModelHold` it yields: the name the answer
carries and the engine (:class:`ServedModel`). The model is not unloaded
while held. A streamed response outlives its handler, so its body takes the
hold over (:meth:`ModelHold.keep_until_closed`) and ends it when it closes.

Rules for a request's ``model``:

1. One model: omitted, the first served name; a served name, itself;
   anything else, 404 ``model_not_found`` listing the served names.
2. Several models: omitted, 400 naming ``model``; unknown, 404
   ``model_not_found`` listing the names; a served one is loaded first if
   it has no engine. The wait is cancellable (a client that hangs up leaves
   the load to the others waiting, and a load nobody waits for is cancelled
   with its process) and bounded by ``load_timeout`` (503
   ``model_load_timeout``). A failed load is a 503 ``model_load_failed``
   naming the model: the server cannot serve it now, and the next request
   tries again (a 4xx would tell clients that retrying is useless).
3. A request's ``keep_alive`` (seconds; negative: pinned; None: the
   server's ``--keep-alive``) becomes its model's keep-alive, the latest
   request's winning (the registry's rule 1). With one model it has no
   effect: that model is never unloaded. A model that cannot fit in the
   memory budget before ``--model-fit-timeout`` is a 503 with
   ``Retry-After`` (ModelsBusy, an Overloaded).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import functools
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

import trio

from tserve.nursery import LLM, InvalidRequest, ShuttingDown
from tserve.nursery._model_state import ModelState
from tserve.nursery._registry import ModelLoadFailed, ModelNotServed, ModelRegistry
from tserve.web._errors import ModelLoadError, ModelLoadTimeout, ModelNotFound
from tserve.web._reasoning import ModelReasoning, ReasoningSyntax, model_reasoning

__all__ = [
    "ManyModels",
    "MemoryBudget",
    "ModelHold",
    "ModelLookup",
    "ModelStatus",
    "OneModel",
    "ServedModel",
    "TokenTexts",
]


class TokenTexts:
    """The text of one token id (a :data:`tserve.web._responses.TokenText`), cached.

    Bound: one entry per token id ever asked for, at most the vocabulary.
    Synchronous: a miss decodes on the calling thread (one token is cheap).
    """

    def __init__(self, llm: LLM) -> None:
        self._llm = llm
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._llm.decode([token_id])
        return text


class ServedModel:
    """One engine as the routes use it: its LLM and what is cached per engine."""

    def __init__(self, llm: LLM, reasoning_parser: str) -> None:
        self.llm = llm
        self.token_texts = TokenTexts(llm)
        self._reasoning_parser = reasoning_parser

    @functools.cached_property
    def reasoning(self) -> ModelReasoning | None:
        """``--reasoning-parser`` for this model, decided at its first chat (the
        template renders once, a millisecond on the event loop)."""
        return model_reasoning(self._reasoning_parser, self.llm)

    def reasoning_for(self, template_kwargs: dict[str, Any] | None) -> ReasoningSyntax | None:
        """The reasoning syntax of a chat with these template arguments (None: no
        thinking to split off)."""
        reasoning = self.reasoning
        return None if reasoning is None else reasoning.for_request(template_kwargs)


class ModelHold:
    """One request's hold on its model: ``name`` (what the answer says), ``model``."""

    def __init__(self, name: str, model: ServedModel, release: Callable[[], None]) -> None:
        self.name = name
        self.model = model
        self._release = release  # synchronous, idempotent
        self.kept = False  # a streamed body ends the hold, not the block

    def keep_until_closed(self, body: object) -> Callable[[], None]:
        """Hand the hold to ``body``: leaving :meth:`ModelLookup.hold` no longer
        ends it; the returned call does (the body's close), or the body's
        collection if quart drops it without entering it. Synchronous."""
        self.kept = True
        # Not at interpreter exit: the release touches the event loop's events.
        weakref.finalize(body, self._release).atexit = False
        return self._release

    def release(self) -> None:
        """End the hold (a second call does nothing). Synchronous."""
        self._release()


@dataclasses.dataclass(frozen=True, slots=True)
class ModelStatus:
    """One served model as ``/v1/models`` shows it; ``llm`` only while it is loaded."""

    name: str
    state: ModelState
    reason: str | None = None  # why it failed, when it did
    llm: LLM | None = None
    loads: int = 0
    unloads: int = 0
    load_seconds: float = 0.0
    # Several models only (None with one, which is never unloaded): what the memory
    # budget counts for it (its engines' RSS, measured now; LOADING: its estimate),
    # its keep-alive in seconds (negative: pinned) and when that unloads it if it
    # stays idle (a Unix time; None while held, pinned or not loaded).
    resident_bytes: int | None = None
    keep_alive: float | None = None
    expires_at: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryBudget:
    """The memory budget of several models: ``budget`` bytes, ``resident`` held now."""

    budget: int
    resident: int


class ModelLookup(abc.ABC):
    """The served models by name (the module docstring's rules)."""

    def __init__(self, reasoning_parser: str) -> None:
        self._reasoning_parser = reasoning_parser
        self.draining = False  # set by the drain: later requests are refused

    def start_draining(self) -> None:
        """Refuse every later request with ShuttingDown (the drain's step 1). Synchronous."""
        self.draining = True

    @property
    @abc.abstractmethod
    def names(self) -> tuple[str, ...]:
        """Every name a request may use, in order."""

    @abc.abstractmethod
    def resolve(self, name: str | None) -> str:
        """The served name ``name`` means (rules 1 and 2), without loading. Synchronous."""

    @abc.abstractmethod
    async def _take(self, name: str, keep_alive: float | None) -> ModelHold:
        """A hold on the served model ``name``, loaded first (rule 2), with the
        request's ``keep_alive`` (seconds; None: the default). A checkpoint."""

    @abc.abstractmethod
    def statuses(self, *, rescan: bool = False) -> list[ModelStatus]:
        """Every served model and its state, in order; ``rescan``: a models
        directory's files are looked at first. Synchronous."""

    @abc.abstractmethod
    def alive(self) -> bool:
        """Liveness: False once nothing can be served any more (see ``_probes``)."""

    def memory(self) -> MemoryBudget | None:
        """The models' memory budget and what they hold now (None: one model, no
        budget). Synchronous: reads each engine's RSS."""
        return None

    dead_status = "engine dead"  # what /health says when not alive()

    def saturated(self) -> bool:
        """Whether a new request would be refused with 503 at once."""
        return False

    @abc.abstractmethod
    async def load(self, name: str) -> None:
        """Load ``name`` (admin): runs to its end even if the caller leaves. A checkpoint."""

    @abc.abstractmethod
    async def unload(self, name: str) -> None:
        """Stop ``name``'s engine (admin), once no request holds it. A checkpoint."""

    @abc.abstractmethod
    async def wait_fatal(self) -> str:
        """Block until the server must exit (the one engine died): the reason."""

    @property
    @abc.abstractmethod
    def embedding_owner(self) -> str | None:
        """The served model whose engine pair embeds (None: no embedding model)."""

    @property
    @abc.abstractmethod
    def admission(self) -> tuple[int, int]:
        """Requests run at once and requests queued at most, over every model."""

    @contextlib.asynccontextmanager
    async def hold(
        self, name: str | None, *, keep_alive: float | None = None
    ) -> AsyncIterator[ModelHold]:
        """The model ``name`` means, held for the block (or, when a streamed body
        took it, until that body closes). ``keep_alive``: the request's (rule 3;
        None: the server's default). Blocks (cancellably) only while the model
        loads or waits for room; raises ModelNotFound, InvalidRequest,
        ModelLoadError, ModelLoadTimeout, ModelsBusy, ShuttingDown."""
        held = await self._take(self.resolve(name), keep_alive)
        try:
            yield held
        finally:
            if not held.kept:
                held.release()

    def not_found(self, name: str) -> ModelNotFound:
        """The 404 for a model this server does not serve, listing those it does."""
        return ModelNotFound(
            f"The model '{name}' does not exist; served: {', '.join(self.names)}", param="model"
        )


def _no_release() -> None:
    pass


class OneModel(ModelLookup):
    """One LLM under ``names`` (its own name when empty); always loaded."""

    def __init__(self, llm: LLM, names: tuple[str, ...], reasoning_parser: str = "auto") -> None:
        super().__init__(reasoning_parser)
        self.llm = llm
        self._names = names or (llm.model,)
        self._served = ServedModel(llm, reasoning_parser)

    @property
    def names(self) -> tuple[str, ...]:
        return self._names

    def resolve(self, name: str | None) -> str:
        if name is None:
            return self._names[0]
        if name not in self._names:
            raise self.not_found(name)
        return name

    async def _take(self, name: str, keep_alive: float | None) -> ModelHold:
        return ModelHold(name, self._served, _no_release)  # always loaded: no keep-alive

    def statuses(self, *, rescan: bool = False) -> list[ModelStatus]:
        state = ModelState.LOADED if self.llm.engine_alive else ModelState.FAILED
        reason = self.llm.engine_dead_reason
        return [ModelStatus(name, state, reason, self.llm, loads=1) for name in self._names]

    def alive(self) -> bool:
        return self.llm.engine_alive

    def saturated(self) -> bool:
        return self.llm.admission.saturated

    async def load(self, name: str) -> None:
        self.resolve(name)  # always loaded

    async def unload(self, name: str) -> None:
        self.resolve(name)
        raise InvalidRequest(
            "this server serves one model, loaded for its whole life; serve several to "
            "load and unload them",
            param="model",
        )

    async def wait_fatal(self) -> str:
        return await self.llm.wait_engine_dead()  # either engine's death, as an event

    @property
    def embedding_owner(self) -> str | None:
        return self._names[0]

    @property
    def admission(self) -> tuple[int, int]:
        return self.llm.max_pending, self.llm.admission.max_queued

    def start_draining(self) -> None:
        super().start_draining()
        self.llm.draining = True


class ManyModels(ModelLookup):
    """The models of ``registry``, each loaded on its first request (the module docstring).

    ``load_timeout``: seconds a request waits for its model's load (None: the
    registry's own bound). ``rescan``: called before every listing, to add and
    remove the models of a directory (``--models-dir``). ``embedding_owner``:
    the model whose engine pair embeds, if any.
    """

    def __init__(
        self,
        registry: ModelRegistry,
        *,
        load_timeout: float | None = None,
        reasoning_parser: str = "auto",
        rescan: Callable[[], None] | None = None,
        embedding_owner: str | None = None,
        admission: tuple[int, int] = (0, 0),
    ) -> None:
        super().__init__(reasoning_parser)
        self._registry = registry
        self._load_timeout = load_timeout
        self._rescan = rescan
        self._embedding_owner = embedding_owner
        self._admission = admission  # per model; admission sums it over the models
        self._served: dict[str, ServedModel] = {}  # per name, for its current engine

    @property
    def names(self) -> tuple[str, ...]:
        return self._registry.names

    def resolve(self, name: str | None) -> str:
        if name is None:
            raise InvalidRequest(
                f"'model' is required: this server serves {', '.join(self.names)}",
                param="model",
            )
        if name not in self._registry.names:
            raise self.not_found(name)
        return name

    async def _take(self, name: str, keep_alive: float | None) -> ModelHold:
        if self.draining:  # no new load once the drain began
            raise ShuttingDown("the server is shutting down")
        try:
            with trio.fail_after(self._load_timeout or float("inf")):
                llm, release = await self._registry.hold(name, keep_alive=keep_alive)
        except trio.TooSlowError:
            raise ModelLoadTimeout(
                f"the model '{name}' did not load within {self._load_timeout:g} s "
                "(--model-load-timeout)",
                param="model",
            ) from None
        except ModelLoadFailed as exc:
            raise ModelLoadError(str(exc), param="model") from None
        except ModelNotServed:  # removed from its directory meanwhile
            raise self.not_found(name) from None
        served = self._served.get(name)
        if served is None or served.llm is not llm:  # a new engine, new caches
            served = self._served[name] = ServedModel(llm, self._reasoning_parser)
        return ModelHold(name, served, release)

    dead_status = "every model failed"

    def statuses(self, *, rescan: bool = False) -> list[ModelStatus]:
        if rescan and self._rescan is not None:
            self._rescan()
        registry, out = self._registry, []
        for name in registry.names:
            life = registry.lifecycle(name)
            figures = registry.figures(name)
            reason = life.reason if life.state is ModelState.FAILED else None
            out.append(
                ModelStatus(
                    name,
                    figures.state,
                    reason,
                    registry.loaded(name),
                    loads=figures.loads,
                    unloads=figures.unloads,
                    load_seconds=figures.load_seconds,
                    resident_bytes=figures.resident_bytes,
                    keep_alive=figures.keep_alive,
                    expires_at=figures.expires_at,
                )
            )
        for name in [n for n in self._served if n not in registry.names]:
            del self._served[name]
        return out

    def alive(self) -> bool:
        """False once every model's last load failed or its engine died, none loaded since."""
        registry = self._registry
        for name in registry.names:
            life = registry.lifecycle(name)
            if life.reason is None or life.state not in (ModelState.FAILED, ModelState.UNLOADED):
                return True
        return False

    def memory(self) -> MemoryBudget:
        registry = self._registry
        resident = sum(registry.figures(name).resident_bytes for name in registry.names)
        return MemoryBudget(registry.memory_budget, resident)

    async def load(self, name: str) -> None:
        try:
            await self._registry.acquire(self.resolve(name), pin=True)
        except ModelLoadFailed as exc:
            raise ModelLoadError(str(exc), param="model") from None

    async def unload(self, name: str) -> None:
        await self._registry.unload(self.resolve(name))

    def start_draining(self) -> None:
        super().start_draining()
        for name in self._registry.names:
            llm = self._registry.loaded(name)
            if llm is not None:
                llm.draining = True

    async def wait_fatal(self) -> str:
        await trio.sleep_forever()  # one engine's death fails only its own model
        raise AssertionError("unreachable")

    @property
    def embedding_owner(self) -> str | None:
        return self._embedding_owner

    @property
    def admission(self) -> tuple[int, int]:
        pending, queued = self._admission
        count = len(self._registry.names)
        return pending * count, queued * count
