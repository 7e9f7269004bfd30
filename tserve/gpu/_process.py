"""The engine process: a ROUTER socket around a :class:`~tserve.gpu._core.Core`:
an :class:`EngineCore`, an :class:`EmbedCore` when ``config.task`` is "embed",
or an :class:`EchoCore` when ``config.engine_kind`` is "echo" (same loop,
same wire).

Plain blocking pyzmq; no trio, anyio or quart. The main loop, in steps:

1. drain the inbox (hellos, adds, aborts, shutdown): wait at most one
   heartbeat interval when idle, not at all when work is running;
2.-5. ``core.step()``: schedule, run the model, sample, update;
6. send ONE StepOutputs frame per API peer holding every request's new tokens,
   and a Heartbeat to each peer that heard nothing for an interval; never
   blocking on a slow peer (the :class:`Outbox` coalesces).

The process exits 0 on Shutdown (after sending every live request's final
ABORT output), and also when its parent (the API process that started it) is
gone: it checks on every iteration, so it notices within one heartbeat
interval or one step (while the model loads, a watcher thread checks every
heartbeat interval and interrupts the load). Any exception out of the batch (the model, the device)
is fatal: every peer gets EngineDead with the reason and the process exits 1.
Errors that concern one request never get here; the core ends that request
alone.
"""

from __future__ import annotations

import _thread
import contextlib
import ctypes
import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable

import zmq

from tserve._host import pid_alive
from tserve.gpu._core import Core
from tserve.gpu._outbox import Outbox
from tserve.protocol import (
    EngineConfig,
    EngineDead,
    EngineInput,
    Hello,
    ProtocolError,
    Shutdown,
    decode,
)

__all__ = ["run_engine"]

log = logging.getLogger("tserve.engine")

# Bounds of the engine's socket, in frames. At SNDHWM a send raises zmq.Again
# and the Outbox coalesces (see _outbox.py); at RCVHWM ZMQ stops reading from
# the peer and the peer's own send waits: nothing is dropped either way.
SNDHWM = 1000
RCVHWM = 1000
# Frames applied per drain while work is running, so that a flood of input
# cannot hold off the next step; the rest wait in the socket (RCVHWM above).
MAX_FRAMES_PER_DRAIN = 256
# How long an idle loop waits when only a slow peer's backlog is left: it
# retries the flush this often instead of spinning.
BACKLOG_RETRY = 0.01
# How long a dying engine keeps trying to hand EngineDead to a peer at its HWM.
DEAD_SEND_TIMEOUT = 1.0
# glibc's malloc maps large blocks (a step's activations, logits, gathered K/V)
# fresh from the kernel and unmaps them on free, and gives freed heap back once
# 128 KiB sit free at its top: every step then faults its memory back in page
# by page, zeroed by the kernel. Measured on SmolLM2 (64 requests of 64 tokens
# through open_llm): 13 of the engine's 39 s were system time; with blocks up
# to MALLOC_MMAP_THRESHOLD kept in the heap and up to MALLOC_TRIM_THRESHOLD of
# freed heap kept, 24 s, system time 0.
MALLOC_MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit
MALLOC_TRIM_THRESHOLD = 1 << 30
# How long a load whose parent is gone may take to unwind before the process
# just ends (a main thread stuck in a C call never sees the interrupt).
LOAD_EXIT_GRACE = 5.0


class _Stop(Exception):
    """Leave the main loop cleanly (Shutdown received)."""


def run_engine(config: EngineConfig, address: str, parent_pid: int) -> int:
    """Serve ``address`` until told to stop; returns the process exit code."""
    # Ctrl-C in a terminal reaches the whole process group; the API process
    # decides what happens and tells us with Shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _keep_freed_heap()
    parent_alive = _parent_watch(parent_pid)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDHWM, SNDHWM)
    sock.setsockopt(zmq.RCVHWM, RCVHWM)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.bind(address)
    outbox = Outbox(sock)
    try:
        try:
            core = _load(config, parent_alive)
        except Exception as exc:
            log.exception("engine failed to start")
            _report_death(sock, outbox, f"engine failed to start: {exc}", wait_for_peers=True)
            return 1
        if core is None:
            return 0
        return _serve(core, sock, outbox, config.heartbeat_interval, parent_alive)
    except _ParentGone:  # the watcher's interrupt landed just after loading finished
        return 0
    finally:
        sock.close()
        ctx.term()


