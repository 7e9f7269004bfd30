"""The split deployment on loopback tcp, as real processes: ``python -m tserve keys``,
``python -m tserve engine MODEL --bind tcp://... --keys DIR``, and several
``python -m tserve serve --engine tcp://... --keys DIR`` sharing it.

Heartbeats run every :data:`HEARTBEAT` s, so the stated detection bound is
:data:`BOUND` s. The machine is noisy: every wait polls for an outcome (a
503, an error event, the engine's running count) up to :data:`DEADLINE`, a
generous multiple of the bound. The refusal of an unknown key is shown by
its reason, which only the handshake's failure event gives (``Link.verdict``;
no timer says it), not by the clock: it comes "at once" by construction.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import pytest

from tests.guards import HANG_GUARD
from tests.web.conftest import Server
from tests.web.test_live import (
    check_disconnect_during_non_streaming_aborts,
    check_disconnect_mid_stream_aborts,
)
from tests.web.test_torch_free_api import ENGINE_ONLY, mapped_files
from tserve.nursery._tokenizer import load_chat_tokenizer

pytestmark = pytest.mark.slow

# s, --heartbeat-interval of every process here. Not the default 0.5: its ZMTP
# timeout of 0.5 s was missed once on a machine at a load average of 8 on 2
# cores (a live engine's connection dropped as the API server started).
HEARTBEAT = 1.0
BOUND = 2 * HEARTBEAT  # the detection bound docs/deployment.md states
DEADLINE = 20 * HEARTBEAT  # how long a poll waits for an outcome: a hang guard
LONG = {"prompt": "hold", "max_tokens": 400, "ignore_eos": True, "stream": True}
# The echo engine at 5 steps a second: a LONG stream needs 80 s, far longer
# than any test here holds one, so none can finish while it is held.
ECHO = ("--engine-kind", "echo", "--echo-step-time", "0.2")


class Engine:
    """``python -m tserve engine`` on ``tcp://127.0.0.1:*``; ``address`` is where it listens."""

    def __init__(self, model_dir: Path, keys: Path, *args: str, log: Path) -> None:
        command = [sys.executable, "-m", "tserve", "engine", str(model_dir)]
        command += ["--bind", "tcp://127.0.0.1:*", "--keys", str(keys)]
        command += ["--heartbeat-interval", str(HEARTBEAT), "--threads", "1", *args]
        self.log = log
        self._log_file = log.open("wb")
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            env={**os.environ, "TSERVE_LOG_LEVEL": "warning"},
            start_new_session=True,
        )
        assert self.process.stdout is not None
        line = _read_line(self.process.stdout, timeout=HANG_GUARD)
        assert line.startswith("tserve: engine at tcp://"), (line, log.read_text()[-2000:])
        self.address = line.removeprefix("tserve: engine at ").strip()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(60)
        self._log_file.close()


def _read_line(stream: IO[bytes], timeout: float) -> str:
    """The first line of a child's stdout, or "" (a hang guard, not a timing check)."""
    found: list[str] = []
    reader = threading.Thread(target=lambda: found.append(stream.readline().decode()))
    reader.daemon = True
    reader.start()
    reader.join(timeout)
    return found[0] if found else ""


def _eventually(predicate: Callable[[], bool], what: str, deadline: float = DEADLINE) -> None:
    """Poll ``predicate`` until it holds (``deadline``: a hang guard, not a timing check)."""
    give_up = time.monotonic() + deadline
    while time.monotonic() < give_up:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"not within {deadline:g} s: {what}")


def _api(engine: Engine, keys: Path, tmp_path: Path, name: str, *extra: str) -> Server:
    args = ["--engine", engine.address, "--keys", str(keys), "--served-model-name", "tiny"]
    args += ["--heartbeat-interval", str(HEARTBEAT), *extra]
    return Server(None, *args, log=tmp_path / name)


def _complete(server: Server, prompt: str = "hello", tokens: int = 4) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True}
    reply = server.client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    data: dict[str, Any] = reply.json()
    return data


