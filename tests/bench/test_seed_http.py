"""The seed benchmark's sans-IO pieces: response outcomes and ``/metrics`` parsing."""

from __future__ import annotations

import pytest

from benchmarks.seed_http._outcome import Outcome, ResponseReader
from benchmarks.seed_http._sampler import parse_metrics

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
TOKEN = b'{"choices":[{"index":0,"text":"a","finish_reason":null}]}'
USAGE = b'{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}'


def _stream(*payloads: bytes, last_chunk: bool = True) -> bytes:
    """A chunked SSE response, one event per chunk, as a server writes it."""
    out = HEAD
    for payload in payloads:
        event = b"data: " + payload + b"\n\n"
        out += b"%x\r\n%s\r\n" % (len(event), event)
    return out + (b"0\r\n\r\n" if last_chunk else b"")


def _outcome(raw: bytes, piece: int) -> Outcome:
    """Feed ``raw`` in pieces of ``piece`` bytes, as reads would, until the reader is done."""
    reader = ResponseReader()
    for start in range(0, len(raw), piece):
        if reader.done:
            break
        reader.feed(raw[start : start + piece])
    return reader.outcome()


@pytest.mark.parametrize("piece", [1, 7, 1 << 20])
@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (_stream(TOKEN, TOKEN, USAGE, b"[DONE]"), Outcome("ok", 200, 2)),
        (_stream(TOKEN, USAGE, b"[DONE]", TOKEN), Outcome("data_after_done", 200, 2)),
        (_stream(TOKEN, TOKEN, USAGE), Outcome("no_done", 200, 2)),
        (_stream(TOKEN, b"[DONE]"), Outcome("no_usage", 200)),
        (_stream(TOKEN, b'{"error":{"message":"engine died"}}'), Outcome("sse_error_event", 200)),
        (_stream(b"{not json"), Outcome("bad_json", 200)),
        (_stream(TOKEN, USAGE, b"[DONE]", last_chunk=False), Outcome("truncated_body", 200)),
        (b"", Outcome("no_response")),
        (b"HTTP/1.1 200 OK\r\nContent-Ty", Outcome("truncated_head")),
        (b"SSH-2.0-OpenSSH\r\n\r\n", Outcome("protocol_error")),
    ],
)
def test_outcome_of_a_response(raw: bytes, expected: Outcome, piece: int) -> None:
    assert _outcome(raw, piece) == expected


def test_an_error_response_ends_with_its_length_not_at_eof() -> None:
    body = b'{"error":{"message":"busy"}}'
    raw = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    reader = ResponseReader()
    reader.feed(raw)
    assert reader.done
    assert reader.outcome() == Outcome("http_503", 503)


def test_a_complete_stream_is_done_at_its_last_chunk() -> None:
    reader = ResponseReader()
    reader.feed(_stream(TOKEN, USAGE, b"[DONE]"))
    assert reader.done


def test_metrics_gauges_and_completions_by_status() -> None:
    text = (
        b"# TYPE tserve_requests_live gauge\n"
        b"tserve_requests_live 3\n"
        b"tserve_requests_running 2.0\n"
        b'tserve_http_requests_total{route="/v1/completions",status="200"} 10\n'
        b'tserve_http_requests_total{route="/v1/completions",status="503"} 1\n'
        b'tserve_http_requests_total{route="/health",status="200"} 7\n'
    )
    assert parse_metrics(text) == {
        "live": 3.0,
        "running": 2.0,
        "completions_by_status": {"200": 10.0, "503": 1.0},
    }
