"""``/health`` while a server takes the largest chats a client may send, over real HTTP.

A server of MODEL gets, ``--repeats`` times one after another, the chats of
:func:`huge_chats`:

* ``over_bound``: 50,000 empty messages (about 1.5 MB), past
  ``MAX_MESSAGES``: a 400 naming ``messages``, decided while parsing;
* ``at_bound``: ``MAX_MESSAGES`` empty messages: its chat template is
  rendered off the event loop (it counts as long: ``_tokenizer.py``), then
  it is answered, or is a 400 naming ``messages`` when it does not fit the
  model's context;
* ``full_body``: ``MAX_MESSAGES`` messages of sonnet text filling the body
  to just under the 4 MiB limit: a megabyte-sized prompt, templated and
  tokenized off the loop, then answered or refused for the context alike.

Meanwhile ``/health`` is polled every 50 ms, each time on a fresh connection
(as a liveness probe does). Reported: the polls answered during the chats,
their status and latency (p50, p99, max), and each chat's status, error code
and wall time. Writes JSON under ``results/``::

    python -m benchmarks.huge_chat MODEL [--repeats 5]

:func:`measure_huge_chat` is the measurement alone, for a server the caller
started (tests/web/test_huge_chat.py uses it).
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import platform
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks._results import result_stem, write_json
from benchmarks._serve import serve
from tserve.bench._metrics import percentile
from tserve.web._app import AppConfig
from tserve.web._bodies import MAX_MESSAGES

__all__ = ["Chat", "HugeChatRun", "Poll", "huge_chats", "main", "measure_huge_chat"]

POLL_INTERVAL = 0.05  # s between the starts of two /health polls
OVER_BOUND_MESSAGES = 50_000
_SONNETS = Path(__file__).with_name("sonnet.txt")


@dataclasses.dataclass(frozen=True, slots=True)
class Poll:
    """One ``/health`` poll: when it started (monotonic), how long it took, its status."""

    started: float
    seconds: float
    status: int  # 0: no answer (the connection failed)


@dataclasses.dataclass(frozen=True, slots=True)
class Chat:
    """One huge chat's outcome."""

    name: str
    body_bytes: int
    started: float  # monotonic
    seconds: float
    status: int
    error_code: str | None  # the OpenAI error's, for a status other than 200
    error_param: str | None
    error_message: str | None
    text: str | None  # the answer, for a 200


@dataclasses.dataclass
class HugeChatRun:
    """Every poll and every chat of one measurement."""

    polls: list[Poll] = dataclasses.field(default_factory=list)
    chats: list[Chat] = dataclasses.field(default_factory=list)

    def during_chats(self) -> list[Poll]:
        """The polls that started while a chat was in flight."""
        spans = [(c.started, c.started + c.seconds) for c in self.chats]
        return [p for p in self.polls if any(a <= p.started <= b for a, b in spans)]

    def summary(self) -> dict[str, Any]:
        during = self.during_chats()
        latencies = [p.seconds for p in during]
        return {
            "polls": len(self.polls),
            "polls_during_chats": len(during),
            "polls_not_200": sum(p.status != 200 for p in self.polls),
            "health_p50_ms": percentile(latencies, 50) * 1000 if latencies else None,
            "health_p99_ms": percentile(latencies, 99) * 1000 if latencies else None,
            "health_max_ms": max(latencies) * 1000 if latencies else None,
        }

    def report(self) -> str:
        s = self.summary()
        lines = [
            f"/health every {POLL_INTERVAL * 1000:.0f} ms during the chats:"
            f" {s['polls_during_chats']} polls, {s['polls_not_200']} not 200"
            f" (of {s['polls']} in all); latency p50"
            f" {s['health_p50_ms']:.1f} ms, p99 {s['health_p99_ms']:.1f} ms,"
            f" max {s['health_max_ms']:.1f} ms"
        ]
        for chat in self.chats:
            outcome = (
                "answered" if chat.status == 200 else f"{chat.error_code} ({chat.error_param})"
            )
            lines.append(
                f"  {chat.name}: {chat.body_bytes / 2**20:.2f} MiB -> {chat.status} {outcome}"
                f" in {chat.seconds * 1000:.0f} ms"
            )
        return "\n".join(lines)


