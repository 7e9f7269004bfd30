"""Live servers for tests/web: ``python -m tserve serve`` in a subprocess on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.guards import HANG_GUARD
from tests.processes import child_pids, command_line
from tserve._host import raise_fd_limit

API_KEY = "sk-test-key"


class Server:
    """A ``python -m tserve serve`` child process; ``url`` is its base URL, and
    ``metrics_url`` that of its metrics process (``--metrics-port``), if any.

    ``model_dir`` None: no model argument (``serve --engine ADDRESS`` in ``args``).
    """

    def __init__(self, model_dir: Path | None, *args: str, log: Path) -> None:
        raise_fd_limit()
        model = [] if model_dir is None else [str(model_dir)]
        command = [sys.executable, "-m", "tserve", "serve", *model, "--port", "0"]
        self.log = log
        self._log_file = log.open("wb")
        self.process = subprocess.Popen(
            [*command, *args],
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            # No embedding engine unless a test asks (--embedding-model wins).
            env={**os.environ, "TSERVE_LOG_LEVEL": "warning", "TSERVE_EMBEDDING_MODEL": "none"},
            # Its own process group, as a shell gives a foreground job, so that
            # a test can signal the group (Ctrl-C) without signalling pytest.
            start_new_session=True,
        )
        self.metrics_url: str | None = None
        self.url = self._wait_for_url()
        self.client = httpx.Client(base_url=self.url, timeout=60)

    def _wait_for_url(self) -> str:
        assert self.process.stdout is not None
        found: list[str] = []

        def read() -> None:
            assert self.process.stdout is not None
            for raw in self.process.stdout:
                line = raw.decode()
                if line.startswith("tserve: metrics at "):
                    self.metrics_url = line.rsplit(" at ", 1)[1].strip().removesuffix("/metrics")
                if line.startswith("tserve: serving"):
                    found.append(line.rsplit(" at ", 1)[1].strip().removesuffix("/v1"))
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout=HANG_GUARD)
        if not found:
            self.process.kill()
            raise RuntimeError(f"server did not start:\n{self.log.read_text()[-3000:]}")
        return found[0]

    @property
    def engine_pid(self) -> int:
        """The engine process: the server's only ``-m tserve.gpu`` child (its
        grammar worker, once a constrained request started it, is another)."""
        pids = [
            pid
            for pid in child_pids(self.process.pid)
            if b"-m\0tserve.gpu\0" in (command_line(pid) or b"")
        ]
        assert len(pids) == 1, pids
        return pids[0]

    @contextlib.contextmanager
    def engine_stopped(self) -> Iterator[None]:
        """The engine process stopped (SIGSTOP) for the block, continued after it.

        A gate, not a pace: nothing the engine runs can make progress or finish
        meanwhile, while the API process admits, queues and refuses as usual.
        The API process takes an engine silent for its heartbeat timeout (30 s)
        for dead, so a block holds only a few quick requests (a hang guard's
        margin, not a timing assumption).
        """
        engine = self.engine_pid
        os.kill(engine, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(engine, signal.SIGCONT)

    def metric(self, name: str) -> float:
        """The value of ``name`` on one scrape, summed over its label sets."""
        values = [
            float(line.rsplit(" ", 1)[1])
            for line in self.client.get("/metrics").text.splitlines()
            if line.startswith((name + " ", name + "{"))
        ]
        if not values:
            raise KeyError(name)
        return sum(values)

    def wait_for_metric(self, name: str, value: float, timeout: float = HANG_GUARD) -> None:
        """Poll /metrics until ``name == value`` (a hang guard, not a timing check)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.metric(name) == value:
                return
            time.sleep(0.05)
        raise AssertionError(f"{name} stayed {self.metric(name)}, expected {value}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self.client.close()
        self._log_file.close()
        return code


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A non-blocking TCP listener on 127.0.0.1 (any free port), closed after the test."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    sock.setblocking(False)
    with sock:
        yield sock


@pytest.fixture
def start_server(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """``start_server(*args)`` starts a server; every one is stopped at teardown."""
    servers: list[Server] = []

    def start(*args: str) -> Server:
        log = tmp_path / f"server{len(servers)}.log"
        server = Server(tiny_model_dir, "--served-model-name", "tiny", *args, log=log)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(signal.SIGKILL)


@contextlib.contextmanager
def keyed_server(model_dir: Path, *args: str, log: Path) -> Iterator[Server]:
    """A server of ``model_dir`` as "tiny" with ``API_KEY`` (its client sends it) and
    ``args``; after the block it must stop cleanly (exit status 0)."""
    srv = Server(model_dir, "--served-model-name", "tiny", "--api-key", API_KEY, *args, log=log)
    srv.client.headers["Authorization"] = f"Bearer {API_KEY}"
    yield srv
    assert srv.stop() == 0, srv.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One shared server with an API key, for tests that leave it as they found it."""
    yield from served(tiny_model_dir, tmp_path_factory, "--max-pending", "512")


@pytest.fixture
def nothing_left_in_flight(server: Server) -> Iterator[None]:
    """After the test, nothing in flight on the shared server (each a hang guard);
    a module of tests takes it with ``pytest.mark.usefixtures``."""
    yield
    server.wait_for_metric("tserve_http_generations_in_flight", 0)
    server.wait_for_metric("tserve_requests_live", 0)


def served(
    model_dir: Path, tmp: pytest.TempPathFactory, *args: str, folder: str = "server"
) -> Iterator[Server]:
    """A :func:`keyed_server` of ``model_dir`` with ``args``, its log in a new
    temporary ``folder``: for a module-scoped fixture to ``yield from``."""
    with keyed_server(model_dir, *args, log=tmp.mktemp(folder) / "server.log") as srv:
        yield srv


def tiny_model_copy(tiny_model_dir: Path, directory: Path, **config: Any) -> Path:
    """``directory``: a copy of the tiny model, ``config`` written over its config.json."""
    shutil.copytree(tiny_model_dir, directory)
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return directory


def named_events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """The (event name, data) pairs of a named-event SSE response (Messages,
    Responses), checking each name is its data's ``type``."""
    out: list[tuple[str, dict[str, Any]]] = []
    name = ""
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data = json.loads(line.removeprefix("data: "))
            assert name == data["type"], (name, data)
            out.append((name, data))
            name = ""
    return out
