"""``python -m tserve serve`` once its options are read: the engines, the API processes.

:func:`run` takes a :class:`ServePlan` (what ``__main__`` parsed) and serves
until shutdown: the models' engines through a
:class:`~tserve.nursery._registry.ModelRegistry` (or, with ``--engine``,
the ``tserve engine`` at that address), HTTP from this process, and with
``--api-processes N`` / ``--metrics-port`` the other processes of
``tserve.web._workers``. Returns the exit status of ``__main__``'s docstring.

One model is loaded before the server listens and served as one LLM: the
server exits non-zero when its engine dies. Several models (``several``)
are served through a :class:`~tserve.web._model_lookup.ManyModels`: the
``preload`` ones are loaded before the server listens, the others on their
first request; one engine's death fails only its own model's requests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import AsyncIterator

import trio

from tserve._gc import serving_gc
from tserve._models_dir import ModelsDir
from tserve.nursery import LLM, ClientSettings, EngineDeadError, attach_llm
from tserve.nursery._keeper import DEFAULT_FIT_TIMEOUT
from tserve.nursery._open import EngineOwner
from tserve.nursery._open_registry import open_registry
from tserve.nursery._registry import ModelLoadFailed, ModelSpec
from tserve.nursery._residency import DEFAULT_KEEP_ALIVE
from tserve.web import ServerConfig, serve
from tserve.web._model_lookup import ManyModels
from tserve.web._response_store import responses_store_dir
from tserve.web._workers import MetricsSpec, Workers, WorkerSpec

__all__ = ["RemoteEngine", "ServePlan", "run"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RemoteEngine:
    """A ``tserve engine`` reached by address (``--engine``), and how to reach it."""

    address: str
    keys: str | None
    insecure: bool


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ServePlan:
    """Everything ``serve`` does, as parsed: the model (or the remote engine), the
    HTTP server, the clients' bounds and the processes beside this one."""

    server: ServerConfig
    client: ClientSettings
    # The models, in order; none: the engine of ``remote`` serves its own.
    models: tuple[ModelSpec, ...] = ()
    remote: RemoteEngine | None = None
    # Several models (two or more, or a models directory): loaded on demand.
    several: bool = False
    models_dir: ModelsDir | None = None  # its models are not in ``models``
    preload: tuple[str, ...] = ()  # loaded before the server listens (several models)
    load_timeout: float | None = None  # s a request waits for its model's load
    # The residency rules (several models): s an idle model stays loaded (0: unloaded
    # once idle; negative: pinned), bytes of engine RSS (None: the registry's share of
    # the machine), s a load waits for room before ModelsBusy.
    keep_alive: float = DEFAULT_KEEP_ALIVE
    memory_budget: int | None = None
    fit_timeout: float = DEFAULT_FIT_TIMEOUT
    heartbeat_interval: float = 0.5  # s between an engine's heartbeats
    api_processes: int = 1
    metrics_port: int | None = None
    log_level: str = "INFO"

    @property
    def children(self) -> bool:
        """Whether ``serve`` starts processes besides the engine: API workers, a
        metrics process. They share the request metrics through a directory
        (``tserve._metrics_dir``), which must exist before prometheus_client loads."""
        return self.api_processes > 1 or self.metrics_port is not None


def run(plan: ServePlan) -> int:
    """Serve ``plan`` until shutdown; the exit status. Blocks (runs trio)."""
    try:
        return trio.run(_serve_several if plan.several else _serve, plan)
    except (EngineDeadError, ModelLoadFailed) as exc:  # at startup; later, serve returns 1
        print(f"tserve: cannot serve: {exc}", file=sys.stderr)
        return 1


@contextlib.asynccontextmanager
async def _llm(plan: ServePlan) -> AsyncIterator[LLM]:
    """What ``serve`` serves: the model's engine, loaded before the block, or the remote one."""
    if plan.remote is not None:
        remote = plan.remote
        attach = attach_llm(
            remote.address,
            keys=remote.keys,
            insecure=remote.insecure,
            heartbeat_interval=plan.heartbeat_interval,
            settings=plan.client,
        )
        async with attach as llm:
            yield llm
        return
    (model,) = plan.models
    owner = EngineOwner(plan.client, log_level=plan.log_level.upper())
    # Its one LLM is held for the server's life outside any use() block: pinned,
    # or the keep-alive would stop the engine under it.
    async with open_registry(owner, [model], preload=[model.name], keep_alive=-1) as registry:
        loaded = registry.loaded(model.name)
        assert loaded is not None, "open_registry enters with its preloads loaded"
        with serving_gc():
            yield loaded


async def _serve(plan: ServePlan) -> int:
    async with _llm(plan) as llm:
        if plan.children:  # the API processes share one directory of stored responses
            with responses_store_dir(plan.server.app.responses_store_dir) as store:
                app = dataclasses.replace(plan.server.app, responses_store_dir=store)
                server = dataclasses.replace(plan.server, app=app)
                return await _serve_with_workers(llm, dataclasses.replace(plan, server=server))
        codes: list[int] = []

        async def run_server(task_status: trio.TaskStatus[str]) -> None:
            codes.append(await serve(llm, plan.server, task_status=task_status))

        async with trio.open_nursery() as nursery:
            url = await nursery.start(run_server)
            _print_serving(_served_name(llm, plan.server), url)
    return codes[0]