def _running(server: Server) -> float:
    """The engine's running count, as this API server last heard it."""
    return server.metric("vllm:num_requests_running")


def _health(server: Server) -> int:
    """/health's status; the server answers 503 for a second after its engine died, then exits."""
    return server.client.get("/health", timeout=2).status_code


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m tserve keys DIR``, the command itself."""
    directory = tmp_path_factory.mktemp("curve") / "keys"
    done = subprocess.run(
        [sys.executable, "-m", "tserve", "keys", str(directory)],
        capture_output=True,
        timeout=HANG_GUARD,
    )
    assert done.returncode == 0, done.stderr
    return directory


@contextlib.contextmanager
def _held_streams(servers: list[Server]) -> Iterator[list[Iterator[str]]]:
    """One long stream open on each server, its first event read, not read further:
    yields each stream's lines (dropping an iterator would close its connection)."""
    with contextlib.ExitStack() as stack:
        streams = []
        for server in servers:
            response = stack.enter_context(
                server.client.stream("POST", "/v1/completions", json=LONG)
            )
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            streams.append(lines)
        yield streams


def _last_event(lines: Iterator[str]) -> dict[str, Any]:
    """The last JSON event of the rest of a stream."""
    events = [line for line in lines if line.startswith("data: {")]
    last: dict[str, Any] = json.loads(events[-1].removeprefix("data: "))
    return last


def test_api_servers_share_an_engine_and_outlive_each_other_but_not_it(
    tiny_model_dir: Path, keys: Path, tmp_path: Path
) -> None:
    """An echo engine (paced steps, no model) and four API servers (one of them
    two API processes, each attached over tcp): all serve; kill -9 of one and
    SIGSTOP of another (no FIN: only heartbeats tell) give the engine's running
    count back to what the two survivors hold, who keep serving; kill -9 of
    the engine turns both survivors' /health 503 and ends their streams with
    an error event."""
    engine = Engine(tiny_model_dir, keys, *ECHO, log=tmp_path / "engine.log")
    servers: list[Server] = []
    try:
        with ThreadPoolExecutor(4) as pool:
            starts = [
                pool.submit(_api, engine, keys, tmp_path, "a.log"),
                pool.submit(_api, engine, keys, tmp_path, "b.log", "--api-processes", "2"),
                pool.submit(_api, engine, keys, tmp_path, "killed.log"),
                pool.submit(_api, engine, keys, tmp_path, "stopped.log"),
            ]
            servers += [start.result() for start in starts]
        a, b, killed, stopped = servers
        for server in servers:
            assert _complete(server)["usage"]["completion_tokens"] == 4
        with _held_streams(servers) as (held_a, _, _, _):
            _eventually(lambda: _running(a) == 4, "the engine runs one request per server")

            killed.process.kill()
            _eventually(lambda: _running(a) == 3, "the killed server's request is dropped")
            os.killpg(stopped.process.pid, signal.SIGSTOP)
            _eventually(lambda: _running(a) == 2, "the stopped server's request is dropped")
            stopped.process.kill()
            _eventually(lambda: _running(b) == 2, "the other survivor hears the same")
            _complete(a)  # the survivors still serve
            _complete(b)

            engine.process.kill()
            _eventually(lambda: _health(a) == 503, "/health turns 503 on one survivor")
            _eventually(lambda: _health(b) == 503, "and on the other")
            assert "error" in _last_event(held_a)
        for server in (a, b):
            assert server.process.wait(DEADLINE) == 1  # an API server without its engine exits
    finally:
        for server in servers:
            server.stop(signal.SIGKILL)
        engine.stop()


