"""The seed failure over HTTP: thousands of streaming completions at a fixed rate.

Run: ``python -m benchmarks.seed_http [--requests 10000] [--rate 1000] [--max-tokens 8]
[--model tiny|default|PATH] [--max-seconds 600]``

Frontends that open one ZMQ socket per request died at about 1,000 in-flight
requests (``zmq.MAX_SOCKETS``, the fd limit, then 500s). This benchmark
recreates that load against a real ``python -m tserve serve`` and checks the
two things tserve promises: no request fails, and the number of ZMQ sockets
between the API process and the engine stays constant while fds grow only
with HTTP connections.

Three processes, all on loopback:

* the **server**, ``python -m tserve serve`` (its API process plus its engine
  child), started with ``--port 0`` and a ``--max-pending`` above
  ``--requests`` so that admission control refuses none of them;
* the **load generator**, this module again in a child process (so it does
  not share this process's event loop): open-loop arrivals at ``--rate``
  requests/s (a fixed or Poisson schedule), one TCP connection per request,
  raw HTTP/1.1 over trio sockets (a request is one ``send_all``; the response
  is read to its last chunk and parsed once, which keeps the client cheap on
  a small machine). Each request streams ``--max-tokens`` tokens with
  ``ignore_eos`` and ``stream_options.include_usage``; the client reads every
  SSE event to ``[DONE]`` and records its status, token count and error kind;
* **this process**, the sampler: every ``--interval`` seconds it counts the
  server's fds (``/proc/PID/fd``) and the engine's accepted connections on its
  ``ipc://`` path (``/proc/PID/net/unix``), and scrapes ``/metrics`` (live
  requests, HTTP generations in flight, engine running and waiting); about
  once a second it also classifies every server fd (TCP, unix, eventfd, ...)
  and counts the API-side ZMQ sockets exactly: the server's unix sockets whose
  peer is one of the engine's sockets on the ipc path (peer inodes from
  ``ss -x``).

The run is bounded: a finite number of requests and a hard ``--max-seconds``
cap on the whole run, after which unfinished requests count as errors
(``unfinished``). At the end the server gets SIGTERM (SIGKILL past a grace
period), its engine is checked gone, and the result is printed and written to
``results/seed_http-<time>.json`` (and a timeline PNG when matplotlib is
installed). The exit status is 0 only if every request was a 200 with exactly
``--max-tokens`` completion tokens and the ZMQ socket count never changed.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import math
import os
import platform
import random
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx
import msgspec
import trio

from benchmarks._results import REPO_ROOT, result_stem, write_json

_MODEL_NAME = "seed"  # --served-model-name; every request asks for it
_URL_LINE = re.compile(rb"serving '.*' at http://127\.0\.0\.1:(\d+)/v1")


def _raise_fd_limit() -> int:
    """Raise this process's RLIMIT_NOFILE soft limit to the hard limit; return it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


# -- one HTTP response, parsed once it is complete (sans-IO) --------------------


@dataclass
class Outcome:
    """What one streaming completion got back. ``kind`` is ``ok`` or an error kind."""

    kind: str
    status: int = 0
    tokens: int = -1  # usage.completion_tokens; -1 when no usage chunk arrived


def _dechunk(data: bytes) -> tuple[bytes, bool]:
    """Decode a ``Transfer-Encoding: chunked`` body; return it and whether it ended."""
    body = bytearray()
    pos = 0
    while True:
        eol = data.find(b"\r\n", pos)
        if eol < 0:
            return bytes(body), False
        size = int(data[pos:eol].split(b";", 1)[0], 16)  # ValueError: not chunked framing
        if size == 0:
            return bytes(body), True
        start = eol + 2
        if len(data) < start + size + 2:
            return bytes(body), False
        body += data[start : start + size]
        pos = start + size + 2


def parse_stream_response(raw: bytes) -> Outcome:
    """Classify one raw HTTP/1.1 response to a streaming completion.

    ``raw`` is everything read from the connection (to the last chunk or to
    EOF). A 200 must carry SSE events with a final usage chunk and end with
    ``data: [DONE]``; an ``error`` event, a missing ``[DONE]``, a body cut short
    or a non-200 status is an error of its own kind.
    """
    head, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep:
        return Outcome("no_response" if not raw else "truncated_head")
    lines = head.split(b"\r\n")
    try:
        status = int(lines[0].split()[1])
    except (IndexError, ValueError):
        return Outcome("bad_status_line")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip().lower()
    if headers.get(b"transfer-encoding") == b"chunked":
        try:
            body, complete = _dechunk(rest)
        except ValueError:
            return Outcome("bad_chunk", status)
    elif b"content-length" in headers:
        length = int(headers[b"content-length"])
        body, complete = rest[:length], len(rest) >= length
    else:
        body, complete = rest, True
    if status != 200:
        return Outcome(f"http_{status}", status)
    if not complete:
        return Outcome("truncated_body", status)
    return _parse_sse(body, status)


