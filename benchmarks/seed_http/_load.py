"""The load generator: open-loop streaming completions, one connection each.

It runs in ``ClientConfig.clients`` child processes (``python -m
benchmarks.seed_http._load CONFIG``), so that it shares no event loop with
the sampler and can use more than one core; process ``k`` of ``n`` sends
requests ``k``, ``k + n``, ``k + 2n``, ... and writes its records as JSON to
``ClientConfig.out`` + ``.k``; :func:`merge` puts the parts back together.

What it took to open 5,000 connections a second on 2 shared cores:

* No event-loop library: trio spent about 0.6 ms of CPU per request here (a
  task, its cancel scopes, a wake-up per read). This loop is one ``epoll``
  and a non-blocking socket per request, with every request's bytes built
  before the first is due.
* Many source addresses: ``connect`` picks a local port whose 4-tuple is
  free, trying even ports first; from one address, once some 14,000
  connections are open, each ``connect`` searches the kernel's port table
  for milliseconds (1,200 connections/s measured here). A child's requests
  bind to the 16 loopback addresses of :data:`_SOURCES` in turn, with
  ``IP_BIND_ADDRESS_NO_PORT``, so that the port is still chosen at
  ``connect``, among the connections from that address alone.

In order:

1. Start: the child builds its requests, writes ``ready`` to stdout and
   reads from stdin the ``time.monotonic()`` at which request 0 is due, the
   same in every child.
2. Arrivals: request ``i`` is due ``i / rate`` (``fixed``) or the Poisson
   schedule of :func:`tserve.bench._client.arrival_times` (``poisson``)
   after that. Each pass of the loop starts every due request (at most
   :data:`_BATCH`, so that answers are read when it falls behind), whatever
   the others are doing (open loop).
3. One request: ``connect`` without blocking; once writable, the request in
   one ``send``; once readable, its bytes appended until the chunked body's
   terminator (``0\\r\\n\\r\\n``) or EOF. A :class:`._outcome.ResponseReader`
   then checks the whole response once: status, framing, every event,
   ``[DONE]`` and the usage chunk's token count.
4. Bound: at ``ClientConfig.deadline`` every request still open is closed
   and stays ``unfinished``.

Each request leaves one record, a list indexed by :data:`DUE` ... :data:`KIND`.
"""

from __future__ import annotations

import bisect
import errno
import gc
import json
import select
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.seed_http._outcome import ResponseReader
from tserve._host import raise_fd_limit
from tserve.bench._client import RunConfig, arrival_times, request_body
from tserve.bench._datasets import BenchRequest
from tserve.bench._http import Origin, encode_post

__all__ = [
    "DUE",
    "END",
    "FIRST",
    "KIND",
    "MODEL_NAME",
    "START",
    "STATUS",
    "TOKENS",
    "ClientConfig",
    "merge",
    "run_client",
]

MODEL_NAME = "seed"  # the server's --served-model-name; every request asks for it
_PATH = "/v1/completions"
_BATCH = 64  # requests started per pass of the loop at most
_TERMINATOR = b"0\r\n\r\n"  # the end of a chunked body with no trailers
_RECEIVE = 65536
# Local addresses the connections come from, in turn (Linux routes 127/8 to lo).
_SOURCES = tuple(f"127.0.0.{n}" for n in range(1, 17))

# A request's record: when it was due, started, got its first byte and ended
# (time.monotonic(); None until then), its HTTP status, its completion tokens
# (-1: no usage chunk) and its outcome kind ("ok" or an error kind).
DUE, START, FIRST, END, STATUS, TOKENS, KIND = range(7)


@dataclass
class ClientConfig:
    """The load, as the parent passes it to each child (JSON of these fields)."""

    port: int
    requests: int
    rate: float
    max_tokens: int
    arrivals: str  # "fixed" or "poisson"
    seed: int
    deadline: float  # time.monotonic() past which unfinished requests are closed
    out: str  # child k writes its JSON result to out + f".{k}"
    clients: int = 1  # child processes, each sending every clients-th request
    part: int = 0  # which of them this is


