"""The HTTP load: ``tserve.bench``'s client in a child process of its own.

``python -m benchmarks.frontend_table._client SPEC`` (SPEC: the JSON of a
:class:`ClientSpec`) sends ``requests`` streamed completions over at most
``concurrency`` keep-alive connections, one request after another on each,
and prints one JSON line: the run's :class:`tserve.bench._metrics.Summary`
and the CPU seconds this process used for the run alone (not its start).
A child process so that the client shares no event loop and no GIL with
anything it measures.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import trio

from tserve._host import raise_fd_limit
from tserve.bench._client import RunConfig, run_benchmark
from tserve.bench._datasets import BenchRequest
from tserve.bench._metrics import summarize

__all__ = ["ClientSpec", "client_argv", "prompt"]

SERVED_NAME = "table"  # the server's --served-model-name


@dataclass(frozen=True)
class ClientSpec:
    """One HTTP run, as the parent hands it to the child."""

    base_url: str
    requests: int
    max_tokens: int
    concurrency: int
    timeout: float  # seconds one request may take before it counts as failed


def prompt(index: int) -> str:
    """The text prompt of request ``index``, the same embedded and over HTTP."""
    return f"Request {index}: tell me a story about sockets."


def client_argv(spec: ClientSpec) -> list[str]:
    """The child's command line."""
    return [sys.executable, "-m", "benchmarks.frontend_table._client", json.dumps(asdict(spec))]


async def _run(spec: ClientSpec) -> dict[str, Any]:
    config = RunConfig(
        base_url=spec.base_url,
        max_concurrency=spec.concurrency,
        timeout=spec.timeout,
        ignore_eos=True,
        temperature=0.0,
    )
    requests = [BenchRequest(prompt(i), 0, spec.max_tokens) for i in range(spec.requests)]
    cpu0 = time.process_time()
    run = await run_benchmark(config, SERVED_NAME, requests)
    cpu = time.process_time() - cpu0
    return {"summary": summarize(run.results, run.duration).to_json(), "cpu_s": cpu}


def main() -> None:
    """Run the spec in ``sys.argv[1]``; print the result as one JSON line. Blocks."""
    raise_fd_limit()
    spec = ClientSpec(**json.loads(sys.argv[1]))
    print(json.dumps(trio.run(_run, spec)), flush=True)


if __name__ == "__main__":
    main()