def _parse_sse(body: bytes, status: int) -> Outcome:
    tokens = -1
    done = False
    for event in body.replace(b"\r\n", b"\n").split(b"\n\n"):
        if not event.startswith(b"data:"):
            continue
        payload = event[5:].strip()
        if done:
            return Outcome("data_after_done", status, tokens)
        if payload == b"[DONE]":
            done = True
            continue
        try:
            chunk = msgspec.json.decode(payload)
        except msgspec.DecodeError:
            return Outcome("bad_json", status, tokens)
        if not isinstance(chunk, dict):
            return Outcome("bad_json", status, tokens)
        if "error" in chunk:
            return Outcome("sse_error_event", status, tokens)
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            tokens = int(usage.get("completion_tokens", -1))
    if not done:
        return Outcome("no_done", status, tokens)
    if tokens < 0:
        return Outcome("no_usage", status, tokens)
    return Outcome("ok", status, tokens)


# -- the load generator (a child process) ---------------------------------------


@dataclass
class ClientConfig:
    port: int
    requests: int
    rate: float
    max_tokens: int
    arrivals: str  # "fixed" or "poisson"
    seed: int
    deadline: float  # time.monotonic() past which unfinished requests are cancelled
    interval: float
    out: str  # where the client writes its JSON result


@dataclass
class _ClientState:
    in_flight: int = 0
    peak_in_flight: int = 0
    started: int = 0
    finished: int = 0
    # one row per request, indexed by _DUE ... _KIND below
    records: list[list[Any] | None] = field(default_factory=list)
    timeline: list[list[float]] = field(default_factory=list)  # t, in flight, started, done


# A request's record: when it was due, started, got its first byte and ended
# (time.monotonic(); None until then), its HTTP status, its completion tokens
# (-1: no usage chunk) and its outcome kind ("ok" or an error kind).
_DUE, _START, _FIRST, _END, _STATUS, _TOKENS, _KIND = range(7)


