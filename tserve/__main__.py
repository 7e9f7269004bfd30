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
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from tserve._curve import KeyFileError, client_keys, require_keys, server_keys, write_keys
from tserve._host import configure_logging
from tserve._metrics_dir import shared_metrics_dir
from tserve._options import COMMANDS, REASONING_PARSERS, engine_options, parser

if TYPE_CHECKING:
    from tserve._serve import ServePlan
    from tserve.web import ServerConfig

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
    if args.reasoning_parser not in REASONING_PARSERS:  # TSERVE_REASONING_PARSER, unchecked
        _usage_error("serve", f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}")
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
            reasoning_parser=args.reasoning_parser,
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


def _plan(args: argparse.Namespace) -> ServePlan:
    """``serve``'s options as a :class:`~tserve._serve.ServePlan`; exit 2 if they clash."""
    from tserve._serve import RemoteEngine, ServePlan
    from tserve.nursery import ClientSettings
    from tserve.nursery._admission import Overload
    from tserve.nursery._registry import ModelSpec
    from tserve.protocol import EngineConfig

    server = _server_config(args)
    client = ClientSettings(
        max_pending=args.max_pending,
        overload=Overload.RAISE,  # past the queue's bounds: 503 + Retry-After
        max_queued=args.max_queued,
        max_queued_tokens=args.max_queued_tokens,
        request_timeout=args.request_timeout,
    )
    common: dict[str, Any] = {
        "server": server,
        "client": client,
        "heartbeat_interval": args.heartbeat_interval,
        "api_processes": args.api_processes,
        "metrics_port": args.metrics_port,
        "log_level": args.log_level,
    }
    if args.engine is not None:
        _one_model(args)
        if args.model or args.models_dir is not None:
            _usage_error(
                "serve",
                "with --engine, give no MODEL or --models-dir: the remote engine serves its "
                "own one model",
            )
        if args.embedding_model.strip().lower() not in ("default", "none", ""):
            _usage_error("serve", "--embedding-model needs an engine of its own, not --engine")
        _check_link(args, "serve", args.engine)
        remote = RemoteEngine(address=args.engine, keys=args.keys, insecure=args.insecure)
        return ServePlan(remote=remote, **common)
    if args.model_load_timeout <= 0:
        _usage_error("serve", "--model-load-timeout must be positive")
    embedding = args.embedding_model
    embedding_model = None if embedding.strip().lower() in ("", "none") else embedding
    words = args.model or ([] if args.models_dir is not None else ["default"])
    named = [_named_model(word) for word in words]
    if len(named) > 1 or args.models_dir is not None:
        return _several(args, named, embedding_model, common)
    _one_model(args)
    alias, model = named[0]
    names = server.app.served_model_names or ((alias,) if alias else ())
    spec = ModelSpec(
        name=names[0] if names else model,
        config=EngineConfig(model=model, **engine_options(args)),
        embedding_model=embedding_model,
    )
    if names and not server.app.served_model_names:  # NAME=MODEL: NAME is what clients use
        app = dataclasses.replace(server.app, served_model_names=names)
        common["server"] = dataclasses.replace(server, app=app)
    unknown = set(args.preload) - {spec.name, *names}
    if unknown:
        _usage_error("serve", f"--preload {sorted(unknown)[0]}: no model of that name is served")
    return ServePlan(models=(spec,), **common)


_RESIDENCY_FLAGS = ("--keep-alive", "--models-memory", "--model-fit-timeout")


def _one_model(args: argparse.Namespace) -> None:
    """Exit 2 if a residency option is given for one model, which is loaded for the
    server's whole life: it has no keep-alive and nothing to unload."""
    for flag in _RESIDENCY_FLAGS:
        if getattr(args, flag.lstrip("-").replace("-", "_")) is not None:
            _usage_error(
                "serve",
                f"{flag} applies to several models; one model stays loaded for the "
                "server's whole life",
            )


