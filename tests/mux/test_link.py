"""The mux over a network link: CURVE keys, a refused key said at once, a vanished engine.

The monitor's rules alone (``Link.verdict``, sans-IO); then a real mux against
the engine's real socket (``tserve.gpu.engine._bind``) in a thread of this process,
answering only the handshake; then a fake engine process that the test stops
with SIGSTOP, so that its connection stays open but nothing answers: the
case only heartbeats can tell (a killed process closes its connections).
Waits are hang guards, generous multiples of the stated bounds. A refusal is
said "at once" by construction: each reason the tests match comes only from a
handshake's failure event (``Link.verdict``), never from a timer, so the
reason, not the clock, shows it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import pytest
import zmq

from tests.guards import HANG_GUARD
from tests.mux.fake_engine import run_fake_engine
from tests.mux.test_mux import _open, _read_all
from tserve import protocol as p
from tserve._curve import client_keys, server_keys, write_keys
from tserve.gpu.engine._bind import bind_engine_socket
from tserve.mux import EngineDeadError, Link, open_mux

pytestmark = pytest.mark.anyio

INTERVAL = 0.5  # s, the heartbeat interval of these tests

BUNDLE = {"tokenizer.json": b"{}", "additional_chat_templates/tools.jinja": b"{{ x }}"}


# -- the rules ------------------------------------------------------------------------


def test_a_refused_key_is_death_that_names_the_key() -> None:
    reason = Link().verdict(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400, "tcp://e:5555")
    assert reason is not None
    assert "tcp://e:5555 refused this server's CURVE key" in reason and "client.key" in reason


def test_a_mechanism_mismatch_says_which_side_is_insecure() -> None:
    mismatch = zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
    plain = Link().verdict(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, mismatch, "tcp://e:1")
    assert plain is not None and "this server runs --insecure" in plain


def test_a_lost_connection_is_death_and_progress_is_not() -> None:
    link = Link(heartbeat_interval=0.5)
    lost = link.verdict(zmq.EVENT_DISCONNECTED, 9, "tcp://e:1")
    assert lost is not None and "lost the connection" in lost and "0.5 s" in lost
    for event in (zmq.EVENT_CONNECTED, zmq.EVENT_CONNECT_RETRIED, zmq.EVENT_HANDSHAKE_SUCCEEDED):
        assert link.verdict(event, 0, "tcp://e:1") is None


def test_the_heartbeat_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        Link(heartbeat_interval=0)


# -- a real mux against the engine's socket ------------------------------------------


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    write_keys(tmp_path / "keys")
    return tmp_path / "keys"


@contextmanager
def handshake_engine(keys: Path | None) -> Iterator[str]:
    """The engine's own socket (CURVE with ``keys``) in a thread that answers
    every Hello with EngineReady and a TokenizerBundle; yields its address."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    address: list[str] = []
    bound, stop = threading.Event(), threading.Event()
    ready = p.EngineReady("fake", "/nowhere", 64, 16, [0], 4, 0, "none", os.getpid())

    def serve() -> None:
        server = None if keys is None else server_keys(keys)
        with bind_engine_socket(
            context, "tcp://127.0.0.1:*", heartbeat_interval=INTERVAL, keys=server
        ) as sock:
            address.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
            bound.set()
            while not stop.is_set():
                if sock.poll(50):
                    peer, frame = sock.recv_multipart()
                    hello = p.decode(frame)
                    if isinstance(hello, p.Hello):
                        sock.send_multipart([peer, p.encode(ready)])
                        if hello.tokenizer:
                            sock.send_multipart([peer, p.encode(p.TokenizerBundle(BUNDLE))])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert bound.wait(HANG_GUARD)
    try:
        yield address[0]
    finally:
        stop.set()
        thread.join(HANG_GUARD)
        context.term()


def foreign_keys(keys: Path, tmp_path: Path, *, server_key_too: bool = False) -> Path:
    """A client key pair the engine does not know; with the engine's real
    ``server.key`` unless ``server_key_too``."""
    other = tmp_path / "other"
    write_keys(other)
    if not server_key_too:
        shutil.copy(keys / "server.key", other / "server.key")
    return other


async def test_a_known_key_gets_ready_and_the_tokenizer(keys: Path) -> None:
    with handshake_engine(keys) as address, anyio.fail_after(HANG_GUARD):
        async with open_mux(address, link=Link(client_keys(keys), INTERVAL)) as mux:
            assert mux.ready.model == "fake"
            assert mux.tokenizer_bundle == p.TokenizerBundle(BUNDLE)


async def test_an_unknown_key_is_refused_and_said_at_once(keys: Path, tmp_path: Path) -> None:
    other = client_keys(foreign_keys(keys, tmp_path))
    refused = pytest.raises(EngineDeadError, match="refused this server's CURVE key")
    with handshake_engine(keys) as address, anyio.fail_after(HANG_GUARD), refused:
        async with open_mux(address, link=Link(other, INTERVAL)):
            pass


async def test_a_wrong_server_key_fails_the_handshake(keys: Path, tmp_path: Path) -> None:
    other = client_keys(foreign_keys(keys, tmp_path, server_key_too=True))
    failed = pytest.raises(EngineDeadError, match=r"handshake .* failed.*server\.key")
    with handshake_engine(keys) as address, anyio.fail_after(HANG_GUARD), failed:
        async with open_mux(address, link=Link(other, INTERVAL)):
            pass


async def test_an_insecure_server_against_a_keyed_engine_is_told_so(keys: Path) -> None:
    """The engine may hang up before saying why: either reason points at the keys."""
    told = pytest.raises(EngineDeadError, match=r"runs --insecure|engine run with --keys\?")
    with handshake_engine(keys) as address, anyio.fail_after(HANG_GUARD), told:
        async with open_mux(address, link=Link(None, INTERVAL)):
            pass


# -- an engine that vanished without closing its connection ---------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_an_engine_that_stops_answering_is_dead_within_the_bound() -> None:
    """SIGSTOP: the engine's connection stays open, nothing answers. Its
    request fails with EngineDeadError (bound: 1.5 intervals; the guard is
    ten times that, for a loaded machine)."""
    address = f"tcp://127.0.0.1:{_free_port()}"
    with run_fake_engine(address, step_delay=0.02) as engine, anyio.fail_after(HANG_GUARD):
        async with open_mux(address, link=Link(None, INTERVAL), ready_timeout=HANG_GUARD) as mux:
            assert mux.tokenizer_bundle == p.TokenizerBundle({})
            mailbox = _open(mux, "long", 0, 100_000)
            await mailbox.get()
            os.kill(engine.pid, signal.SIGSTOP)
            try:
                with anyio.fail_after(15 * INTERVAL), pytest.raises(EngineDeadError) as info:
                    await _read_all(mailbox)
            finally:
                os.kill(engine.pid, signal.SIGCONT)
            assert "lost the connection" in str(info.value)
            assert mux.dead