def _request_bytes(config: ClientConfig, index: int) -> bytes:
    body = msgspec.json.encode(
        {
            "model": _MODEL_NAME,
            "prompt": f"Request {index}: tell me a story about sockets.",
            "max_tokens": config.max_tokens,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
    )
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{config.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


def _error_kind(exc: BaseException, stage: str) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{stage}_{errno.errorcode.get(exc.errno, exc.errno)}"
    return f"{stage}_{type(exc).__name__}"


async def _exchange(sock: trio.socket.SocketType, request: bytes, record: list[Any]) -> bytes:
    """Send ``request``; read the response to its terminal chunk or to EOF.

    An SSE chunk ends ``\\n\\n\\r\\n``, never ``\\r\\n0\\r\\n\\r\\n``, so that ending
    is the terminal chunk; a Content-Length error response ends at EOF
    (the request says ``Connection: close``). Sets ``record[_FIRST]`` at the first byte.
    """
    view = memoryview(request)
    while view:
        view = view[await sock.send(view) :]
    raw = bytearray()
    while data := await sock.recv(65536):
        if record[_FIRST] is None:
            record[_FIRST] = time.monotonic()
        raw += data
        if raw.endswith(b"\r\n0\r\n\r\n"):
            break
    return bytes(raw)


async def _one_request(config: ClientConfig, state: _ClientState, index: int, due: float) -> None:
    record: list[Any] = [due, time.monotonic(), None, None, 0, -1, "unfinished"]
    state.records[index] = record
    state.started += 1
    state.in_flight += 1
    state.peak_in_flight = max(state.peak_in_flight, state.in_flight)
    try:
        # A bare trio socket: open_tcp_stream's happy-eyeballs nursery costs more
        # per request than everything else the client does.
        with trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                await sock.connect(("127.0.0.1", config.port))
            except OSError as exc:
                record[_KIND] = _error_kind(exc, "connect")
                return
            try:
                raw = await _exchange(sock, _request_bytes(config, index), record)
            except OSError as exc:
                record[_KIND] = _error_kind(exc, "io")
                return
        outcome = parse_stream_response(raw)
        record[_STATUS], record[_TOKENS], record[_KIND] = (
            outcome.status,
            outcome.tokens,
            outcome.kind,
        )
    finally:
        record[_END] = time.monotonic()
        state.in_flight -= 1
        state.finished += 1


async def _arrive(config: ClientConfig, state: _ClientState, nursery: trio.Nursery) -> None:
    """Start request i at its scheduled time (open loop: never waits for answers)."""
    rng = random.Random(config.seed)
    t0 = time.monotonic() + 0.05
    offset = 0.0
    for index in range(config.requests):
        if config.arrivals == "poisson":
            offset += rng.expovariate(config.rate) if index else 0.0
        else:
            offset = index / config.rate
        due = t0 + offset
        delay = due - time.monotonic()
        if delay > 0:
            await trio.sleep(delay)
        elif index % 64 == 0:
            await trio.lowlevel.checkpoint()  # behind schedule: let responses be read
        nursery.start_soon(_one_request, config, state, index, due)


async def _sample_client(config: ClientConfig, state: _ClientState) -> None:
    while True:
        state.timeline.append([time.monotonic(), state.in_flight, state.started, state.finished])
        await trio.sleep(config.interval)


async def _client_main(config: ClientConfig) -> dict[str, Any]:
    state = _ClientState(records=[None] * config.requests)
    with trio.move_on_at(trio.current_time() + (config.deadline - time.monotonic())):
        async with trio.open_nursery() as outer:
            outer.start_soon(_sample_client, config, state)
            async with trio.open_nursery() as requests:
                await _arrive(config, state, requests)
            outer.cancel_scope.cancel()
    state.timeline.append([time.monotonic(), state.in_flight, state.started, state.finished])
    return {
        "peak_in_flight": state.peak_in_flight,
        "records": state.records,
        "timeline": state.timeline,
        "fd_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "cpu_s": time.process_time(),
    }


def run_client(config: ClientConfig) -> None:
    """The load generator's whole life: raise the fd limit, send, write the result."""
    _raise_fd_limit()
    result = trio.run(_client_main, config)
    Path(config.out).write_text(json.dumps(result))


# -- the sampler: what the server holds -----------------------------------------


@dataclass
class ServerProcs:
    api_pid: int
    engine_pid: int
    ipc_path: str  # the engine's ipc:// socket path
    port: int = 0  # the HTTP port the API process listens on


def _find_engine(api_pid: int) -> ServerProcs | None:
    """The API process's engine child (``python -m tserve.gpu ipc://...``), if started."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
            ppid = int(stat.rpartition(")")[2].split()[1])
            if ppid != api_pid:
                continue
            argv = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        for arg in argv:
            if arg.startswith(b"ipc://"):
                return ServerProcs(api_pid, int(entry.name), arg[6:].decode())
    return None


def _fd_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def _fd_inodes(pid: int) -> tuple[Counter[str], set[int]]:
    """Counts of ``pid``'s fds by kind, and the inodes of its sockets."""
    kinds: Counter[str] = Counter()
    sockets: set[int] = set()
    with contextlib.suppress(OSError):
        for name in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{name}")
            except OSError:
                continue  # closed since listdir
            if target.startswith("socket:["):
                sockets.add(int(target[8:-1]))
            elif target.startswith("anon_inode:"):
                kinds[target[11:].strip("[]")] += 1
            elif target.startswith("pipe:"):
                kinds["pipe"] += 1
            else:
                kinds["file"] += 1
    return kinds, sockets


def _unix_inodes(pid: int) -> set[int]:
    """Inodes of every unix socket in ``pid``'s network namespace."""
    inodes: set[int] = set()
    with contextlib.suppress(OSError), open(f"/proc/{pid}/net/unix") as table:
        next(table)
        for line in table:
            inodes.add(int(line.split()[6]))
    return inodes


def _engine_ipc_connections(procs: ServerProcs) -> int:
    """The engine's accepted (connected, state 03) sockets on its ipc path."""
    count = 0
    with contextlib.suppress(OSError), open(f"/proc/{procs.engine_pid}/net/unix") as table:
        for line in table:
            parts = line.split()
            if len(parts) >= 8 and parts[7] == procs.ipc_path and parts[5] == "03":
                count += 1
    return count


async def _engine_peer_inodes(procs: ServerProcs) -> set[int] | None:
    """Peer inodes of the sockets on the engine's ipc path (``ss -x``), or None."""
    try:
        done = await trio.run_process(
            ["ss", "-xHn", "src", procs.ipc_path], capture_stdout=True, check=False
        )
    except OSError:
        return None
    peers: set[int] = set()
    for line in done.stdout.decode().splitlines():
        parts = line.split()
        if len(parts) >= 8 and parts[1] == "ESTAB":
            peers.add(int(parts[7]))
    return peers


async def _accept_queue(port: int) -> int | None:
    """Connections waiting in the kernel for the server to accept them (``ss -l``)."""
    try:
        done = await trio.run_process(
            ["ss", "-Hltn", "sport", "=", f":{port}"], capture_stdout=True, check=False
        )
    except OSError:
        return None
    rows = [line.split() for line in done.stdout.decode().splitlines()]
    return sum(int(row[1]) for row in rows if len(row) > 1 and row[0] == "LISTEN")


_TCP_COUNTERS = (
    "ListenOverflows",
    "ListenDrops",
    "TCPReqQFullDrop",
    "SyncookiesSent",
    "SyncookiesFailed",
    "TCPAbortOnData",
)


def _tcp_counters() -> dict[str, int]:
    """The kernel's listen-queue counters (``/proc/net/netstat``; the whole namespace)."""
    try:
        lines = [line.split() for line in Path("/proc/net/netstat").read_text().splitlines()]
    except OSError:
        return {}
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names and names[0] == "TcpExt:":
            table = dict(zip(names[1:], values[1:], strict=True))
            return {name: int(table[name]) for name in _TCP_COUNTERS if name in table}
    return {}


@dataclass
class FdCensus:
    """One full look at the API process's fds."""

    t: float
    total: int
    tcp_or_other_sockets: int
    unix_sockets: int
    zmq_to_engine: int | None  # API-side unix sockets whose peer is on the ipc path
    engine_ipc_connections: int
    other: dict[str, int]
    api_cpu_s: float  # user + system CPU seconds the API process has used so far
    accept_queue: int | None  # connections the kernel holds that the server has not accepted
    engine_cpu_s: float


_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used (``/proc/PID/stat``), or NaN."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / _TICKS


async def _census(procs: ServerProcs) -> FdCensus:
    kinds, sockets = _fd_inodes(procs.api_pid)
    unix = sockets & _unix_inodes(procs.api_pid)
    peers = await _engine_peer_inodes(procs)
    return FdCensus(
        t=time.monotonic(),
        total=len(sockets) + sum(kinds.values()),
        tcp_or_other_sockets=len(sockets - unix),
        unix_sockets=len(unix),
        zmq_to_engine=None if peers is None else len(unix & peers),
        engine_ipc_connections=_engine_ipc_connections(procs),
        other=dict(kinds),
        api_cpu_s=_cpu_seconds(procs.api_pid),
        engine_cpu_s=_cpu_seconds(procs.engine_pid),
        accept_queue=await _accept_queue(procs.port),
    )


_GAUGES = {
    b"tserve_requests_live": "live",
    b"tserve_http_generations_in_flight": "http_in_flight",
    b"tserve_requests_running": "running",
    b"tserve_requests_waiting": "waiting",
}


def _parse_metrics(text: bytes) -> dict[str, Any]:
    """The gauges this benchmark watches, and ``tserve_http_requests_total`` by status."""
    values: dict[str, Any] = {}
    by_status: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(b" ")
        if name in _GAUGES:
            values[_GAUGES[name]] = float(value)
        elif name.startswith(b'tserve_http_requests_total{route="/v1/completions"'):
            status = name.split(b'status="')[1].split(b'"')[0].decode()
            by_status[status] = float(value)
    values["completions_by_status"] = by_status
    return values


@dataclass
class Samples:
    """Everything the sampler saw, as parallel time series (time.monotonic())."""

    fds: list[tuple[float, int, int]] = field(default_factory=list)  # t, fds, ipc conns
    metrics: list[tuple[float, float, dict[str, Any]]] = field(default_factory=list)
    censuses: list[FdCensus] = field(default_factory=list)


async def _sample_fds(procs: ServerProcs, samples: Samples, interval: float) -> None:
    next_census = 0.0
    while True:
        now = time.monotonic()
        fds = _fd_count(procs.api_pid)
        samples.fds.append((now, fds, _engine_ipc_connections(procs)))
        if now >= next_census:
            samples.censuses.append(await _census(procs))
            next_census = now + 1.0
        await trio.sleep(max(0.0, now + interval - time.monotonic()))


async def _sample_metrics(client: httpx.AsyncClient, samples: Samples, interval: float) -> None:
    while True:
        start = time.monotonic()
        try:
            response = await client.get("/metrics", timeout=10.0)
            values = _parse_metrics(response.content)
        except httpx.HTTPError as exc:
            values = {"error": type(exc).__name__}
        samples.metrics.append((start, time.monotonic() - start, values))
        await trio.sleep(max(0.0, start + interval - time.monotonic()))


async def _sample_for(
    procs: ServerProcs, client: httpx.AsyncClient, samples: Samples, seconds: float, dt: float
) -> None:
    with trio.move_on_after(seconds):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_sample_fds, procs, samples, dt)
            nursery.start_soon(_sample_metrics, client, samples, dt)


# -- the server -----------------------------------------------------------------


def _build_model(spec: str, scratch: Path) -> str:
    """The model argument for ``tserve serve``: a tiny model built now, or as given."""
    if spec != "tiny":
        return spec
    target = scratch / "tiny"
    code = "import sys; from tserve.gpu._models import build_tiny_model as b; b(sys.argv[1])"
    subprocess.run(
        [sys.executable, "-c", code, str(target)],
        cwd=REPO_ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return str(target)


def server_command(args: argparse.Namespace, model: str) -> list[str]:
    return [
        sys.executable, "-m", "tserve", "serve", model,
        "--host", "127.0.0.1", "--port", "0",
        "--served-model-name", _MODEL_NAME,
        "--max-pending", str(args.max_pending),
        "--max-num-seqs", str(args.max_num_seqs),
        "--kv-cache-tokens", str(args.kv_cache_tokens),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--shutdown-timeout", "10",
        "--no-request-log",
    ]  # fmt: skip


async def _poll(check: Callable[[], Awaitable[bool]], period: float = 0.1) -> None:
    """Return once ``check()`` is true, asking every ``period`` seconds.

    For state in another process, which sends this one no event to wait on.
    """
    while not await check():  # noqa: ASYNC110 (another process's state: nothing to wait on)
        await trio.sleep(period)


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


async def _wait_ready(process: trio.Process, log_path: Path) -> ServerProcs:
    """Wait for the URL line, the engine child and ``/health`` 200; return the processes.

    Raises RuntimeError if the server exits first; the caller bounds the wait.
    """
    port = 0

    async def url_logged() -> bool:
        nonlocal port
        if process.returncode is not None:
            raise RuntimeError(f"the server exited with {process.returncode}; see {log_path}")
        match = _URL_LINE.search(await trio.Path(log_path).read_bytes())
        port = int(match.group(1)) if match else 0
        return bool(port)

    await _poll(url_logged)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:

        async def healthy() -> bool:
            return (await client.get("/health")).status_code == 200

        await _poll(healthy)
    procs = _find_engine(process.pid)
    if procs is None:
        raise RuntimeError(f"no engine process under the server (pid {process.pid})")
    procs.port = port
    return procs


async def _stop_server(process: trio.Process, procs: ServerProcs | None) -> dict[str, Any]:
    """SIGTERM, then SIGKILL after a grace period; make sure the engine is gone too."""
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
    with trio.move_on_after(30):
        await process.wait()
    killed = process.returncode is None
    if killed:
        process.kill()
        await process.wait()
    engine_left = False
    if procs is not None:

        async def engine_gone() -> bool:
            return not _running(procs.engine_pid)

        with trio.move_on_after(10):
            await _poll(engine_gone)
        if _running(procs.engine_pid):
            engine_left = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(procs.engine_pid, signal.SIGKILL)
    return {"exit_code": process.returncode, "sigkilled": killed, "engine_left": engine_left}


# -- the run --------------------------------------------------------------------


@dataclass
class LoadRun:
    """What happened between starting the load generator and the end of the tail."""

    start: float = math.inf  # time.monotonic() when the load generator was started
    end: float = math.inf  # ... and when it exited
    client: dict[str, Any] | None = None  # the load generator's result
    completions_by_status: dict[str, float] = field(default_factory=dict)  # from /metrics
    tcp_counters: dict[str, int] = field(default_factory=dict)  # kernel counters, deltas


async def _run_load(
    args: argparse.Namespace, procs: ServerProcs, deadline: float, samples: Samples
) -> LoadRun:
    """Baseline, then the load generator with the samplers, then a short tail."""
    run = LoadRun()
    port = procs.port
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        await _sample_for(procs, client, samples, 1.0, args.interval)
        counters = _tcp_counters()
        run.start = time.monotonic()
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
            out_path = Path(out.name)
        config = ClientConfig(
            port=port,
            requests=args.requests,
            rate=args.rate,
            max_tokens=args.max_tokens,
            arrivals=args.arrivals,
            seed=args.seed,
            deadline=deadline,
            interval=args.interval,
            out=str(out_path),
        )
        argv = [sys.executable, "-m", "benchmarks.seed_http"]
        argv += ["--client-config", json.dumps(asdict(config))]
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_sample_for, procs, client, samples, math.inf, args.interval)
                with trio.move_on_at(trio.current_time() + deadline - time.monotonic() + 15):
                    await trio.run_process(argv, cwd=REPO_ROOT, check=False)
                nursery.cancel_scope.cancel()
            run.end = time.monotonic()
            await _sample_for(procs, client, samples, args.tail_seconds, args.interval)
            after = _tcp_counters()
            run.tcp_counters = {k: after[k] - counters[k] for k in after if k in counters}
            text = await trio.Path(out_path).read_text()
            run.client = json.loads(text) if text else None
        finally:
            await trio.Path(out_path).unlink(missing_ok=True)
        with contextlib.suppress(httpx.HTTPError):
            final = _parse_metrics((await client.get("/metrics", timeout=10.0)).content)
            run.completions_by_status = final["completions_by_status"]
    return run


def _rounded(x: float | None, digits: int = 4) -> float | None:
    return None if x is None or math.isnan(x) else round(x, digits)


def _client_summary(args: argparse.Namespace, client: dict[str, Any]) -> dict[str, Any]:
    """Outcomes, rates and latencies from the load generator's per-request records."""
    records = [r for r in client.get("records", []) if r is not None]
    kinds = Counter(r[_KIND] for r in records)
    kinds["never_started"] = args.requests - len(records)
    errors = {k: n for k, n in kinds.items() if k != "ok" and n}
    ok = [r for r in records if r[_KIND] == "ok"]
    wrong_tokens = Counter(r[_TOKENS] for r in ok if r[_TOKENS] != args.max_tokens)
    starts = sorted(r[_START] for r in records)
    ends = [r[_END] for r in records if r[_END] is not None]
    wall = (max(ends) - starts[0]) if ends and starts else 0.0
    lag = [r[_START] - r[_DUE] for r in records]
    latency = [r[_END] - r[_START] for r in ok]
    first_byte = [r[_FIRST] - r[_START] for r in ok if r[_FIRST] is not None]
    failed = [r for r in records if r[_KIND] != "ok" and r[_END] is not None]
    failed_durations = [r[_END] - r[_START] for r in failed]
    t0 = starts[0] if starts else 0.0
    tokens = sum(r[_TOKENS] for r in ok)

    def per_s(n: float) -> float | None:
        return _rounded(n / wall, 1) if wall else None

    return {
        "ok": len(ok),
        "errors": sum(errors.values()),
        "errors_by_kind": errors,
        "wrong_token_counts": sum(wrong_tokens.values()),
        "wrong_token_values": {str(k): n for k, n in wrong_tokens.items()},
        "failed_duration_min_s": _rounded(min(failed_durations, default=None)),
        "failed_duration_max_s": _rounded(max(failed_durations, default=None)),
        "error_samples": [  # about 50, spread over the run
            {
                "start_s": round(r[_START] - t0, 3),
                "duration_s": round(r[_END] - r[_START], 3),
                "kind": r[_KIND],
                "got_bytes": r[_FIRST] is not None,
            }
            for r in failed[:: max(1, len(failed) // 50)]
        ],
        "achieved_rate": _rounded((len(starts) - 1) / (starts[-1] - starts[0]), 1)
        if len(starts) > 1
        else None,
        "send_lag_p99_s": _rounded(_percentile(lag, 0.99)),
        "send_lag_max_s": _rounded(max(lag, default=None)),
        "wall_s": _rounded(wall, 2),
        "throughput_req_s": per_s(len(ok)),
        "throughput_tokens_s": per_s(tokens),
        "latency_p50_s": _rounded(_percentile(latency, 0.5)),
        "latency_p99_s": _rounded(_percentile(latency, 0.99)),
        "latency_max_s": _rounded(max(latency, default=None)),
        "first_byte_p50_s": _rounded(_percentile(first_byte, 0.5)),
        "first_byte_p99_s": _rounded(_percentile(first_byte, 0.99)),
        "peak_in_flight_client": client.get("peak_in_flight"),
        "client_fd_limit": client.get("fd_limit"),
        "cpu_cores_client": _rounded(client.get("cpu_s", math.nan) / wall, 2) if wall else None,
    }


def _server_summary(run: LoadRun, samples: Samples) -> dict[str, Any]:
    """Peaks of the server's gauges, fds, ZMQ sockets and CPU, before/during/after the load."""

    def during(t: float) -> bool:
        return run.start <= t <= run.end

    base_fds = [f for t, f, _ in samples.fds if t < run.start]
    after_fds = [f for t, f, _ in samples.fds if t > run.end]
    ipc = [c for _, _, c in samples.fds]
    censuses = samples.censuses
    zmq = [c.zmq_to_engine for c in censuses if c.zmq_to_engine is not None]
    base_census = next((c for c in censuses if c.t < run.start), None)
    peak_census = max(censuses, key=lambda c: c.total, default=None)
    metric_values = [v for _, _, v in samples.metrics if "error" not in v]
    in_load = [c for c in censuses if during(c.t)]
    api_cpu = engine_cpu = math.nan
    if len(in_load) > 1:
        span = in_load[-1].t - in_load[0].t
        api_cpu = (in_load[-1].api_cpu_s - in_load[0].api_cpu_s) / span
        engine_cpu = (in_load[-1].engine_cpu_s - in_load[0].engine_cpu_s) / span

    def peak(key: str) -> float | None:
        return max((v[key] for v in metric_values if key in v), default=None)

    return {
        "server_completions_by_status": run.completions_by_status,
        "kernel_tcp_counters": run.tcp_counters,
        "peak_live_server": peak("live"),
        "peak_http_in_flight_server": peak("http_in_flight"),
        "peak_engine_running": peak("running"),
        "peak_engine_waiting": peak("waiting"),
        "peak_accept_queue": max(
            (c.accept_queue for c in censuses if c.accept_queue is not None), default=None
        ),
        "metrics_scrapes": len(samples.metrics),
        "metrics_scrape_errors": len(samples.metrics) - len(metric_values),
        "metrics_latency_max_s": _rounded(max((s[1] for s in samples.metrics), default=None)),
        "fds_baseline": int(statistics.median(base_fds)) if base_fds else None,
        "fds_peak": max((f for t, f, _ in samples.fds if during(t)), default=None),
        "fds_after": after_fds[-1] if after_fds else None,
        "fd_census_baseline": asdict(base_census) if base_census else None,
        "fd_census_peak": asdict(peak_census) if peak_census else None,
        "zmq_sockets_to_engine_min": min(zmq, default=None),
        "zmq_sockets_to_engine_max": max(zmq, default=None),
        "engine_ipc_connections_min": min(ipc, default=None),
        "engine_ipc_connections_max": max(ipc, default=None),
        "cpu_cores_api": _rounded(api_cpu, 2),
        "cpu_cores_engine": _rounded(engine_cpu, 2),
    }


def _timeline(run: LoadRun, samples: Samples) -> dict[str, Any]:
    """Every sample, with times in seconds since the load generator started."""
    t0 = run.start
    return {
        "server_fds": [(round(t - t0, 3), f, c) for t, f, c in samples.fds],
        "metrics": [
            (round(t - t0, 3), round(lat, 4), {k: v for k, v in m.items() if k in _GAUGE_KEYS})
            for t, lat, m in samples.metrics
        ],
        "client": [
            (round(t - t0, 3), *rest) for t, *rest in (run.client or {}).get("timeline", [])
        ],
        "accept_queue": [
            (round(c.t - t0, 3), c.accept_queue)
            for c in samples.censuses
            if c.accept_queue is not None
        ],
    }


def _summarize(args: argparse.Namespace, run: LoadRun, samples: Samples) -> dict[str, Any]:
    settings: tuple[str, ...] = ("requests", "rate", "arrivals", "max_tokens", "model")
    settings += ("max_pending", "max_num_seqs", "kv_cache_tokens", "max_num_batched_tokens")
    return {
        "benchmark": "seed_http",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **{name: getattr(args, name) for name in settings},
        **_client_summary(args, run.client or {}),
        **_server_summary(run, samples),
        "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "timeline": _timeline(run, samples),
    }


_GAUGE_KEYS = frozenset(_GAUGES.values())


def _passed(result: dict[str, Any]) -> bool:
    zmq_constant = result["zmq_sockets_to_engine_min"] == result["zmq_sockets_to_engine_max"]
    ipc_constant = result["engine_ipc_connections_min"] == result["engine_ipc_connections_max"]
    return bool(
        result["errors"] == 0
        and result["wrong_token_counts"] == 0
        and zmq_constant
        and ipc_constant
    )


def _print_table(result: dict[str, Any], out: TextIO) -> None:
    rows: list[tuple[str, Any]] = [
        ("requests", result["requests"]),
        ("target rate (req/s)", f"{result['rate']:g} ({result['arrivals']})"),
        ("achieved rate (req/s)", result["achieved_rate"]),
        ("send lag p99 / max (s)", f"{result['send_lag_p99_s']} / {result['send_lag_max_s']}"),
        ("ok (200, [DONE], usage)", result["ok"]),
        ("errors", result["errors"]),
        ("errors by kind", result["errors_by_kind"] or "-"),
        (f"wrong token counts (!= {result['max_tokens']})", result["wrong_token_counts"]),
        ("server: completions by status", result["server_completions_by_status"]),
        ("peak in flight (client, exact)", result["peak_in_flight_client"]),
        ("peak live requests (server gauge)", result["peak_live_server"]),
        ("peak HTTP generations (server)", result["peak_http_in_flight_server"]),
        ("peak kernel accept queue (ss -l)", result["peak_accept_queue"]),
        ("kernel TCP counters (delta, netns-wide)", result["kernel_tcp_counters"]),
        ("failed requests: duration min / max (s)", (
            f"{result['failed_duration_min_s']} / {result['failed_duration_max_s']}"
        )),
        ("peak engine running / waiting", (
            f"{result['peak_engine_running']} / {result['peak_engine_waiting']}"
        )),
        ("server fds: baseline / peak / after", (
            f"{result['fds_baseline']} / {result['fds_peak']} / {result['fds_after']}"
        )),
        ("ZMQ sockets API->engine: min / max", (
            f"{result['zmq_sockets_to_engine_min']} / {result['zmq_sockets_to_engine_max']}"
        )),
        ("engine ipc connections: min / max", (
            f"{result['engine_ipc_connections_min']} / {result['engine_ipc_connections_max']}"
        )),
        ("wall time (s)", result["wall_s"]),
        ("throughput (req/s, tokens/s)", (
            f"{result['throughput_req_s']}, {result['throughput_tokens_s']}"
        )),
        ("latency p50 / p99 / max (s)", (
            f"{result['latency_p50_s']} / {result['latency_p99_s']} / {result['latency_max_s']}"
        )),
        ("first byte p50 / p99 (s)", (
            f"{result['first_byte_p50_s']} / {result['first_byte_p99_s']}"
        )),
        ("/metrics scrapes (errors, max latency s)", (
            f"{result['metrics_scrapes']} ({result['metrics_scrape_errors']}, "
            f"{result['metrics_latency_max_s']})"
        )),
        ("CPU cores used: API / engine / client", (
            f"{result['cpu_cores_api']} / {result['cpu_cores_engine']} / "
            f"{result['cpu_cores_client']} (of {result['cpus']}; load avg "
            f"{result['loadavg_1m_at_end']})"
        )),
        ("server exit code (SIGTERM)", result.get("server", {}).get("exit_code")),
    ]  # fmt: skip
    for census_key in ("fd_census_baseline", "fd_census_peak"):
        census = result[census_key]
        if census:
            rows.append((f"{census_key[3:]}", (
                f"total {census['total']}: tcp/other sockets {census['tcp_or_other_sockets']}, "
                f"unix {census['unix_sockets']}, {census['other']}"
            )))  # fmt: skip
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}", file=out)


def _plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    timeline = result["timeline"]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 7))
    client = timeline["client"]
    top.plot([r[0] for r in client], [r[1] for r in client], label="in flight (client)")
    metrics = timeline["metrics"]
    for key in ("live", "running", "waiting"):
        xs = [t for t, _, m in metrics if key in m]
        top.plot(xs, [m[key] for _, _, m in metrics if key in m], label=f"{key} (/metrics)")
    queue = timeline["accept_queue"]
    top.plot([r[0] for r in queue], [r[1] for r in queue], label="kernel accept queue")
    top.set_ylabel("requests")
    top.legend(loc="upper left")
    top.set_title(
        f"{result['requests']} streaming requests at {result['rate']:g}/s: "
        f"{result['errors']} errors"
    )
    fds = timeline["server_fds"]
    bottom.plot([r[0] for r in fds], [r[1] for r in fds], label="server fds")
    bottom.set_ylabel("fds")
    bottom.set_xlabel("seconds since the load started")
    ipc_axis = bottom.twinx()
    ipc_axis.plot([r[0] for r in fds], [r[2] for r in fds], color="C3", label="engine ipc conns")
    ipc_axis.set_ylabel("ZMQ ipc connections")
    ipc_axis.set_ylim(0, max(4, *(r[2] + 1 for r in fds)))
    bottom.legend(loc="upper left")
    ipc_axis.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