def _residency(args: argparse.Namespace) -> dict[str, Any]:
    """``--keep-alive``, ``--models-memory``, ``--model-fit-timeout`` as the
    registry's arguments (those not given: its defaults); exit 2 for a bad one."""
    from tserve.nursery import parse_keep_alive
    from tserve.nursery._memory import parse_byte_size

    out: dict[str, Any] = {}
    if args.keep_alive is not None:
        try:
            out["keep_alive"] = parse_keep_alive(args.keep_alive)
        except ValueError as exc:
            _usage_error("serve", f"--keep-alive: {exc}")
    if args.models_memory is not None:
        try:
            out["memory_budget"] = parse_byte_size(args.models_memory)
        except ValueError as exc:
            _usage_error("serve", f"--models-memory: {exc}")
    if args.model_fit_timeout is not None:
        if not args.model_fit_timeout > 0:
            _usage_error("serve", "--model-fit-timeout must be a positive number of seconds")
        out["fit_timeout"] = args.model_fit_timeout
    return out


def _named_model(word: str) -> tuple[str | None, str]:
    """``NAME=MODEL`` as (NAME, MODEL); a plain MODEL (or an existing path) as (None, MODEL)."""
    name, sep, model = word.partition("=")
    if sep and name and model and "/" not in name and not os.path.exists(word):
        return name, model
    return None, word


def _several(
    args: argparse.Namespace,
    named: list[tuple[str | None, str]],
    embedding_model: str | None,
    common: dict[str, Any],
) -> ServePlan:
    """The plan of several models (docs/several-models.md); exit 2 for what cannot be served."""
    from tserve._models_dir import ModelsDir
    from tserve._serve import ServePlan
    from tserve.nursery._registry import ModelSpec
    from tserve.protocol import EngineConfig

    residency = _residency(args)
    if args.api_processes > 1:
        _usage_error(
            "serve",
            "--api-processes above 1 serves one model: each API process would load and "
            "unload its own engines; serve several models from one API process",
        )
    if args.metrics_port is not None:
        _usage_error(
            "serve", "--metrics-port serves one model; with several, scrape /metrics instead"
        )
    server = common["server"]
    given = server.app.served_model_names
    if given and len(given) != len(named):
        _usage_error(
            "serve",
            f"--served-model-name gives {len(given)} names for {len(named)} models: with "
            "several MODELs, give one name per MODEL, in order",
        )
    options = engine_options(args)
    specs: list[ModelSpec] = []
    for i, (alias, model) in enumerate(named):
        name = given[i] if given else alias or _default_name(model)
        specs.append(ModelSpec(name, EngineConfig(model=model, **options)))
    if embedding_model is not None and specs:  # the first model's engine pair embeds
        specs[0] = dataclasses.replace(specs[0], embedding_model=embedding_model)
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        twice = next(name for name in names if names.count(name) > 1)
        _usage_error("serve", f"two models are named '{twice}': name them with NAME=MODEL")
    models_dir = None
    if args.models_dir is not None:
        models_dir = ModelsDir(args.models_dir, EngineConfig(model="default", **options))
        try:
            names += [spec.name for spec in models_dir.specs(set(names))]
        except OSError as exc:
            _usage_error("serve", f"--models-dir {args.models_dir}: {exc}")
        if not names:
            _usage_error("serve", f"--models-dir {args.models_dir} holds no model")
    unknown = set(args.preload) - set(names)
    if unknown:
        _usage_error("serve", f"--preload {sorted(unknown)[0]}: no model of that name is served")
    common["server"] = dataclasses.replace(
        server, app=dataclasses.replace(server.app, served_model_names=())
    )
    return ServePlan(
        models=tuple(specs),
        several=True,
        models_dir=models_dir,
        preload=tuple(args.preload),
        load_timeout=args.model_load_timeout,
        **residency,
        **common,
    )


def _default_name(model: str) -> str:
    """A model's served name when none is given: its file name without ``.gguf``, or
    its directory's name."""
    path = os.path.basename(os.path.normpath(model))
    return path.removesuffix(".gguf") or model


def _serve(args: argparse.Namespace) -> int:
    """``python -m tserve serve``: exit 2 for clashing options, else serve (tserve._serve)."""
    from tserve._serve import run

    return run(_plan(args))


def _engine(args: argparse.Namespace) -> int:
    """``python -m tserve engine``: serve one engine at ``--bind`` until SIGTERM/SIGINT."""
    if args.bind is None:
        _usage_error("engine", "--bind is required (tcp://HOST:PORT or ipc://PATH)")
    _check_link(args, "engine", args.bind)
    from tserve.gpu.engine._process import run_engine  # the engine's process: torch loads later
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
        if args.api_processes > 1 or args.metrics_port is not None:  # ServePlan.children
            with shared_metrics_dir():  # before anything imports prometheus_client
                return _serve(args)
        return _serve(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
