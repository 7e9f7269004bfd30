"""The seed benchmark: its sans-IO pieces (response outcomes, ``/metrics`` parsing,
merging the clients' records), one load generator process against sockets that
refuse or never answer, and a small whole run against a real server."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest

from benchmarks.seed_http._cli import measure, parse_args
from benchmarks.seed_http._load import KIND, START, ClientConfig, merge
from benchmarks.seed_http._outcome import Outcome, ResponseReader
from benchmarks.seed_http._sampler import parse_metrics
from benchmarks.seed_http._summary import passed

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


def _record(start: float, end: float | None, kind: str = "ok") -> list[Any]:
    return [start, start, None, end, 200, 8, kind]


def test_merge_puts_the_parts_back_in_request_order() -> None:
    part0 = {"records": [_record(0.0, 2.0), _record(1.0, 1.5)], "cpu_s": 1.0, "fd_limit": 9}
    part1 = {"records": [_record(0.5, None, "unfinished")], "cpu_s": 0.5, "fd_limit": 8}
    merged = merge([part0, part1], 3, 0.5)
    assert [r[START] for r in merged["records"] if r] == [0.0, 0.5, 1.0]
    assert merged["peak_in_flight"] == 3  # at 1.0: requests 0, 1 and 2
    assert (merged["cpu_s"], merged["fd_limit"], merged["clients"]) == (1.5, 8, 2)
    # t, in flight, started, ended, every 0.5 s from the first start
    assert merged["timeline"][:5] == [[0.0, 1, 1, 0], [0.5, 2, 2, 0], [1.0, 3, 3, 0],
                                      [1.5, 2, 3, 1], [2.0, 1, 3, 2]]  # fmt: skip


def test_merge_leaves_a_missing_part_never_started() -> None:
    merged = merge([{"records": [_record(0.0, 1.0)], "cpu_s": 0.1, "fd_limit": 9}, None], 2, 1.0)
    assert merged["records"][1] is None
    assert merged["peak_in_flight"] == 1


def _run_child(config: ClientConfig) -> dict[str, Any]:
    """One load generator process, as the benchmark runs it: ready, start time, result."""
    argv = [sys.executable, "-m", "benchmarks.seed_http._load", json.dumps(asdict(config))]
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline() == b"ready\n"
        child.stdin.write(f"{time.monotonic()!r}\n".encode())
        child.stdin.close()
        assert child.wait(60) == 0  # a hang guard
    finally:
        child.kill()
        child.wait()
    return dict(json.loads(Path(f"{config.out}.{config.part}").read_text()))


def _config(port: int, out: Path, **changes: Any) -> ClientConfig:
    config = ClientConfig(port, 6, 1000.0, 8, "fixed", 0, time.monotonic() + 30, str(out))
    return replace(config, **changes)


def test_a_refused_connection_is_a_connect_error(tmp_path: Path) -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]  # bound, never listening: connections are refused
        result = _run_child(_config(port, tmp_path / "out"))
    assert [r[KIND] for r in result["records"]] == ["connect_ECONNREFUSED"] * 6


def test_requests_open_at_the_deadline_are_unfinished(tmp_path: Path) -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # the kernel completes the handshakes; nobody answers
        config = _config(silent.getsockname()[1], tmp_path / "out", clients=2, part=1)
        # The deadline is fixed before the child starts: it must leave room for
        # the child's start on a loaded machine (seconds), or nothing is sent.
        result = _run_child(replace(config, deadline=time.monotonic() + 10))
    assert [r[KIND] for r in result["records"]] == ["unfinished"] * 3  # requests 1, 3 and 5


@pytest.mark.slow
def test_a_small_run_against_a_real_server_passes(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole benchmark, small: a real ``tserve serve`` (echo engine), three clients."""
    monkeypatch.setenv("TSERVE_EMBEDDING_MODEL", "none")
    argv = ["--requests", "60", "--rate", "200", "--clients", "3", "--model", str(tiny_model_dir)]
    argv += ["--engine-kind", "echo", "--max-seconds", "120", "--interval", "0.1"]
    result = measure(parse_args([*argv, "--tail-seconds", "0.2"]), tmp_path / "server.log")
    assert (result["ok"], result["errors_by_kind"], result["wrong_token_counts"]) == (60, {}, 0)
    assert result["server_completions_by_status"] == {"200": 60.0}
    assert result["client_processes"] == 3
    assert passed(result)