def _request_bytes(port: int, index: int, max_tokens: int) -> bytes:
    """Request ``index``: a streamed completion with usage, ``Connection: close``."""
    prompt = f"Request {index}: tell me a story about sockets."
    body = request_body(RunConfig(ignore_eos=True), MODEL_NAME, BenchRequest(prompt, 0, max_tokens))
    origin = Origin("http", "127.0.0.1", port, "")
    return encode_post(origin, _PATH, body, {"Connection": "close"})


class _Open:
    """One request's connection while it is open; ``pending`` is None once sent."""

    __slots__ = ("body", "pending", "record", "sock")

    def __init__(self, sock: socket.socket, pending: bytes, record: list[Any]) -> None:
        self.sock = sock
        self.pending: bytes | None = pending
        self.record = record
        self.body = bytearray()


def _error_kind(exc: OSError | int, stage: str) -> str:
    code = exc if isinstance(exc, int) else exc.errno
    if code is not None:
        return f"{stage}_{errno.errorcode.get(code, code)}"
    return f"{stage}_{type(exc).__name__}"


class _Client:
    """This child's share of the requests, and the sockets of those in flight."""

    def __init__(self, config: ClientConfig) -> None:
        self.address = ("127.0.0.1", config.port)
        if config.arrivals == "poisson":
            offsets = arrival_times(config.requests, config.rate, 1.0, config.seed)
        else:
            offsets = [index / config.rate for index in range(config.requests)]
        mine = range(config.part, config.requests, config.clients)
        self.due = [offsets[index] for index in mine]  # from request 0's due time, until set
        self.requests = [_request_bytes(config.port, index, config.max_tokens) for index in mine]
        self.records: list[list[Any] | None] = [None] * len(self.due)
        self.epoll = select.epoll()
        self.open: dict[int, _Open] = {}  # fd -> its request; bound: the fd limit

    def set_start(self, start_at: float) -> None:
        """Request 0 is due at ``start_at`` (``time.monotonic()``)."""
        self.due = [start_at + offset for offset in self.due]

    def start(self, slot: int) -> None:
        """Open request ``slot``'s connection; it is sent once the socket is writable."""
        record: list[Any] = [self.due[slot], time.monotonic(), None, None, 0, -1, "unfinished"]
        self.records[slot] = record
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_BIND_ADDRESS_NO_PORT, 1)
            sock.bind((_SOURCES[slot % len(_SOURCES)], 0))
        except OSError as exc:
            self._end(record, _error_kind(exc, "connect"))
            return
        code = sock.connect_ex(self.address)
        if code not in (0, errno.EINPROGRESS):
            sock.close()
            self._end(record, _error_kind(code, "connect"))
            return
        self.open[sock.fileno()] = _Open(sock, self.requests[slot], record)
        self.epoll.register(sock.fileno(), select.EPOLLOUT)

    def on_event(self, fd: int) -> None:
        """The socket ``fd`` is ready: send its request, or read its response."""
        conn = self.open[fd]
        if conn.pending is not None:
            self._send(fd, conn)
        else:
            self._receive(fd, conn)

    def _send(self, fd: int, conn: _Open) -> None:
        assert conn.pending is not None
        code = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            self._close(fd, _error_kind(code, "connect"))
            return
        try:
            sent = conn.sock.send(conn.pending)
        except BlockingIOError:
            return
        except OSError as exc:
            self._close(fd, _error_kind(exc, "io"))
            return
        conn.pending = conn.pending[sent:] if sent < len(conn.pending) else None
        if conn.pending is None:
            self.epoll.modify(fd, select.EPOLLIN)

    def _receive(self, fd: int, conn: _Open) -> None:
        try:
            data = conn.sock.recv(_RECEIVE)
        except BlockingIOError:
            return
        except OSError as exc:
            self._close(fd, _error_kind(exc, "io"))
            return
        if conn.record[FIRST] is None:
            conn.record[FIRST] = time.monotonic()
        conn.body += data
        if not data or conn.body.endswith(_TERMINATOR):
            reader = ResponseReader()
            reader.feed(bytes(conn.body))
            outcome = reader.outcome()
            conn.record[STATUS], conn.record[TOKENS] = outcome.status, outcome.tokens
            self._close(fd, outcome.kind)

    def _close(self, fd: int, kind: str) -> None:
        conn = self.open.pop(fd)
        conn.sock.close()  # also takes it out of the epoll set (no other fd refers to it)
        self._end(conn.record, kind)

    @staticmethod
    def _end(record: list[Any], kind: str) -> None:
        record[KIND] = kind
        record[END] = time.monotonic()

    def close_all(self) -> None:
        """Close every open connection; their requests stay ``unfinished``."""
        for fd in list(self.open):
            self._close(fd, "unfinished")
        self.epoll.close()