def _keep_freed_heap() -> None:
    """Tell glibc's malloc to keep a step's memory (see MALLOC_MMAP_THRESHOLD); no-op elsewhere."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: its own policy stands
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    ok = mallopt(m_mmap_threshold, MALLOC_MMAP_THRESHOLD)
    if not (ok and mallopt(m_trim_threshold, MALLOC_TRIM_THRESHOLD)):
        log.warning("mallopt refused the heap settings; the engine may spend time in page faults")


class _ParentGone(BaseException):
    """Raised in the main thread while the model loads, when the parent is gone.

    A BaseException so that no ``except Exception`` in loading code stops it.
    """


def _load(config: EngineConfig, parent_alive: Callable[[], bool]) -> Core | None:
    """Build the core; None when the parent went away meanwhile.

    Loading can take long (the first conversion of the default model, a large
    model, a slow disk). A watcher thread checks the parent every heartbeat
    interval; when it is gone it interrupts the main thread, which unwinds
    (a half-written conversion is removed on the way), and should the main
    thread be stuck in a call that cannot be interrupted, it ends the process
    after :data:`LOAD_EXIT_GRACE` seconds.
    """
    loaded = threading.Event()

    def watch() -> None:
        while not loaded.wait(config.heartbeat_interval):
            if not parent_alive():
                log.warning("the API process that started the engine is gone; engine exits")
                _thread.interrupt_main(signal.SIGINT)
                if not loaded.wait(LOAD_EXIT_GRACE):
                    os._exit(0)
                return

    def interrupted(signum: int, frame: object) -> None:
        if not parent_alive():  # the watcher's interrupt, not a stray SIGINT
            raise _ParentGone

    previous = signal.signal(signal.SIGINT, interrupted)
    threading.Thread(target=watch, name="tserve-parent-watch", daemon=True).start()
    try:
        return _build_core(config)
    except _ParentGone:
        return None
    finally:
        loaded.set()
        signal.signal(signal.SIGINT, previous)


def _build_core(config: EngineConfig) -> Core:
    """The core ``config`` asks for; each is imported only when chosen (torch: seconds)."""
    if config.engine_kind == "echo":
        from tserve.gpu._echo_core import EchoCore

        return EchoCore(config, progress=log.info)
    if config.task == "embed":
        from tserve.gpu._embed_core import EmbedCore

        return EmbedCore(config, progress=log.info)
    from tserve.gpu._engine import EngineCore

    return EngineCore(config, progress=log.info)


def _serve(
    core: Core,
    sock: zmq.Socket[bytes],
    outbox: Outbox,
    interval: float,
    parent_alive: Callable[[], bool],
) -> int:
    try:
        while True:
            if core.has_work:
                timeout = 0.0
            else:
                timeout = min(interval, BACKLOG_RETRY) if outbox.pending else interval
            _drain_inbox(core, sock, outbox, timeout)  # 1
            if not parent_alive():
                log.warning("the API process that started the engine is gone; engine exits")
                return 0
            if core.has_work:
                for peer, output in core.step():  # 2-5
                    outbox.queue(peer, output)
            if outbox.pending:  # 6
                _forget_peers(core, outbox.flush(core.stats()))
            _forget_peers(core, outbox.heartbeat(core.stats(), interval))
    except _Stop:
        core.abort_all()
        for peer, output in core.step():
            outbox.queue(peer, output)
        outbox.flush(core.stats())
        return 0
    except Exception:
        reason = traceback.format_exc(limit=8)
        log.error("engine failed:\n%s", reason)
        _report_death(sock, outbox, reason.strip().splitlines()[-1], wait_for_peers=False)
        return 1


def _drain_inbox(core: Core, sock: zmq.Socket[bytes], outbox: Outbox, timeout: float) -> None:
    """Apply the frames waiting on the socket; wait up to ``timeout`` for the first."""
    if timeout > 0 and not sock.poll(int(timeout * 1000), zmq.POLLIN):
        return
    for _ in range(MAX_FRAMES_PER_DRAIN):
        try:
            peer, frame = sock.recv_multipart(flags=zmq.NOBLOCK, copy=True)
        except zmq.Again:
            return
        _apply(core, outbox, peer, frame)


def _apply(core: Core, outbox: Outbox, peer: bytes, frame: bytes) -> None:
    try:
        message = decode(frame)
    except ProtocolError as exc:
        log.error("dropping malformed frame from peer %r: %s", peer, exc)
        return
    match message:
        case EngineInput(adds=adds, aborts=aborts):
            outbox.add_peer(peer)  # a peer that skipped Hello still gets its outputs
            for request in adds:
                core.add(request, peer)
            core.abort(aborts, peer)
        case Hello():
            outbox.add_peer(peer)
            outbox.send(peer, core.ready_info())
        case Shutdown(reason=reason):
            log.info("shutdown requested%s", f": {reason}" if reason else "")
            raise _Stop
        case _:
            log.error("unexpected %s from peer %r", type(message).__name__, peer)


def _forget_peers(core: Core, gone: list[bytes]) -> None:
    for peer in gone:
        log.warning("API peer %r is gone; aborting its requests", peer)
        core.abort_peer(peer)


def _parent_watch(parent_pid: int) -> Callable[[], bool]:
    """A cheap check, called every iteration, that the API process still exists.

    When ``parent_pid`` is our parent, its death reparents us, so comparing
    ``os.getppid()`` is exact (no pid-reuse race). Otherwise (an intermediate
    launcher) fall back to probing the pid with signal 0.
    """
    if os.getppid() == parent_pid:
        return lambda: os.getppid() == parent_pid
    log.warning("parent pid %d is not our parent; watching it by pid", parent_pid)

    return lambda: pid_alive(parent_pid)


def _report_death(
    sock: zmq.Socket[bytes], outbox: Outbox, reason: str, *, wait_for_peers: bool
) -> None:
    """Send EngineDead to every peer, including any whose Hello is still queued.

    A peer at its HWM is retried for up to ``DEAD_SEND_TIMEOUT`` seconds.
    """
    deadline = time.monotonic() + (2.0 if wait_for_peers else 0.0)
    while True:
        remaining = deadline - time.monotonic()
        if not sock.poll(max(0, int(remaining * 1000)), zmq.POLLIN):
            break
        try:
            peer, frame = sock.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            break
        with contextlib.suppress(ProtocolError):
            if isinstance(decode(frame), Hello | EngineInput):
                outbox.add_peer(peer)
    waiting = outbox.peers
    give_up = time.monotonic() + DEAD_SEND_TIMEOUT
    while waiting:
        waiting = [peer for peer in waiting if outbox.send(peer, EngineDead(reason)) is False]
        if not waiting or time.monotonic() >= give_up:
            break
        time.sleep(0.01)
