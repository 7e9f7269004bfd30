"""Serving several models for a block: :func:`open_models` and :func:`open_registry`.

:func:`open_registry` runs a :class:`~tserve.nursery._registry.ModelRegistry`
in a task group of its own (each model's owner task in it), loads the
``preload`` models before the block is entered, and stops every engine when it
is left. :func:`open_models` is the public entry: it turns a name-to-model map
and :func:`tserve.open_llm`'s options into the specs and the
:class:`~tserve.nursery._open.EngineOwner` that ``open_registry`` takes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

import anyio

from tserve.nursery._keeper import DEFAULT_FIT_TIMEOUT
from tserve.nursery._model_slot import ModelSpec
from tserve.nursery._open import EngineOwner
from tserve.nursery._registry import ModelLoadFailed, ModelRegistry
from tserve.nursery._residency import DEFAULT_KEEP_ALIVE
from tserve.nursery._session import unwrap
from tserve.protocol import EngineConfig

__all__ = ["open_models", "open_registry"]


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
    owner = EngineOwner.of(
        max_pending=max_pending,
        overload=overload,
        max_queued=max_queued,
        max_queued_tokens=max_queued_tokens,
        request_timeout=request_timeout,
        startup_timeout=startup_timeout,
        heartbeat_timeout=heartbeat_timeout,
        shutdown_grace=shutdown_grace,
        log_level=log_level,
    )
    specs = [  # TypeError for an unknown option, before any engine starts
        ModelSpec(name, EngineConfig(model=os.fspath(model), **engine_options))
        for name, model in models.items()
    ]
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

    Enters once every preloaded model is loaded (ModelNotServed for a name
    it does not serve, ModelLoadFailed if one fails, with nothing left
    running); preloads are loads like any other, so those that do not fit
    the budget together unload the earlier ones, least recently used first. ``keep_alive``
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