def _drive(client: _Client, deadline: float) -> None:
    """Start each request when due and serve every ready socket, until all ended or
    ``deadline`` (blocks)."""
    due, count, next_slot = client.due, len(client.due), 0
    while next_slot < count or client.open:
        now = time.monotonic()
        if now >= deadline:
            break
        # 1. Start what is due (open loop: answers are never waited for).
        limit = min(count, next_slot + _BATCH)
        while next_slot < limit and due[next_slot] <= now:
            client.start(next_slot)
            next_slot += 1
        # 2. Wait for sockets until the next arrival is due (not at all when behind).
        wait = deadline - now
        if next_slot < count:
            wait = min(wait, due[next_slot] - time.monotonic())
        for fd, _ in client.epoll.poll(max(0.0, wait)):
            client.on_event(fd)
    client.close_all()


def run_client(config: ClientConfig) -> None:
    """One child's whole life: raise the fd limit, build its requests, say ``ready``,
    read the start time, send them at their times, write the result.

    Blocks until stdin gives the start time (a closed stdin: nothing is sent),
    then until its last request ends or ``config.deadline`` passes.
    """
    fd_limit = raise_fd_limit()
    client = _Client(config)
    print("ready", flush=True)
    line = sys.stdin.readline()
    if not line:
        return
    client.set_start(float(line))
    # The records are the only objects that live long, and nothing here makes
    # a cycle: no collection pauses in the arrival loop.
    gc.disable()
    cpu = time.process_time()
    _drive(client, config.deadline)
    result = {
        "records": client.records,
        "cpu_s": time.process_time() - cpu,  # in the loop, not building the requests
        "fd_limit": fd_limit,
    }
    Path(f"{config.out}.{config.part}").write_text(json.dumps(result))


def merge(parts: Sequence[dict[str, Any] | None], requests: int, interval: float) -> dict[str, Any]:
    """The children's results as one: records in request order, the exact peak in
    flight and a timeline (t, in flight, started, ended every ``interval`` s)
    from the records; CPU seconds summed. A missing part leaves its requests
    ``None`` (never started)."""
    clients = len(parts)
    records: list[list[Any] | None] = [None] * requests
    for k, part in enumerate(parts):
        if part is not None:
            records[k::clients] = part["records"]
    done = [r for r in records if r is not None]
    starts = sorted(r[START] for r in done)
    ends = sorted(r[END] for r in done if r[END] is not None)
    peak = in_flight = 0
    for _, step in sorted([(t, 1) for t in starts] + [(t, -1) for t in ends]):
        in_flight += step
        peak = max(peak, in_flight)
    timeline: list[list[float]] = []
    if starts:
        last = max(ends[-1] if ends else starts[-1], starts[-1])
        for i in range(int((last - starts[0]) / interval) + 2):
            t = starts[0] + i * interval
            begun, ended = bisect.bisect_right(starts, t), bisect.bisect_right(ends, t)
            timeline.append([t, begun - ended, begun, ended])
    present = [part for part in parts if part is not None]
    return {
        "peak_in_flight": peak,
        "records": records,
        "timeline": timeline,
        "cpu_s": sum(part["cpu_s"] for part in present),
        "fd_limit": min((part["fd_limit"] for part in present), default=None),
        "clients": clients,
    }


if __name__ == "__main__":
    run_client(ClientConfig(**json.loads(sys.argv[1])))
