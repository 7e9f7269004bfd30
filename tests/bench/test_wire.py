"""The sans-IO HTTP response parser, the SSE decoder and the arrival process."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tserve.bench._client import arrival_times
from tserve.bench._http import ProtocolError, ResponseParser
from tserve.bench._sse import SSEDecoder

EVENTS = [b'{"a":1}', b'{"b":"x y"}', b"[DONE]"]
SSE = b"".join(b"data: " + e + b"\n\n" for e in EVENTS)


def _chunked(body: bytes, size: int) -> bytes:
    parts = [body[i : i + size] for i in range(0, len(body), size)]
    out = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in parts)
    return out + b"0\r\nX-Trailer: y\r\n\r\n"


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
CHUNKED = HEAD + _chunked(SSE, 7)


def _feed(parser: ResponseParser, data: bytes, cuts: list[int]) -> bytes:
    body = b""
    last = 0
    for cut in [*sorted(cuts), len(data)]:
        body += parser.feed(data[last:cut])
        last = cut
    return body


@given(st.lists(st.integers(0, len(CHUNKED)), max_size=20))
def test_chunked_any_split(cuts: list[int]) -> None:
    p = ResponseParser()
    assert _feed(p, CHUNKED, cuts) == SSE
    assert p.done and p.status == 200 and p.keep_alive


def test_content_length_then_next_response_ignored() -> None:
    p = ResponseParser()
    body = p.feed(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 5\r\n\r\nbusy!extra")
    assert (body, p.status, p.done) == (b"busy!", 503, True)


def test_interim_response_then_close_delimited() -> None:
    p = ResponseParser()
    head = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.0 200 OK\r\n\r\n"
    assert p.feed(head + b"data: 1") == b"data: 1"
    assert not p.done and not p.keep_alive
    p.eof()
    assert p.done and p.status == 200


def test_connection_close_header() -> None:
    p = ResponseParser()
    p.feed(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
    assert p.done and not p.keep_alive


@pytest.mark.parametrize("data", [CHUNKED[:-20], HEAD, b"HTTP/1.1 200"])
def test_cut_short_raises_at_eof(data: bytes) -> None:
    p = ResponseParser()
    p.feed(data)
    with pytest.raises(ProtocolError):
        p.eof()


@pytest.mark.parametrize("data", [b"SSH-2.0-OpenSSH\r\n\r\n", HEAD + b"zz\r\n"])
def test_not_http_raises(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        ResponseParser().feed(data)


@given(st.lists(st.integers(0, 200), max_size=10), st.sampled_from([b"\n", b"\r\n", b"\r"]))
def test_sse_any_split_any_line_end(cuts: list[int], eol: bytes) -> None:
    stream = b": comment" + eol + eol
    stream += b"event: x" + eol + b"data: {" + eol + b"data:  }" + eol + eol
    stream += SSE.replace(b"\n", eol)
    cuts = sorted(c for c in cuts if c <= len(stream))
    decoder = SSEDecoder()
    got: list[bytes] = []
    last = 0
    for cut in [*cuts, len(stream)]:
        got += decoder.feed(stream[last:cut])
        last = cut
    got += decoder.flush()
    assert got == [b"{\n }", *EVENTS]  # one space after "data:" is dropped, no more


def test_sse_flush_last_event_without_blank_line() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: 1\n\ndata: 2\n") == [b"1"]
    assert decoder.flush() == [b"2"]


def test_arrivals() -> None:
    assert arrival_times(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    times = arrival_times(4000, 20.0, 1.0, 7)
    assert times == arrival_times(4000, 20.0, 1.0, 7)  # seeded
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert statistics.fmean(gaps) == pytest.approx(0.05, rel=0.1)
    cv2 = statistics.pvariance(gaps) / statistics.fmean(gaps) ** 2
    assert cv2 == pytest.approx(1.0, rel=0.15)  # exponential: CV² = 1
    bursty = arrival_times(4000, 20.0, 0.25, 7)
    gaps = [b - a for a, b in itertools.pairwise(bursty)]
    assert statistics.pvariance(gaps) / statistics.fmean(gaps) ** 2 == pytest.approx(4, rel=0.25)
    with pytest.raises(ValueError):
        arrival_times(1, 0.0, 1.0, 0)