async def _main(args: argparse.Namespace, stamp: str) -> dict[str, Any]:
    log_path = result_stem("seed_http", stamp).with_name(f"seed_http-{stamp}-server.log")
    deadline = time.monotonic() + args.max_seconds
    with tempfile.TemporaryDirectory(prefix="seed-http-") as scratch:
        model = await trio.to_thread.run_sync(_build_model, args.model, Path(scratch))
        command = server_command(args, model)
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            process = await trio.lowlevel.open_process(
                command, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        finally:
            os.close(log)
        procs: ServerProcs | None = None
        samples = Samples()
        run = LoadRun()
        try:
            with trio.move_on_at(trio.current_time() + deadline - time.monotonic() + 30):
                with trio.fail_at(trio.current_time() + deadline - time.monotonic()):
                    procs = await _wait_ready(process, log_path)
                run = await _run_load(args, procs, deadline, samples)
        finally:
            with trio.CancelScope(shield=True):
                server = await _stop_server(process, procs)
    result = _summarize(args, run, samples)
    result["server"] = {**server, "command": command[1:], "log": str(log_path)}
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.seed_http",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--requests", type=int, default=10_000, help="streaming completions to send")
    add("--rate", type=float, default=1000.0, help="arrivals per second (open loop)")
    add("--arrivals", choices=["fixed", "poisson"], default="fixed")
    add("--seed", type=int, default=0, help="seed of the Poisson schedule")
    add("--max-tokens", type=int, default=8, help="completion tokens per request (ignore_eos)")
    add("--model", default="tiny", help="tiny (built now), default, or a model directory")
    add("--max-pending", type=int, help="server admission bound (default: requests + 1000)")
    add("--max-num-seqs", type=int, default=256, help="engine batch size")
    add("--kv-cache-tokens", type=int, default=65536)
    add("--max-num-batched-tokens", type=int, default=4096)
    add("--max-seconds", type=float, default=600.0, help="hard cap on the whole run")
    add("--interval", type=float, default=0.05, help="sampling period in seconds")
    add("--tail-seconds", type=float, default=3.0, help="sampling after the load")
    add("--no-plot", action="store_true", help="skip the PNG timeline")
    add("--client-config", help=argparse.SUPPRESS)  # set when this runs as the load generator
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.client_config:
        run_client(ClientConfig(**json.loads(args.client_config)))
        return 0
    if args.max_pending is None:
        args.max_pending = args.requests + 1000
    stamp = time.strftime("%Y%m%d-%H%M%S")
    print(
        f"seed_http: {args.requests} streaming requests at {args.rate:g}/s, "
        f"{args.max_tokens} tokens each, model {args.model}, --max-pending {args.max_pending} "
        f"(above the request count: admission refuses none)",
        flush=True,
    )
    result = trio.run(_main, args, stamp)
    _print_table(result, sys.stdout)
    path = write_json(result_stem("seed_http", stamp), result, indent=1)
    print(f"wrote {path.relative_to(REPO_ROOT)}")
    png = path.with_suffix(".png")
    if not args.no_plot and _plot(result, png):
        print(f"wrote {png.relative_to(REPO_ROOT)}")
    passed = _passed(result)
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
