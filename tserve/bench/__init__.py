"""``python -m tserve bench``: a serving benchmark for any OpenAI-compatible server.

In the spirit of vLLM's ``benchmark_serving``: it streams completions
(``stream_options.include_usage``) under a chosen arrival process and
concurrency, and reports TTFT, TPOT, ITL and E2E latency (mean, median, p99),
throughput (requests/s, output and total tokens/s), errors by kind and the
peak concurrency, as text, JSON and a PNG plot. See :mod:`._metrics` for the
exact definitions and :mod:`._client` for the load.

The client's own ceiling, measured on this project's 2-core machine against
``python -m tserve.bench.echo_server`` in another process
(``python -m tserve bench --self-test``): about 47,000 SSE chunks/s and 5,600
requests/s, limited by the echo server; the client itself spends about 7 µs
of CPU per chunk when chunks arrive together and about 28 µs when each
arrives in its own read, and about 100 µs per short request, so one core
carries some 35,000 chunks/s or 10,000 requests/s. httpx on the same tests
measured 3,500 chunks/s and 340 requests/s, which is why the client carries
its own small HTTP/1.1 parser (:mod:`._http`).

Modules: ``_cli`` (options, the sweep, the self-test; ``__main__`` runs it),
``_client`` (the load), ``_datasets`` (prompts made offline), ``_http`` and
``_sse`` (sans-IO response and event parsing, one IO edge), ``_metrics``
(sans-IO sums), ``_report`` (table, JSON, plots), ``echo_server`` (a trivial
server for the client's own ceiling).
"""

from tserve.bench._cli import main
from tserve.bench._client import RunConfig, RunResult, arrival_times, run_benchmark
from tserve.bench._datasets import BenchRequest, random_requests, sonnet_requests
from tserve.bench._metrics import RequestResult, Summary, summarize

__all__ = [
    "BenchRequest",
    "RequestResult",
    "RunConfig",
    "RunResult",
    "Summary",
    "arrival_times",
    "main",
    "random_requests",
    "run_benchmark",
    "sonnet_requests",
    "summarize",
]
