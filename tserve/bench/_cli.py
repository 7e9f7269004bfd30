"""``python -m tserve bench``: options, the sweep over loads, the self-test."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import anyio
import httpx

from tserve._host import raise_fd_limit
from tserve.bench._client import RunConfig, RunResult, run_benchmark
from tserve.bench._datasets import (
    SONNET_PATH,
    BenchRequest,
    LocalTokenizer,
    ServerTokenizer,
    Tokenizer,
    random_requests,
    sonnet_requests,
)
from tserve.bench._metrics import RequestResult, Summary, summarize
from tserve.bench._report import format_summary, plot_run, plot_sweep, sweep_table

__all__ = ["main", "parser"]


def _rate(text: str) -> float:
    return math.inf if text.lower() in ("inf", "infinity") else float(text)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tserve bench",
        description="Serving benchmark for any OpenAI-compatible server (streams, "
        "measures TTFT/TPOT/ITL/E2E and throughput). Several values of "
        "--request-rate or --max-concurrency make a sweep.",
    )
    srv = p.add_argument_group("server")
    srv.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    srv.add_argument(
        "--endpoint", default="completions", help="completions, chat, or a path (/v1/...)"
    )
    srv.add_argument("--model", default=None, help="model name (default: the server's first)")
    srv.add_argument(
        "--tokenizer",
        default=None,
        help="local tokenizer/model directory for the datasets (default: --model if it is "
        "a directory, else the server's /tokenize and /detokenize)",
    )
    srv.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer key")

    data = p.add_argument_group("dataset")
    data.add_argument("--dataset-name", choices=("random", "sonnet"), default="random")
    data.add_argument("--num-prompts", type=int, default=100, help="requests per run")
    data.add_argument("--random-input-len", type=int, default=128)
    data.add_argument("--random-output-len", type=int, default=32)
    data.add_argument("--random-range-ratio", type=float, default=0.0)
    data.add_argument("--sonnet-input-len", type=int, default=550)
    data.add_argument("--sonnet-output-len", type=int, default=150)
    data.add_argument("--sonnet-prefix-len", type=int, default=200)
    data.add_argument("--sonnet-path", type=Path, default=SONNET_PATH)

    load = p.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=_rate,
        nargs="+",
        default=[math.inf],
        help="requests/s (inf: all at once; else Poisson/gamma arrivals)",
    )
    load.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, <1 burstier"
    )
    load.add_argument("--max-concurrency", type=int, nargs="+", default=[None])
    load.add_argument(
        "--duration", type=float, default=None, help="seconds per run at most (cuts in-flight)"
    )
    load.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    load.add_argument("--num-warmups", type=int, default=0, help="unmeasured requests first")
    load.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into bodies")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--backend", choices=("trio", "asyncio"), default="trio")

    out = p.add_argument_group("output")
    out.add_argument("--result-dir", type=Path, default=Path("results"))
    out.add_argument("--result-filename", default=None, help="file stem (default bench-TIME)")
    out.add_argument("--label", default=None, help="a name for this server in titles")
    out.add_argument("--save-detailed", action="store_true", help="keep every request's timings")
    out.add_argument("--no-save", action="store_true", help="write no JSON or PNG")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    out.add_argument(
        "--self-test",
        action="store_true",
        help="measure this client against the trivial echo server and exit",
    )
    return p


def _headers(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def _server_model(base_url: str, headers: dict[str, str]) -> str:
    response = httpx.get(f"{base_url.rstrip('/')}/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def _tokenizer(args: argparse.Namespace, model: str) -> Tokenizer:
    source = args.tokenizer or (model if Path(model).is_dir() else None)
    if source is not None:
        try:
            return LocalTokenizer(source)
        except (OSError, ValueError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise SystemExit(f"--tokenizer {source}: {first}") from None
    try:
        return ServerTokenizer(args.base_url.rstrip("/"), model, _headers(args))
    except httpx.HTTPError as exc:
        raise SystemExit(
            f"the server has no usable /tokenize and /detokenize ({exc}); "
            "pass --tokenizer with a local tokenizer or model directory"
        ) from None


def _requests(args: argparse.Namespace, tokenizer: Tokenizer, n: int) -> list[BenchRequest]:
    if args.dataset_name == "sonnet":
        return sonnet_requests(
            tokenizer,
            n,
            input_len=args.sonnet_input_len,
            output_len=args.sonnet_output_len,
            prefix_len=args.sonnet_prefix_len,
            seed=args.seed,
            path=args.sonnet_path,
        )
    return random_requests(
        tokenizer,
        n,
        input_len=args.random_input_len,
        output_len=args.random_output_len,
        range_ratio=args.random_range_ratio,
        seed=args.seed,
    )


def _measure(
    config: RunConfig,
    model: str,
    requests: list[BenchRequest],
    *,
    label: str,
    progress: bool,
    backend: str,
) -> RunResult:
    """One run with a progress bar (blocking: runs its own event loop)."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    with tqdm(total=len(requests), desc=label, disable=not progress, leave=False) as bar:

        def done(_: RequestResult) -> None:
            bar.update(1)

        async def go() -> RunResult:
            return await run_benchmark(config, model, requests, on_done=done)

        return anyio.run(go, backend=backend)