def huge_chats(max_body_bytes: int = AppConfig().max_body_bytes) -> dict[str, bytes]:
    """The three chat bodies of the module docstring, by name, as JSON bytes."""
    empty = {"role": "user", "content": ""}

    def body(messages: list[dict[str, str]]) -> bytes:
        return json.dumps({"messages": messages, "max_tokens": 8}).encode()

    at_bound = body([empty] * MAX_MESSAGES)
    room = max_body_bytes - len(at_bound) - 1024  # within the limit, with a margin
    text = " ".join(_SONNETS.read_text().split())
    per_message = room // MAX_MESSAGES
    content = (text * (per_message // len(text) + 1))[:per_message]
    full = body([{"role": "user", "content": content}] * MAX_MESSAGES)
    assert len(full) <= max_body_bytes
    return {
        "over_bound": body([empty] * OVER_BOUND_MESSAGES),
        "at_bound": at_bound,
        "full_body": full,
    }


def measure_huge_chat(
    url: str, chats: dict[str, bytes], *, repeats: int = 1, guard: float = 120.0
) -> HugeChatRun:
    """Send each of ``chats`` ``repeats`` times, one at a time, to ``url``'s
    ``/v1/chat/completions`` while ``/health`` is polled every 50 ms.

    Blocks. ``guard`` s bounds each request (a poll or a chat that takes
    longer fails with httpx's or http.client's timeout): a hang guard.
    """
    run = HugeChatRun()
    stop = threading.Event()
    poller = threading.Thread(target=_poll_health, args=(url, run, stop, guard), daemon=True)
    poller.start()
    try:
        time.sleep(5 * POLL_INTERVAL)  # a few polls before the first chat
        with httpx.Client(base_url=url, timeout=guard) as client:
            for _ in range(repeats):
                for name, body in chats.items():
                    run.chats.append(_send_chat(client, name, body))
        time.sleep(5 * POLL_INTERVAL)
    finally:
        stop.set()
        poller.join(guard)
    return run


def _send_chat(client: httpx.Client, name: str, body: bytes) -> Chat:
    headers = {"Content-Type": "application/json"}
    started = time.monotonic()
    response = client.post("/v1/chat/completions", content=body, headers=headers)
    seconds = time.monotonic() - started
    reply = response.json()
    error = reply.get("error") or {}
    text = reply["choices"][0]["message"]["content"] if response.status_code == 200 else None
    return Chat(
        name,
        len(body),
        started,
        seconds,
        response.status_code,
        error.get("code"),
        error.get("param"),
        error.get("message"),
        text,
    )


def _poll_health(url: str, run: HugeChatRun, stop: threading.Event, guard: float) -> None:
    """Poll ``/health`` every ``POLL_INTERVAL`` s on a fresh connection until ``stop``."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    next_poll = time.monotonic()
    while not stop.is_set():
        started = time.monotonic()
        connection = http.client.HTTPConnection(host, int(port), timeout=guard)
        try:
            connection.request("GET", "/health")
            response = connection.getresponse()
            response.read()
            status = response.status
        except OSError:
            status = 0
        finally:
            connection.close()
        run.polls.append(Poll(started, time.monotonic() - started, status))
        next_poll += POLL_INTERVAL
        stop.wait(max(0.0, next_poll - time.monotonic()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a model directory for tserve serve, or 'default'")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--log", type=Path, default=Path("/tmp/tserve-huge-chat.log"))
    args = parser.parse_args(argv)
    process, url = serve(args.model, args.log, "--embedding-model", "none")
    try:
        run = measure_huge_chat(url, huge_chats(), repeats=args.repeats)
        alive = httpx.get(f"{url}/health", timeout=60).status_code == 200
    finally:
        process.terminate()
        process.wait()
    print(run.report())
    print(f"the engine survived: {alive}")
    meta = {"model": args.model, "repeats": args.repeats, "python": platform.python_version()}
    result = {
        "meta": meta,
        "summary": run.summary(),
        "engine_survived": alive,
        "chats": [dataclasses.asdict(chat) for chat in run.chats],
        "poll_ms": [round(p.seconds * 1000, 2) for p in run.polls],
    }
    print(f"wrote {write_json(result_stem('huge_chat'), result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
