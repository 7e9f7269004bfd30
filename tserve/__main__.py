"""``python -m tserve``: the OpenAI-compatible server, and its engine on its own.

``python -m tserve`` alone serves the default model on 127.0.0.1:8000;
``python -m tserve serve [MODEL] [options]`` says more. The split deployment:
``python -m tserve keys DIR`` writes CURVE keys, ``python -m tserve engine
MODEL --bind tcp://HOST:PORT --keys DIR`` serves one engine, and any number
of ``python -m tserve serve --engine tcp://HOST:PORT --keys DIR`` serve HTTP
against it. Every option can also come from an environment variable,
``TSERVE_`` + its name in capitals (``--max-pending`` is
``TSERVE_MAX_PENDING``); a command-line flag wins (declared in
``tserve._options``). ``python -m tserve bench [options]`` runs the serving
benchmark (:mod:`tserve.bench`).

Exit status: 0 after a clean stop; 1 when an engine died, failed to start or
refused us; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, NoReturn

from tserve._curve import KeyFileError, client_keys, require_keys, server_keys, write_keys
from tserve._host import configure_logging
from tserve._metrics_dir import shared_metrics_dir
from tserve._options import COMMANDS, engine_options, parser

if TYPE_CHECKING:
    from tserve.nursery import LLM
    from tserve.web import ServerConfig
    from tserve.web._workers import MetricsSpec

__all__ = ["main"]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv``; a missing command means ``serve``."""
    args = list(argv)
    if not args or (args[0] not in COMMANDS and args[0] not in ("-h", "--help")):
        args.insert(0, "serve")
    if args[0] == "bench":
        raise SystemExit("python -m tserve bench: call main(), which delegates to tserve.bench")
    return parser().parse_args(args)


