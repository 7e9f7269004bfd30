"""The load generator: arrivals, concurrency, one task per request, a bounded run.

:func:`run_benchmark` sends every :class:`BenchRequest` as a streamed
completion, one task each, in an anyio task group (trio or asyncio):

1. Arrivals: request ``i`` becomes due at ``arrival_times(...)[i]`` seconds
   after the start: all at once for an infinite rate, else gaps drawn from a
   gamma distribution of mean ``1/rate`` and shape ``burstiness`` (1 is a
   Poisson process; below 1 burstier, above 1 more regular), as vLLM does.
2. Concurrency: a due request waits for one of ``max_concurrency`` slots; its
   clock starts when it gets one (as in vLLM), before it connects.
3. Bounds: each request has ``timeout`` seconds (then it fails as
   ``timeout``); the whole run has ``duration`` seconds, after which no
   request is started and the ones in flight are cancelled and reported as
   ``unfinished``.

Measured on this 2-core machine against ``python -m tserve.bench.echo_server``
(see :mod:`tserve.bench.echo_server`), the client's own ceiling is stated in
:mod:`tserve.bench`'s docstring.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec

from tserve.bench._datasets import BenchRequest
from tserve.bench._http import Connection, ConnectionPool, Origin, ProtocolError
from tserve.bench._metrics import RequestResult, StreamRecorder
from tserve.bench._sse import SSEDecoder

__all__ = ["ENDPOINTS", "RunConfig", "RunResult", "arrival_times", "request_body", "run_benchmark"]

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_ERROR_BODY = 1000  # bytes of an error response kept for its detail


@dataclass(frozen=True)
class RunConfig:
    """One run's load; ``model`` None means the server's first model."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "completions"
    model: str | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    duration: float | None = None
    timeout: float = 600.0
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    seed: int = 0

    @property
    def path(self) -> str:
        return ENDPOINTS.get(self.endpoint, self.endpoint)

    @property
    def chat(self) -> bool:
        return self.path.endswith("/chat/completions")


@dataclass
class RunResult:
    """Every request's result and the run's duration (first start to last end)."""

    config: RunConfig
    results: list[RequestResult]
    duration: float


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """When each of ``n`` requests is due, in seconds from the start."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be positive")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.gammavariate(burstiness, theta)
    return times


def request_body(config: RunConfig, model: str, req: BenchRequest) -> bytes:
    """The JSON body of one streamed request."""
    body: dict[str, Any] = {"model": model}
    if config.chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    body |= {
        "max_tokens": req.output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        body["ignore_eos"] = True
    body |= config.extra_body
    return msgspec.json.encode(body)


async def _exchange(
    conn: Connection, request: bytes, recorder: StreamRecorder
) -> tuple[bool, bool]:
    """Send one request and read its response; ``(keep_alive, got_any_bytes)``."""
    try:
        parser = await conn.post(request)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        return False, False  # closed while idle
    sse = SSEDecoder()
    error_body = bytearray()
    got = False
    now = anyio.current_time()
    while not parser.done:
        data = await conn.receive()
        now = anyio.current_time()
        if not data:
            if not got:
                return False, False
            parser.eof()
            break
        got = True
        body = parser.feed(data)
        recorder.status = parser.status
        if not body:
            continue
        if parser.status != 200:
            error_body += body[: _ERROR_BODY - len(error_body)]
            continue
        for payload in sse.feed(body):
            recorder.on_payload(payload, now)
    for payload in sse.flush():
        recorder.on_payload(payload, now)
    if parser.status != 200:
        recorder.fail(str(parser.status), error_body.decode("utf-8", "replace"))
    return parser.keep_alive, True


async def _send(
    pool: ConnectionPool,
    request: bytes,
    recorder: StreamRecorder,
    limit: float,
) -> None:
    """One request, fully read, its outcome in ``recorder`` (never raises but Cancelled).

    A kept-alive connection that the server closed while idle fails before
    any byte comes back; the request is then sent once more on a new one.
    """
    conn: Connection | None = None
    try:
        with anyio.fail_after(limit):
            for _ in range(2):
                conn = await pool.acquire()
                keep_alive, got = await _exchange(conn, request, recorder)
                if got:
                    break
                await conn.aclose()
                conn = None
            else:
                recorder.fail("closed", "the server closed the connection without answering")
        if conn is not None and keep_alive:
            pool.release(conn)
            conn = None
    except TimeoutError:
        recorder.fail("timeout", f"no end after {limit:g} s")
    except ProtocolError as exc:
        recorder.fail("protocol_error", str(exc))
    except OSError as exc:
        kind = "connect_error" if conn is None else "read_error"
        recorder.fail(kind, str(exc) or type(exc).__name__)
    except Exception as exc:  # one request's surprise must not end the run
        recorder.fail("client_error", repr(exc))
    finally:
        if conn is not None:
            await conn.aclose()


async def run_benchmark(
    config: RunConfig,
    model: str,
    requests: Sequence[BenchRequest],
    *,
    on_done: Callable[[RequestResult], None] | None = None,
) -> RunResult:
    """Send ``requests`` under ``config``'s load; return every result (a checkpoint).

    ``on_done`` is called (synchronously) as each request ends, e.g. for a
    progress bar.
    """
    pool = ConnectionPool(Origin.parse(config.base_url))
    slots = anyio.CapacityLimiter(config.max_concurrency or max(1, len(requests)))
    due = arrival_times(len(requests), config.request_rate, config.burstiness, config.seed)
    headers = config.headers
    results: list[RequestResult] = []
    origin = anyio.current_time()

    async def one(req: BenchRequest) -> None:
        async with slots:
            start = anyio.current_time()
            recorder = StreamRecorder(start, origin=origin, prompt_tokens=req.prompt_len)
            try:
                wire = pool.request_bytes(config.path, request_body(config, model, req), headers)
                await _send(pool, wire, recorder, config.timeout)
            except anyio.get_cancelled_exc_class():
                recorder.fail("unfinished", "in flight when the run's duration ran out")
                raise
            finally:  # a run cut short by its duration still reports this request
                result = recorder.finish(anyio.current_time())
                results.append(result)
                if on_done is not None:
                    on_done(result)

    with anyio.move_on_after(config.duration if config.duration else math.inf):
        async with anyio.create_task_group() as tg:
            for req, at in zip(requests, due, strict=True):
                await anyio.sleep_until(origin + at)
                tg.start_soon(one, req)
    with anyio.CancelScope(shield=True):
        await pool.aclose()
    end = max((r.start + r.e2e for r in results), default=0.0)
    first = min((r.start for r in results), default=0.0)
    return RunResult(config, results, end - first)