def _label(rate: float, concurrency: int | None) -> str:
    parts = [f"rate={'inf' if math.isinf(rate) else f'{rate:g}'}"]
    if concurrency is not None:
        parts.append(f"concurrency={concurrency}")
    return " ".join(parts)


def _x_axis(args: argparse.Namespace) -> tuple[str, list[tuple[float, int | None]]] | None:
    """The swept variable's name and the (rate, concurrency) of each run, if several."""
    runs = list(itertools.product(args.request_rate, args.max_concurrency))
    if len(runs) < 2:
        return None
    name = "max concurrency" if len(args.max_concurrency) > 1 else "request rate (req/s)"
    return name, runs


def _run_json(run: RunResult, summary: Summary, detailed: bool) -> dict[str, Any]:
    c = run.config
    doc: dict[str, Any] = {
        "request_rate": None if math.isinf(c.request_rate) else c.request_rate,
        "burstiness": c.burstiness,
        "max_concurrency": c.max_concurrency,
        "summary": summary.to_json(),
    }
    if detailed:
        doc["requests"] = [asdict(r) for r in run.results]
    return doc


def _bench(args: argparse.Namespace) -> int:
    headers = _headers(args)
    base_url = args.base_url.rstrip("/")
    try:
        model = args.model or _server_model(base_url, headers)
    except httpx.HTTPError as exc:
        raise SystemExit(f"cannot list the models of {base_url}: {exc}") from None
    tokenizer = _tokenizer(args, model)
    requests = _requests(args, tokenizer, args.num_prompts + args.num_warmups)
    warmups, requests = requests[: args.num_warmups], requests[args.num_warmups :]
    title = args.label or model
    base = RunConfig(
        base_url=base_url,
        endpoint=args.endpoint,
        model=model,
        burstiness=args.burstiness,
        duration=args.duration,
        timeout=args.timeout,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        extra_body=args.extra_body,
        headers=headers,
        seed=args.seed,
    )
    runs: list[tuple[str, RunResult, Summary]] = []
    failed = 0
    for rate, concurrency in itertools.product(args.request_rate, args.max_concurrency):
        config = replace(base, request_rate=rate, max_concurrency=concurrency)
        label = _label(rate, concurrency)
        show = not args.disable_tqdm
        if warmups:
            warm = replace(config, request_rate=math.inf)
            _measure(warm, model, warmups, label="warmup", progress=show, backend=args.backend)
        run = _measure(config, model, requests, label=label, progress=show, backend=args.backend)
        summary = summarize(run.results, run.duration)
        failed += summary.failed
        print(format_summary(summary, f"{title}: {label}"), flush=True)
        runs.append((label, run, summary))
    axis = _x_axis(args)
    if axis is not None:
        print(sweep_table("run", [(label, s) for label, _, s in runs]))
    if not args.no_save:
        _save(args, title, model, runs, axis)
    return 1 if failed else 0