def _usage_error(command: str, message: str) -> NoReturn:
    print(f"python -m tserve {command}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _server_config(args: argparse.Namespace) -> ServerConfig:
    from tserve.web import AppConfig, ServerConfig

    names = tuple(n.strip() for n in (args.served_model_name or "").split(",") if n.strip())
    if args.api_processes < 1:
        _usage_error("serve", "--api-processes must be at least 1")
    if args.api_key is not None and not args.api_key.strip():
        _usage_error("serve", "--api-key (or TSERVE_API_KEY) is empty: give a key, or unset it")
    if args.stall_timeout <= 0:
        _usage_error("serve", "--stall-timeout must be positive")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        _usage_error("serve", "--metrics-port must be a port number (0: any free port)")
    if args.metrics_port and args.metrics_port == args.port:
        _usage_error("serve", "--metrics-port must differ from --port")
    if args.responses_store_bytes < 1 or args.responses_store_ttl <= 0:
        _usage_error("serve", "--responses-store-bytes and --responses-store-ttl must be positive")
    hosts = tuple(h.strip() for h in (args.allowed_hosts or "").split(",") if h.strip())
    return ServerConfig(
        host=args.host,
        port=args.port,
        shutdown_timeout=args.shutdown_timeout,
        stall_timeout=args.stall_timeout,
        reuse_port=args.api_processes > 1,
        publish_stats=args.metrics_port is not None,
        app=AppConfig(
            served_model_names=names,
            api_key=args.api_key,
            allowed_hosts=hosts,
            max_body_bytes=args.max_body_bytes,
            request_log=not args.no_request_log,
            responses_store_dir=args.responses_store_dir,
            responses_store_bytes=args.responses_store_bytes,
            responses_store_ttl=args.responses_store_ttl,
        ),
    )


def _check_link(args: argparse.Namespace, command: str, address: str) -> None:
    """Exit 2 unless ``--keys`` / ``--insecure`` / ``--heartbeat-interval`` fit ``address``."""
    if args.heartbeat_interval <= 0:
        _usage_error(command, "--heartbeat-interval must be positive")
    try:
        require_keys(address, args.keys, insecure=args.insecure)
        if args.keys is not None:
            (server_keys if command == "engine" else client_keys)(args.keys)
    except KeyFileError as exc:
        _usage_error(command, str(exc))


def _llm(args: argparse.Namespace) -> AbstractAsyncContextManager[LLM]:
    """What ``serve`` serves: an engine of its own, or with ``--engine`` the one there."""
    from tserve.nursery import attach_llm, open_llm

    limits: dict[str, Any] = {
        "max_pending": args.max_pending,
        "overload": "raise",  # past the queue's bounds: 503 + Retry-After
        "max_queued": args.max_queued,
        "max_queued_tokens": args.max_queued_tokens,
        "request_timeout": args.request_timeout,
    }
    if args.engine is not None:
        link = {"keys": args.keys, "insecure": args.insecure}
        return attach_llm(args.engine, heartbeat_interval=args.heartbeat_interval, **link, **limits)
    embedding = args.embedding_model
    return open_llm(
        args.model or "default",
        log_level=args.log_level.upper(),
        embedding_model=None if embedding.strip().lower() in ("", "none") else embedding,
        **limits,
        **engine_options(args),
    )


def _serve(args: argparse.Namespace) -> int:
    import trio

    from tserve.nursery import EngineDeadError
    from tserve.web import serve

    server = _server_config(args)
    if args.engine is not None:
        if args.model is not None:
            _usage_error("serve", "with --engine, give no MODEL: the engine serves its own")
        if args.embedding_model.strip().lower() not in ("default", "none", ""):
            _usage_error("serve", "--embedding-model needs an engine of its own, not --engine")
        _check_link(args, "serve", args.engine)
    names = server.app.served_model_names

    async def run() -> int:
        async with _llm(args) as llm:
            if _children(args):
                from tserve.web._response_store import responses_store_dir

                with responses_store_dir(server.app.responses_store_dir) as store:
                    app = dataclasses.replace(server.app, responses_store_dir=store)
                    shared = dataclasses.replace(server, app=app)
                    return await _serve_with_workers(llm, shared, args)
            codes: list[int] = []

            async def run_server(task_status: trio.TaskStatus[str]) -> None:
                codes.append(await serve(llm, server, task_status=task_status))

            async with trio.open_nursery() as nursery:
                url = await nursery.start(run_server)
                _print_serving(names[0] if names else llm.model, url)
        return codes[0]

    try:
        return trio.run(run)
    except EngineDeadError as exc:  # at startup; later, serve returns 1 itself
        print(f"tserve: cannot serve: {exc}", file=sys.stderr)
        return 1


def _engine(args: argparse.Namespace) -> int:
    """``python -m tserve engine``: serve one engine at ``--bind`` until SIGTERM/SIGINT."""
    if args.bind is None:
        _usage_error("engine", "--bind is required (tcp://HOST:PORT or ipc://PATH)")
    _check_link(args, "engine", args.bind)
    from tserve.gpu._process import run_engine  # the engine's process: torch loads later
    from tserve.protocol import EngineConfig

    config = EngineConfig(model=args.model, **engine_options(args))
    keys = None if args.keys is None else server_keys(args.keys)

    def bound(endpoint: str) -> None:
        print(f"tserve: engine at {endpoint}", flush=True)

    return run_engine(config, args.bind, None, keys=keys, on_bound=bound)


def _keys(args: argparse.Namespace) -> int:
    """``python -m tserve keys DIR``: write the key pairs, print their paths."""
    try:
        written = write_keys(args.directory)
    except (KeyFileError, OSError) as exc:
        print(f"python -m tserve keys: error: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


def _children(args: argparse.Namespace) -> bool:
    """Whether ``serve`` starts processes besides the engine: API workers, a metrics
    process. They share the request metrics through a directory (tserve._metrics_dir)."""
    return bool(args.api_processes > 1 or args.metrics_port is not None)


def _metrics_spec(llm: LLM, server: ServerConfig, args: argparse.Namespace) -> MetricsSpec | None:
    """What the metrics process of ``--metrics-port`` needs, or None without one."""
    from tserve.web._workers import MetricsSpec

    if args.metrics_port is None:
        return None
    names = server.app.served_model_names
    block_size = llm.ready.kv_block_size
    return MetricsSpec(
        parent_pid=os.getpid(),
        host=server.host,
        port=args.metrics_port,
        allowed_hosts=server.app.allowed_hosts,
        model_name=names[0] if names else llm.model,
        block_size=block_size,
        num_gpu_blocks=llm.ready.kv_tokens_total // max(block_size, 1),
        log_level=args.log_level,
    )


def _print_serving(name: str, url: str) -> None:
    print(f"tserve: serving '{name}' at {url}/v1", flush=True)


async def _serve_with_workers(llm: LLM, server: ServerConfig, args: argparse.Namespace) -> int:
    """Serve from this process and ``--api-processes`` - 1 workers, and with
    ``--metrics-port`` a metrics process (see tserve.web._workers).

    This process listens first (to learn the port when it is 0), then starts
    the workers, and says "serving" once all of them listen. Each SIGTERM or
    SIGINT it handles is forwarded to them; once its own server has drained,
    the workers get ``--shutdown-timeout`` + 10 s to finish theirs, and only
    then is the engine stopped (the caller leaves open_llm). A worker that
    exits on its own shuts the whole server down. Non-zero if any process
    failed.
    """
    import trio

    from tserve.web import serve
    from tserve.web._workers import Workers, WorkerSpec

    workers = Workers(args.api_processes - 1, stop_grace=server.shutdown_timeout + 10)
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
        embedder = llm.embedder
        remote = args.engine is not None  # the workers reach it as we do
        spec = WorkerSpec(
            parent_pid=os.getpid(),
            engine_address=llm.engine_address,
            engine_pid=None if remote else llm.engine_pid,
            keys=args.keys if remote else None,
            insecure=remote and args.insecure,
            heartbeat_interval=args.heartbeat_interval,
            embedding_address=None if embedder is None else embedder.engine_address,
            embedding_pid=None if embedder is None else embedder.engine_pid,
            server=dataclasses.replace(server, port=int(url.rsplit(":", 1)[1])),
            max_pending=args.max_pending,
            max_queued=args.max_queued,
            max_queued_tokens=args.max_queued_tokens,
            request_timeout=args.request_timeout,
            log_level=args.log_level,
        )
        async with workers.run(spec, _metrics_spec(llm, server, args)):
            logging.getLogger("tserve").info(
                "API processes: %d (main) and workers %s", os.getpid(), workers.pids
            )
            names = server.app.served_model_names
            _print_serving(names[0] if names else llm.model, url)
            await served.wait()
    failed = workers.failed.is_set() or any(code != 0 for code in workers.exit_codes)
    return codes[0] if codes and codes[0] else int(failed)


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["bench"]:
        from tserve.bench import main as bench_main

        return bench_main(words[1:])
    args = parse_args(words)
    if args.command == "keys":
        return _keys(args)
    configure_logging(args.log_level, **({"who": "engine"} if args.command == "engine" else {}))
    try:
        if args.command == "engine":
            return _engine(args)
        if _children(args):  # before anything imports prometheus_client
            with shared_metrics_dir():
                return _serve(args)
        return _serve(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
