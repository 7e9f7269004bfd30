"""The load generator: open-loop streaming completions, one connection each.

It runs in a child process (``python -m benchmarks.seed_http._load CONFIG``),
so that it shares no event loop with the sampler, and writes its result as
JSON to ``ClientConfig.out``:

1. Arrivals: request ``i`` is due ``i / rate`` seconds after the start
   (``fixed``) or at the Poisson schedule of
   :func:`tserve.bench._client.arrival_times` (``poisson``). It is started
   when due whatever the others are doing (open loop).
2. One request: a bare trio socket (``open_tcp_stream``'s happy-eyeballs
   nursery costs more per request than everything else the client does), the
   request in one send, the response read to the end of its framing (or to
   EOF) into a :class:`._outcome.ResponseReader`, which decodes its events
   once at the end to keep the client cheap on a small machine.
3. Bound: at ``ClientConfig.deadline`` every request still in flight is
   cancelled and stays ``unfinished``.

Each request leaves one record, a list indexed by :data:`DUE` ... :data:`KIND`.
"""

from __future__ import annotations

import errno
import json
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from benchmarks.seed_http._outcome import Outcome, ResponseReader
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
    "run_client",
]

MODEL_NAME = "seed"  # the server's --served-model-name; every request asks for it
_PATH = "/v1/completions"

# A request's record: when it was due, started, got its first byte and ended
# (time.monotonic(); None until then), its HTTP status, its completion tokens
# (-1: no usage chunk) and its outcome kind ("ok" or an error kind).
DUE, START, FIRST, END, STATUS, TOKENS, KIND = range(7)


@dataclass
class ClientConfig:
    """The load, as the parent passes it to the child (JSON of these fields)."""

    port: int
    requests: int
    rate: float
    max_tokens: int
    arrivals: str  # "fixed" or "poisson"
    seed: int
    deadline: float  # time.monotonic() past which unfinished requests are cancelled
    interval: float  # seconds between two samples of the client's own counters
    out: str  # where the client writes its JSON result


@dataclass
class _ClientState:
    in_flight: int = 0
    peak_in_flight: int = 0
    started: int = 0
    finished: int = 0
    records: list[list[Any] | None] = field(default_factory=list)  # one per request
    timeline: list[list[float]] = field(default_factory=list)  # t, in flight, started, done

    def sample(self) -> None:
        self.timeline.append([time.monotonic(), self.in_flight, self.started, self.finished])


class _Requests:
    """The bytes of request ``i``: a streamed completion with usage, ``Connection: close``."""

    def __init__(self, config: ClientConfig) -> None:
        self.port = config.port
        self._origin = Origin("http", "127.0.0.1", config.port, "")
        self._run = RunConfig(ignore_eos=True)
        self._max_tokens = config.max_tokens

    def __getitem__(self, index: int) -> bytes:
        prompt = f"Request {index}: tell me a story about sockets."
        body = request_body(self._run, MODEL_NAME, BenchRequest(prompt, 0, self._max_tokens))
        return encode_post(self._origin, _PATH, body, {"Connection": "close"})


def _error_kind(exc: OSError, stage: str) -> str:
    if exc.errno is not None:
        return f"{stage}_{errno.errorcode.get(exc.errno, exc.errno)}"
    return f"{stage}_{type(exc).__name__}"


async def _exchange(sock: trio.socket.SocketType, request: bytes, record: list[Any]) -> Outcome:
    """Send ``request``; read the response to the end of its framing or to EOF (a checkpoint).

    Sets ``record[FIRST]`` at the first byte.
    """
    view = memoryview(request)
    while view:
        view = view[await sock.send(view) :]
    response = ResponseReader()
    while not response.done and (data := await sock.recv(65536)):
        if record[FIRST] is None:
            record[FIRST] = time.monotonic()
        response.feed(data)
    return response.outcome()


async def _one_request(state: _ClientState, requests: _Requests, index: int, due: float) -> None:
    """Send request ``index`` and fill in its record; a socket error becomes its kind."""
    record: list[Any] = [due, time.monotonic(), None, None, 0, -1, "unfinished"]
    state.records[index] = record
    state.started += 1
    state.in_flight += 1
    state.peak_in_flight = max(state.peak_in_flight, state.in_flight)
    try:
        with trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            stage = "connect"
            try:
                await sock.connect(("127.0.0.1", requests.port))
                stage = "io"
                outcome = await _exchange(sock, requests[index], record)
            except OSError as exc:
                record[KIND] = _error_kind(exc, stage)
                return
        record[STATUS], record[TOKENS], record[KIND] = outcome.status, outcome.tokens, outcome.kind
    finally:
        record[END] = time.monotonic()
        state.in_flight -= 1
        state.finished += 1


async def _arrive(config: ClientConfig, state: _ClientState, nursery: trio.Nursery) -> None:
    """Start request ``i`` at its scheduled time (open loop: never waits for answers)."""
    if config.arrivals == "poisson":
        offsets = arrival_times(config.requests, config.rate, 1.0, config.seed)
    else:
        offsets = [index / config.rate for index in range(config.requests)]
    requests = _Requests(config)
    t0 = time.monotonic() + 0.05
    for index, offset in enumerate(offsets):
        due = t0 + offset
        delay = due - time.monotonic()
        if delay > 0:
            await trio.sleep(delay)
        elif index % 64 == 0:
            await trio.lowlevel.checkpoint()  # behind schedule: let responses be read
        nursery.start_soon(_one_request, state, requests, index, due)


async def _sample(state: _ClientState, interval: float) -> None:
    while True:
        state.sample()
        await trio.sleep(interval)


async def _client_main(config: ClientConfig) -> dict[str, Any]:
    state = _ClientState(records=[None] * config.requests)
    with trio.move_on_at(trio.current_time() + (config.deadline - time.monotonic())):
        async with trio.open_nursery() as outer:
            outer.start_soon(_sample, state, config.interval)
            async with trio.open_nursery() as requests:
                await _arrive(config, state, requests)
            outer.cancel_scope.cancel()
    state.sample()
    return {
        "peak_in_flight": state.peak_in_flight,
        "records": state.records,
        "timeline": state.timeline,
        "cpu_s": time.process_time(),
    }


def run_client(config: ClientConfig) -> None:
    """The load generator's whole life: raise the fd limit, send, write the result.

    Blocks until the last request ends or ``config.deadline`` passes.
    """
    fd_limit = raise_fd_limit()
    result = trio.run(_client_main, config)
    result["fd_limit"] = fd_limit
    Path(config.out).write_text(json.dumps(result))


if __name__ == "__main__":
    run_client(ClientConfig(**json.loads(sys.argv[1])))
