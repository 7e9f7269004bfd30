"""Each API process's live numbers, as small files the metrics process reads (``--metrics-port``).

The request counters and histograms are already shared through
prometheus-client's multiprocess files (``_metrics``); what an API process
holds only in memory is its :class:`LLMStats` (the engine's latest report,
its admission counts) and its in-flight count. With ``--metrics-port``
each API process writes those to ``stats-<pid>.msgpack`` in the shared
metrics directory, so that the metrics process answers a scrape without
asking any API process anything.

Rules:

* :func:`publish_stats` rewrites the file every :data:`PUBLISH_INTERVAL`
  seconds of its event loop, only when the numbers changed. Each write
  goes to a temporary file renamed over the old one, so a reader sees one
  whole snapshot or the previous one, never a torn one.
* The file is as fresh as its event loop lets it be: under saturation a
  pass of the loop takes tens of milliseconds and the numbers lag by that
  much, as the engine's report itself does (the mux updates it on the same
  loop).
* :func:`read_stats` sums the per-process numbers over the processes still
  alive, and takes the engine's numbers from the snapshot that carries its
  latest step (they are the same report, heard at different times).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import trio

from tserve._host import pid_alive
from tserve.nursery import LLMStats
from tserve.protocol import EngineStats

__all__ = ["PUBLISH_INTERVAL", "ProcessStats", "publish_stats", "read_stats"]

PUBLISH_INTERVAL = 0.05  # seconds between writes (of changed numbers) at most
_PREFIX = "stats-"
_SUFFIX = ".msgpack"


class ProcessStats(msgspec.Struct, array_like=True, frozen=True):
    """What one API process holds in memory, as it held it at ``at`` (``time.monotonic``)."""

    pid: int
    at: float
    live_requests: int
    queued_requests: int
    queued_tokens: int
    aborts_sent: int
    in_flight: int
    engine_alive: bool
    engine: EngineStats


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ProcessStats)


def _write(directory: Path, body: bytes) -> None:
    """Replace this process's file with ``body`` (atomic rename). Blocks for microseconds
    (a write to a memory-backed directory); raises OSError if the directory is gone."""
    pid = os.getpid()
    temporary = directory / f".{_PREFIX}{pid}.tmp"
    temporary.write_bytes(body)
    os.replace(temporary, directory / f"{_PREFIX}{pid}{_SUFFIX}")


async def publish_stats(
    directory: Path, llm_stats: Callable[[], LLMStats], in_flight: Callable[[], int]
) -> None:
    """Write this process's numbers to ``directory`` until cancelled; never returns.

    A checkpoint every :data:`PUBLISH_INTERVAL`; a cancel stops it between
    writes. Raises OSError if the directory is gone.
    """
    pid = os.getpid()
    last: tuple[object, ...] = ()
    while True:
        s = llm_stats()
        numbers = (s.live_requests, s.queued_requests, s.queued_tokens, s.aborts_sent,
                   in_flight(), s.engine_alive, s.engine)  # fmt: skip
        if numbers != last:
            last = numbers
            _write(directory, _encoder.encode(ProcessStats(pid, time.monotonic(), *numbers)))
        await trio.sleep(PUBLISH_INTERVAL)


def read_stats(directory: Path) -> tuple[LLMStats, int]:
    """The whole server's numbers and its requests in flight, from the files of live processes.

    Blocking (reads a few small files). With no file yet, zeros and
    ``engine_alive`` False. The engine counts as alive while every process
    says so.
    """
    found: list[ProcessStats] = []
    for path in directory.glob(f"{_PREFIX}*{_SUFFIX}"):
        try:
            snapshot = _decoder.decode(path.read_bytes())
        except (OSError, msgspec.DecodeError):
            continue  # removed in between (the process exited), or not ours
        if pid_alive(snapshot.pid):  # a process that exited counts no more
            found.append(snapshot)
    if not found:
        return LLMStats(live_requests=0, aborts_sent=0, engine=EngineStats(), engine_alive=False), 0
    latest = max(found, key=lambda s: (s.engine.steps, s.at))
    stats = LLMStats(
        live_requests=sum(s.live_requests for s in found),
        queued_requests=sum(s.queued_requests for s in found),
        queued_tokens=sum(s.queued_tokens for s in found),
        aborts_sent=sum(s.aborts_sent for s in found),
        engine=latest.engine,
        engine_alive=all(s.engine_alive for s in found),
    )
    return stats, sum(s.in_flight for s in found)