async def _serve_several(plan: ServePlan) -> int:
    """Serve several models from this process, each loaded on demand (see the module
    docstring); ``--api-processes``, ``--metrics-port`` and ``--engine`` are refused
    with several models before this."""
    owner = EngineOwner(plan.client, log_level=plan.log_level.upper())
    specs = list(plan.models)
    if plan.models_dir is not None:
        specs += plan.models_dir.specs({spec.name for spec in specs})
    registry_context = open_registry(
        owner,
        specs,
        preload=plan.preload,
        keep_alive=plan.keep_alive,
        memory_budget=plan.memory_budget,
        fit_timeout=plan.fit_timeout,
    )
    async with registry_context as registry:
        models_dir = plan.models_dir
        models = ManyModels(
            registry,
            load_timeout=plan.load_timeout,
            reasoning_parser=plan.server.app.reasoning_parser,
            rescan=None if models_dir is None else lambda: models_dir.rescan(registry),
            embedding_owner=next((s.name for s in specs if s.embedding_model), None),
            admission=(plan.client.max_pending, plan.client.max_queued),
        )
        codes: list[int] = []

        async def run_server(task_status: trio.TaskStatus[str]) -> None:
            codes.append(await serve(models, plan.server, task_status=task_status))

        with serving_gc():
            async with trio.open_nursery() as nursery:
                url = await nursery.start(run_server)
                _print_serving(", ".join(registry.names), url)
    return codes[0]


def _served_name(llm: LLM, server: ServerConfig) -> str:
    names = server.app.served_model_names
    return names[0] if names else llm.model


def _print_serving(name: str, url: str) -> None:
    print(f"tserve: serving '{name}' at {url}/v1", flush=True)


def _metrics_spec(llm: LLM, plan: ServePlan) -> MetricsSpec | None:
    """What the metrics process of ``--metrics-port`` needs, or None without one."""
    if plan.metrics_port is None:
        return None
    server = plan.server
    block_size = llm.ready.kv_block_size
    return MetricsSpec(
        parent_pid=os.getpid(),
        host=server.host,
        port=plan.metrics_port,
        allowed_hosts=server.app.allowed_hosts,
        model_name=_served_name(llm, server),
        block_size=block_size,
        num_gpu_blocks=llm.ready.kv_tokens_total // max(block_size, 1),
        log_level=plan.log_level,
    )


async def _serve_with_workers(llm: LLM, plan: ServePlan) -> int:
    """Serve from this process and ``--api-processes`` - 1 workers, and with
    ``--metrics-port`` a metrics process (see tserve.web._workers).

    This process listens first (to learn the port when it is 0), then starts
    the workers, and says "serving" once all of them listen. Each SIGTERM or
    SIGINT it handles is forwarded to them; once its own server has drained,
    the workers get ``--shutdown-timeout`` + 10 s to finish theirs, and only
    then is the engine stopped (the caller leaves the registry). A worker
    that exits on its own shuts the whole server down. Non-zero if any
    process failed.
    """
    server = plan.server
    workers = Workers(plan.api_processes - 1, stop_grace=server.shutdown_timeout + 10)
    served = trio.Event()
    codes: list[int] = []

    async def run_server(task_status: trio.TaskStatus[str]) -> None:
        try:
            code = await serve(
                llm,
                server,
                shutdown_trigger=workers.failed.wait,
                on_signal=workers.forward,
                task_status=task_status,
            )
            codes.append(code)
        finally:
            served.set()

    async with trio.open_nursery() as nursery:
        url = await nursery.start(run_server)
        port = int(url.rsplit(":", 1)[1])
        async with workers.run(_worker_spec(llm, plan, port), _metrics_spec(llm, plan)):
            logging.getLogger("tserve").info(
                "API processes: %d (main) and workers %s", os.getpid(), workers.pids
            )
            _print_serving(_served_name(llm, server), url)
            await served.wait()
    failed = workers.failed.is_set() or any(code != 0 for code in workers.exit_codes)
    return codes[0] if codes and codes[0] else int(failed)


def _worker_spec(llm: LLM, plan: ServePlan, port: int) -> WorkerSpec:
    """What each extra API process needs to reach the engines as this one does."""
    embedder = llm.embedder
    remote = plan.remote  # the workers reach it as we do
    return WorkerSpec(
        parent_pid=os.getpid(),
        engine_address=llm.engine_address,
        engine_pid=None if remote else llm.engine_pid,
        keys=None if remote is None else remote.keys,
        insecure=remote is not None and remote.insecure,
        heartbeat_interval=plan.heartbeat_interval,
        embedding_address=None if embedder is None else embedder.engine_address,
        embedding_pid=None if embedder is None else embedder.engine_pid,
        server=dataclasses.replace(plan.server, port=port),
        client=plan.client,
        log_level=plan.log_level,
    )