def _save(
    args: argparse.Namespace,
    title: str,
    model: str,
    runs: list[tuple[str, RunResult, Summary]],
    axis: tuple[str, list[tuple[float, int | None]]] | None,
) -> None:
    args.result_dir.mkdir(parents=True, exist_ok=True)
    stem = args.result_filename or time.strftime("bench-%Y%m%d-%H%M%S")
    doc = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "label": title,
        "base_url": args.base_url,
        "model": model,
        "endpoint": args.endpoint,
        "dataset": args.dataset_name,
        "args": {
            k: _plain(v)
            for k, v in vars(args).items()
            if k != "api_key"  # a secret does not belong in a result file
        },
        "runs": [_run_json(run, s, args.save_detailed) for _, run, s in runs],
    }
    json_path = args.result_dir / f"{stem}.json"
    json_path.write_text(json.dumps(doc, indent=1, default=str))
    png_path = args.result_dir / f"{stem}.png"
    if axis is None:
        plot_run(runs[0][2], f"{title}: {runs[0][0]}", png_path)
    else:
        name, points = axis
        by_concurrency = len(args.max_concurrency) > 1
        several = len(args.max_concurrency) > 1 and len(args.request_rate) > 1
        short = Path(title).name or title
        series: dict[str, list[tuple[float, Summary]]] = {}
        for (rate, conc), (_, _, s) in zip(points, runs, strict=True):
            key = _label(rate, None) if by_concurrency else _label(math.inf, conc)
            x = float(conc or 0) if by_concurrency else rate
            series.setdefault(f"{short} {key}" if several else short, []).append((x, s))
        plot_sweep(series, name, title, png_path)
    print(f"wrote {json_path} and {png_path}")


def _plain(value: Any) -> Any:
    """``value`` as strict JSON: paths and infinities as strings."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, Path) or (isinstance(value, float) and math.isinf(value)):
        return str(value)
    return value


def _self_test(args: argparse.Namespace) -> int:
    """Run this client against the echo server in a child process; print its ceiling."""
    command = [sys.executable, "-m", "tserve.bench.echo_server", "--port", "0"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        url = server.stdout.readline().rsplit(" ", 1)[-1].strip()
        if not url.startswith("http"):
            raise SystemExit("echo server did not start")
        cases = [
            ("streaming: 256 requests x 256 chunks, 64 at once", 256, 256, 64, 0.0),
            ("paced: 256 requests x 64 chunks 10 ms apart, 256 at once", 256, 64, 256, 0.01),
            ("requests: 4000 requests x 1 chunk, 64 at once", 4000, 1, 64, 0.0),
        ]
        failed = 0
        for name, n, chunks, concurrency, itl in cases:
            config = RunConfig(
                base_url=url, max_concurrency=concurrency, extra_body={"echo_itl": itl}
            )
            cpu = time.process_time()
            reqs = [BenchRequest("x", 1, chunks)] * n
            run = _measure(config, "echo", reqs, label=name, progress=False, backend=args.backend)
            cpu = time.process_time() - cpu
            s = summarize(run.results, run.duration)
            failed += s.failed
            total = sum(r.chunks for r in run.results)
            print(
                f"{name} [{args.backend}]: {total / run.duration:,.0f} chunks/s, "
                f"{s.request_throughput:,.0f} requests/s, client CPU "
                f"{1e6 * cpu / max(1, total):.1f} us/chunk ({100 * cpu / run.duration:.0f}% of "
                f"a core), {s.failed} failed"
            )
        return 1 if failed else 0
    finally:
        server.terminate()
        server.wait(timeout=10)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m tserve bench`` and ``python -m tserve.bench``."""
    args = parser().parse_args(argv)
    raise_fd_limit()
    if args.self_test:
        return _self_test(args)
    return _bench(args)
