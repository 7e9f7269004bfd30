"""What one request measured, and what a run sums up to (sans-IO arithmetic).

A :class:`StreamRecorder` turns the timed SSE payloads of one streamed
completion into a :class:`RequestResult`; :func:`summarize` turns a run's
results into a :class:`Summary`. Definitions, all times in seconds:

* **TTFT**: request start (before connecting) to the first chunk that carries
  output text (``choices[].text``, ``delta.content`` or
  ``delta.reasoning_content``). Chunks without text (a role announcement, a
  finish reason alone, text held back mid-character) carry no visible token
  and are not counted; vLLM's client counts any chunk with choices, so a
  server that sends a role chunk first would get a near-zero TTFT there.
* **ITL**: every gap between two consecutive text chunks (a chunk may hold
  several tokens; the gaps are what a reader sees). Pooled over requests.
* **TPOT**: ``(E2E - TTFT) / (output_tokens - 1)`` per request with more than
  one output token.
* **E2E**: request start to the end of the stream.
* **output tokens**: ``usage.completion_tokens`` of the usage chunk, else the
  number of text chunks.
* **throughput**: tokens of the successful requests over the run's duration.
* **peak concurrency**: the most requests whose [start, end) overlapped.

A request succeeds when its status is 200, no event carried an ``error`` and
the stream ended with ``[DONE]``, a finish reason or a usage chunk.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec

__all__ = [
    "LATENCIES",
    "LatencyStats",
    "RequestResult",
    "StreamRecorder",
    "Summary",
    "peak_concurrency",
    "percentile",
    "summarize",
]

LATENCIES = ("ttft", "tpot", "itl", "e2e")
PERCENTILES = (50.0, 90.0, 95.0, 99.0)


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it; ``start`` is relative to the run's start."""

    ok: bool
    start: float
    e2e: float
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    chunks: int = 0
    status: int = 0
    error: str | None = None  # the error's kind: an HTTP status, or a word
    detail: str = ""

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


class StreamRecorder:
    """Times the payloads of one SSE stream; :meth:`finish` makes its result.

    ``start`` and every ``now`` are readings of one monotonic clock;
    ``prompt_tokens`` is the client's count, replaced by the usage chunk's.
    """

    def __init__(self, start: float, *, origin: float, prompt_tokens: int) -> None:
        self.start = start
        self.origin = origin  # the run's start, for RequestResult.start
        self.prompt_tokens = prompt_tokens
        self.status = 0
        self.first: float | None = None  # time of the first text chunk
        self.last: float | None = None  # time of the latest text chunk
        self.itl: list[float] = []
        self.chunks = 0
        self.usage_tokens: int | None = None
        self.ended = False  # [DONE], a finish reason or usage seen
        self.error: str | None = None
        self.detail = ""

    def on_payload(self, payload: bytes, now: float) -> None:
        """One event's data, received at ``now``."""
        if payload == b"[DONE]":
            self.ended = True
            return
        try:
            chunk = _decode_chunk(payload)
        except msgspec.DecodeError:
            self.fail("bad_event", payload[:200].decode("utf-8", "replace"))
            return
        if chunk.error is not None:
            self.fail("stream_error", str(chunk.error)[:200])
            return
        if chunk.usage is not None:
            self.ended = True
            if chunk.usage.completion_tokens is not None:
                self.usage_tokens = chunk.usage.completion_tokens
            if chunk.usage.prompt_tokens is not None:
                self.prompt_tokens = chunk.usage.prompt_tokens
        for choice in chunk.choices or ():
            if choice.finish_reason is not None:
                self.ended = True
            delta = choice.delta
            text = (
                choice.text
                if delta is None
                else (delta.content or "") + (delta.reasoning_content or "")
            )
            if text:
                self._text_chunk(now)

    def _text_chunk(self, now: float) -> None:
        if self.last is None:
            self.first = now
        else:
            self.itl.append(now - self.last)
        self.last = now
        self.chunks += 1

    def fail(self, kind: str, detail: str = "") -> None:
        """Mark the request failed; the first failure is the one reported."""
        if self.error is None:
            self.error, self.detail = kind, detail

    def finish(self, now: float) -> RequestResult:
        """The result, with the stream's end at ``now``."""
        error = self.error
        if error is None and self.status != 200:
            error = str(self.status)
        if error is None and not self.ended:
            error = "incomplete"
        return RequestResult(
            ok=error is None,
            start=self.start - self.origin,
            e2e=now - self.start,
            ttft=None if self.first is None else self.first - self.start,
            itl=self.itl,
            output_tokens=self.usage_tokens if self.usage_tokens is not None else self.chunks,
            prompt_tokens=self.prompt_tokens,
            chunks=self.chunks,
            status=self.status,
            error=error,
            detail=self.detail,
        )


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation (numpy's default); nan if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class LatencyStats:
    """One latency over a run, in seconds; ``p`` maps a percentile to its value."""

    count: int
    mean: float
    median: float
    p99: float
    p: dict[str, float]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LatencyStats:
        def num(v: float | None) -> float:
            return math.nan if v is None else v

        p = {k: num(v) for k, v in data["p"].items()}
        return cls(data["count"], num(data["mean"]), num(data["median"]), num(data["p99"]), p)

    @classmethod
    def of(cls, values: list[float]) -> LatencyStats:
        mean = math.fsum(values) / len(values) if values else math.nan
        p = {f"p{q:g}": percentile(values, q) for q in PERCENTILES}
        return cls(len(values), mean, p["p50"], p["p99"], p)


@dataclass(frozen=True)
class Summary:
    """A run summed up; throughputs per second of ``duration``."""

    requests: int
    completed: int
    failed: int
    errors: dict[str, int]
    duration: float
    input_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    total_throughput: float
    peak_concurrency: int
    latency: dict[str, LatencyStats]

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (a nan, the latency of no request, is written as null)."""
        return _nan_to_null(asdict(self))  # type: ignore[no-any-return]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Summary:
        fields = dict(data)
        fields["latency"] = {k: LatencyStats.from_json(v) for k, v in data["latency"].items()}
        return cls(**fields)


def _nan_to_null(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_to_null(v) for k, v in value.items()}
    return value


def peak_concurrency(results: list[RequestResult]) -> int:
    """The most requests in flight at once: a sweep over [start, start + e2e)."""
    edges = sorted(
        [(r.start, 1) for r in results] + [(r.start + r.e2e, -1) for r in results],
        key=lambda e: (e[0], e[1]),  # an end before a start at the same instant
    )
    live = peak = 0
    for _, step in edges:
        live += step
        peak = max(peak, live)
    return peak


def summarize(results: list[RequestResult], duration: float) -> Summary:
    """Sum up a run that took ``duration`` seconds."""
    ok = [r for r in results if r.ok]
    errors = Counter(r.error or "?" for r in results if not r.ok)
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration if duration > 0 else math.nan
    latency = {
        "ttft": LatencyStats.of([r.ttft for r in ok if r.ttft is not None]),
        "tpot": LatencyStats.of([t for r in ok if (t := r.tpot) is not None]),
        "itl": LatencyStats.of([gap for r in ok for gap in r.itl]),
        "e2e": LatencyStats.of([r.e2e for r in ok]),
    }
    return Summary(
        requests=len(results),
        completed=len(ok),
        failed=len(results) - len(ok),
        errors=dict(sorted(errors.items())),
        duration=duration,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        request_throughput=len(ok) * per_s,
        output_throughput=output_tokens * per_s,
        total_throughput=(input_tokens + output_tokens) * per_s,
        peak_concurrency=peak_concurrency(results),
        latency=latency,
    )