def test_a_model_engine_over_tcp(tiny_model_dir: Path, keys: Path, tmp_path: Path) -> None:
    """The tiny model's engine and one API server: it tokenizes exactly as the
    model directory says without having it, holds no torch, frees the KV of
    a client that hangs up (as over ipc); the sampling defaults of the
    engine's --generation-config apply to the server's requests; a server
    with a key the engine does not know is refused and says so, from the handshake's
    failure event."""
    defaults = tmp_path / "defaults"
    defaults.mkdir()
    (defaults / "generation_config.json").write_text(json.dumps({"top_k": 1}))
    engine = Engine(
        tiny_model_dir, keys, "--generation-config", str(defaults), log=tmp_path / "engine.log"
    )
    server: Server | None = None
    try:
        server = _api(engine, keys, tmp_path, "api.log")
        _check_the_tokenizer_came_over_the_wire(server, tiny_model_dir)
        _check_the_engines_sampling_defaults_apply(server)
        mapped = mapped_files(server.process.pid)
        assert [f for f in mapped if any(part in f for part in ENGINE_ONLY)] == []
        _check_disconnects_free_the_engine(server)
        _check_an_unknown_key_is_refused(engine, keys, tmp_path)
    finally:
        if server is not None:
            server.stop(signal.SIGKILL)
        engine.stop()


def test_sigterm_stops_an_engine_over_tcp_cleanly(
    tiny_model_dir: Path, keys: Path, tmp_path: Path
) -> None:
    """SIGTERM stops the engine cleanly (exit 0), ending a live stream (the echo
    engine's, which cannot finish meanwhile) with an error event that says
    so; the API server then exits 1."""
    engine = Engine(tiny_model_dir, keys, *ECHO, log=tmp_path / "engine.log")
    server: Server | None = None
    try:
        server = _api(engine, keys, tmp_path, "api.log")
        with _held_streams([server]) as (held,):
            engine.process.send_signal(signal.SIGTERM)
            assert engine.process.wait(DEADLINE) == 0
            error = _last_event(held)["error"]
            assert "stopped (SIGTERM)" in error["message"]
        assert server.process.wait(DEADLINE) == 1
    finally:
        if server is not None:
            server.stop(signal.SIGKILL)
        engine.stop()


def _check_the_tokenizer_came_over_the_wire(server: Server, model_dir: Path) -> None:
    local = load_chat_tokenizer(str(model_dir))
    messages = [{"role": "user", "content": "Say hi"}]
    text = server.client.post("/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    chat = server.client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert text == local.encode("Hello world")
    assert chat == local.apply_chat_template(messages)
    body = {"messages": messages, "max_tokens": 3, "ignore_eos": True}
    reply = server.client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3


def _check_the_engines_sampling_defaults_apply(server: Server) -> None:
    """top_k 1 from the engine makes every request that leaves it unset greedy,
    whatever its seed; the request's own top_k samples."""

    def text(**sampling: Any) -> str:
        body = {"prompt": "hello", "max_tokens": 16, "ignore_eos": True, **sampling}
        reply = server.client.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        return str(reply.json()["choices"][0]["text"])

    greedy = text(temperature=0)
    assert [text(seed=seed) for seed in (1, 2, 3)] == [greedy] * 3
    assert greedy not in [text(seed=seed, top_k=0) for seed in (1, 2, 3)]


def _check_disconnects_free_the_engine(server: Server) -> None:
    """tests/web/test_live.py's disconnect checks, over tcp."""
    check_disconnect_mid_stream_aborts(server)
    check_disconnect_during_non_streaming_aborts(server)


def _check_an_unknown_key_is_refused(engine: Engine, keys: Path, tmp_path: Path) -> None:
    other = tmp_path / "other-keys"
    subprocess.run(
        [sys.executable, "-m", "tserve", "keys", str(other)], check=True, timeout=HANG_GUARD
    )
    shutil.copy(keys / "server.key", other / "server.key")  # the right engine, an unknown client
    command = [sys.executable, "-m", "tserve", "serve", "--engine", engine.address]
    command += ["--keys", str(other), "--port", "0"]
    env = {**os.environ, "TSERVE_EMBEDDING_MODEL": "none"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=HANG_GUARD)
    assert done.returncode == 1
    assert "refused this server's CURVE key" in done.stderr, done.stderr[-2000:]
    assert "refused an API server whose CURVE public key" in engine.log.read_text()
