"""Metric arithmetic on canned streams, checked against values worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tserve.bench._metrics import (
    RequestResult,
    StreamRecorder,
    Summary,
    peak_concurrency,
    percentile,
    summarize,
)


def _chat(content: str | None = None, finish: str | None = None, role: bool = False) -> bytes:
    delta: list[str] = []
    if role:
        delta.append('"role":"assistant"')
    if content is not None:
        delta.append(f'"content":"{content}"')
    fin = "null" if finish is None else f'"{finish}"'
    return (
        b'{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{'
        + ",".join(delta).encode()
        + b'},"finish_reason":'
        + fin.encode()
        + b'}],"usage":null}'
    )


# (time, payload): a role-only chunk, three text chunks with an empty one between,
# a finish reason alone, the usage chunk and [DONE].
CANNED = [
    (10.10, _chat(role=True, content="")),
    (10.25, _chat("A")),
    (10.30, _chat("B")),
    (10.30, _chat("")),  # text held back mid-character: no visible token
    (10.45, _chat("CD")),
    (10.50, _chat(finish="length")),
    (10.55, b'{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":5}}'),
    (10.55, b"[DONE]"),
]


def _record(events: list[tuple[float, bytes]], status: int = 200) -> RequestResult:
    rec = StreamRecorder(10.0, origin=9.0, prompt_tokens=6)
    rec.status = status
    for now, payload in events:
        rec.on_payload(payload, now)
    return rec.finish(10.6)


def test_canned_chat_stream() -> None:
    r = _record(CANNED)
    assert r.ok and r.error is None
    assert r.start == pytest.approx(1.0)  # 10.0 - origin 9.0
    assert r.ttft == pytest.approx(0.25)  # the first chunk with text, not the role chunk
    assert r.itl == pytest.approx([0.05, 0.15])  # 10.25→10.30→10.45
    assert r.e2e == pytest.approx(0.6)
    assert r.output_tokens == 5  # from usage, not the 3 text chunks
    assert r.chunks == 3
    assert r.prompt_tokens == 7  # the server's count replaces the client's 6
    assert r.tpot == pytest.approx((0.6 - 0.25) / 4)  # 0.0875


def test_completions_stream_without_usage_counts_chunks() -> None:
    events = [
        (10.2, b'{"choices":[{"index":0,"text":"x","finish_reason":null}]}'),
        (10.5, b'{"choices":[{"index":0,"text":"y","finish_reason":"stop"}]}'),
    ]
    r = _record(events)  # no [DONE] (some peers send none): the finish reason ends it
    assert r.ok
    assert r.output_tokens == 2 and r.prompt_tokens == 6
    assert r.ttft == pytest.approx(0.2)
    assert r.itl == pytest.approx([0.3])
    assert r.tpot == pytest.approx(0.4)  # (0.6 - 0.2) / 1


@pytest.mark.parametrize(
    ("events", "status", "error"),
    [
        (CANNED, 503, "503"),
        ([(10.2, b'{"error":{"message":"engine died"}}')], 200, "stream_error"),
        ([(10.2, _chat("A"))], 200, "incomplete"),  # cut off: no end marker
        ([(10.2, b"{not json")], 200, "bad_event"),
    ],
)
def test_failures(events: list[tuple[float, bytes]], status: int, error: str) -> None:
    r = _record(events, status)
    assert not r.ok and r.error == error


def test_single_token_has_no_tpot() -> None:
    r = _record([(10.3, _chat("A", finish="length"))])
    assert r.ok and r.output_tokens == 1 and r.tpot is None and r.itl == []


def _result(
    start: float, e2e: float, ttft: float, itl: list[float], out: int, prompt: int
) -> RequestResult:
    return RequestResult(
        ok=True, start=start, e2e=e2e, ttft=ttft, itl=itl, output_tokens=out, prompt_tokens=prompt
    )


def test_summarize_by_hand() -> None:
    results = [
        _result(0.0, 1.0, 0.2, [0.1, 0.3], 4, 10),
        _result(0.5, 2.0, 0.4, [0.2], 2, 20),
        RequestResult(ok=False, start=0.6, e2e=0.01, status=503, error="503"),
    ]
    s = summarize(results, duration=2.5)
    assert (s.requests, s.completed, s.failed) == (3, 2, 1)
    assert s.errors == {"503": 1}
    assert s.request_throughput == pytest.approx(0.8)  # 2 / 2.5
    assert s.output_throughput == pytest.approx(2.4)  # 6 / 2.5
    assert s.total_throughput == pytest.approx(14.4)  # (30 + 6) / 2.5
    assert s.peak_concurrency == 3  # all three overlap at t = 0.6
    ttft, itl, tpot, e2e = (s.latency[k] for k in ("ttft", "itl", "tpot", "e2e"))
    assert (ttft.mean, ttft.median) == pytest.approx((0.3, 0.3))
    assert ttft.p99 == pytest.approx(0.398)  # 0.2 + 0.99 * (0.4 - 0.2)
    assert itl.count == 3
    assert (itl.mean, itl.median) == pytest.approx((0.2, 0.2))
    assert itl.p99 == pytest.approx(0.298)  # sorted .1 .2 .3, position 1.98
    assert tpot.mean == pytest.approx((0.8 / 3 + 1.6) / 2)
    assert e2e.median == pytest.approx(1.5)
    assert Summary.from_json(s.to_json()) == s


def test_summary_of_nothing_is_nan_and_json_null() -> None:
    s = summarize([], duration=0.0)
    assert s.completed == 0 and math.isnan(s.latency["ttft"].median)
    assert s.to_json()["latency"]["ttft"]["median"] is None
    assert math.isnan(Summary.from_json(s.to_json()).latency["ttft"].p99)


def test_peak_concurrency_end_before_start() -> None:
    back_to_back = [
        RequestResult(ok=True, start=0.0, e2e=1.0),
        RequestResult(ok=True, start=1.0, e2e=1.0),
    ]
    assert peak_concurrency(back_to_back) == 1


@given(st.lists(st.floats(0, 1e3), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_matches_numpy(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), abs=1e-9)
