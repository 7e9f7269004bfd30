"""The engine process: a ROUTER socket around a :class:`~tserve.gpu.engine._core.Core`:
an :class:`EngineCore`, an :class:`EmbedCore` when ``config.task`` is "embed",
or an :class:`EchoCore` when ``config.engine_kind`` is "echo" (same loop,
same wire).

Plain blocking pyzmq; no trio, anyio or quart. The main loop, in steps:

1. drain the inbox (hellos, adds, aborts, shutdown): wait at most one tick
   when idle, not at all when work is running;
2.-5. ``core.step()``: schedule, run the model, sample, update;
6. send ONE StepOutputs frame per API peer holding every request's new tokens,
   and a Heartbeat to each peer that heard nothing for a tick; never
   blocking on a slow peer (the :class:`Outbox` coalesces). A peer found gone
   (EHOSTUNREACH) has its requests aborted.

While a step runs (2.-5.), the :class:`~tserve.gpu.engine._pulse.Pulse` thread
sends the Heartbeats, for as long as the step makes progress (``_pulse.py``):
a long step is not a silent engine, a step that stops progressing is.

A tick is the heartbeat interval, or half of it for ``tserve engine``, whose
heartbeats also probe whether a peer is still there (``_bind.py``).

The process stops cleanly when told (exit 0): by Shutdown from the API
process that started it, after every live request's final ABORT output; or,
for ``tserve engine``, by SIGTERM/SIGINT: its live requests are aborted and
each peer gets the outputs it was owed and then EngineDead saying why, so
that its live requests fail with that reason (its API servers run on). It
also exits 0 when the API process that started it is gone (``_lifeline.py``:
checked every iteration, while the model loads, and by the pulse thread
during a step). Any exception out of
the batch (the model, the device) is fatal: every peer gets EngineDead with
the reason and the process exits 1. Errors that concern one request never
get here; the core ends that request alone.

Test-only fault injection: when ``TSERVE_TEST_FAULT_LOAD_HOLD`` names a
directory, the engine creates ``DIR/held-PID`` before it builds its core and
waits there until ``DIR/release`` exists: a load that cannot finish on its
own, for tests of requests that wait for a model's load. It is unset in
production and nothing that arrives over HTTP or the wire can set it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Final

import zmq

from tserve._curve import ServerKeys
from tserve._gc import serving_gc
from tserve._host import trim_heap
from tserve.gpu.engine._bind import bind_engine_socket
from tserve.gpu.engine._core import Core, tokenizer_bundle
from tserve.gpu.engine._lifeline import Lifeline, ParentLifeline, SignalLifeline, Stopped
from tserve.gpu.engine._outbox import Outbox
from tserve.gpu.engine._pulse import Pulse
from tserve.gpu.kernels._heap import keep_freed_heap
from tserve.gpu.models._directory import ModelLoadError
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

# Frames applied per drain while work is running, so that a flood of input
# cannot hold off the next step; the rest wait in the socket (RCVHWM, _bind.py).
MAX_FRAMES_PER_DRAIN = 256
# How long an idle loop waits when only a slow peer's backlog is left: it
# retries the flush this often instead of spinning.
BACKLOG_RETRY = 0.01
# How long a dying engine keeps trying to hand EngineDead to a peer at its HWM.
DEAD_SEND_TIMEOUT = 1.0
# How long an engine whose load failed waits for its API process to say Hello.
LOAD_FAILURE_WAIT = 120.0


class _Stop(Exception):
    """Leave the main loop cleanly (Shutdown received, or a stop signal)."""


def run_engine(
    config: EngineConfig,
    address: str,
    parent_pid: int | None,
    *,
    keys: ServerKeys | None = None,
    on_bound: Callable[[str], None] | None = None,
) -> int:
    """Serve ``address`` until told to stop; returns the process exit code.

    ``parent_pid``: the API process that started this engine, which it
    outlives by at most a heartbeat interval; None for ``tserve engine``,
    which runs until SIGTERM/SIGINT (``_lifeline.py``) and watches its peers
    by heartbeats. ``keys``: CURVE (``_bind.py``). ``on_bound`` is called
    with the bound endpoint (the real port of ``tcp://host:*``) before the
    model loads.
    """
    interval = config.heartbeat_interval
    lifeline: Lifeline = (
        SignalLifeline() if parent_pid is None else ParentLifeline(parent_pid, interval)
    )
    # tserve engine's peers are known by their connections alone (_bind.py).
    beats = interval if lifeline.standalone else None
    tick = interval / 2 if lifeline.standalone else interval
    keep_freed_heap()  # _heap.py: a step's memory is kept, what loading freed is not
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with bind_engine_socket(ctx, address, heartbeat_interval=beats, keys=keys) as sock:
            if on_bound is not None:
                on_bound(sock.getsockopt_string(zmq.LAST_ENDPOINT))
            outbox = Outbox(sock)
            try:
                core = lifeline.load(lambda: _build_core(config))
            except ModelLoadError as exc:  # the model named is at fault: its line says all
                log.error("engine failed to start: %s", exc)
                _report_load_failure(sock, outbox, f"engine failed to start: {exc}", lifeline)
                return 1
            except Exception as exc:
                log.exception("engine failed to start")
                _report_load_failure(sock, outbox, f"engine failed to start: {exc}", lifeline)
                return 1
            if core is None:
                return 0
            trim_heap()
            try:
                with serving_gc():  # the loaded model's heap frozen, gen-0 collections rarer
                    return _serve(core, sock, outbox, tick, lifeline)
            finally:
                core.close()
    except Stopped:  # a stop that landed just after loading finished
        return 0
    finally:
        ctx.term()


LOAD_HOLD_ENV: Final = "TSERVE_TEST_FAULT_LOAD_HOLD"
_LOAD_HOLD_POLL = 0.01  # s between looks for the release file


def _hold_load() -> None:
    """The test-only load hold of the module docstring; returns at once when unset."""
    directory = os.environ.get(LOAD_HOLD_ENV)
    if not directory:
        return
    (Path(directory) / f"held-{os.getpid()}").touch()
    while not (Path(directory) / "release").exists():
        time.sleep(_LOAD_HOLD_POLL)


def _build_core(config: EngineConfig) -> Core:
    """The core ``config`` asks for; each is imported only when chosen (torch: seconds)."""
    _hold_load()
    if config.engine_kind == "echo":
        from tserve.gpu.engine._echo_core import EchoCore

        return EchoCore(config, progress=log.info)
    if config.task == "embed":
        from tserve.gpu.engine._embed_core import EmbedCore

        return EmbedCore(config, progress=log.info)
    from tserve.gpu.engine._engine_core import EngineCore

    return EngineCore(config, progress=log.info)


def _serve(
    core: Core, sock: zmq.Socket[bytes], outbox: Outbox, tick: float, lifeline: Lifeline
) -> int:
    orphaned = None if lifeline.standalone else lifeline.stop_reason
    with Pulse(outbox, core.progress, tick, orphaned) as pulse:  # holds the socket but in steps
        return _loop(core, sock, outbox, tick, lifeline, pulse)


def _loop(
    core: Core,
    sock: zmq.Socket[bytes],
    outbox: Outbox,
    tick: float,
    lifeline: Lifeline,
    pulse: Pulse,
) -> int:
    try:
        while True:
            idle = min(tick, BACKLOG_RETRY) if outbox.pending else tick
            timeout = 0.0 if core.has_work else idle
            _drain_inbox(core, sock, outbox, timeout, lifeline.standalone)  # 1
            if (reason := lifeline.stop_reason()) is not None:
                if not lifeline.standalone:  # the API process is gone: nobody to tell
                    log.warning("%s; engine exits", reason)
                    return 0
                raise _Stop(reason)
            if core.has_work:
                with pulse.stepping(core.stats()):  # the pulse speaks while it runs
                    outputs = core.step()  # 2-5
                _forget_peers(core, pulse.take_gone())
                for peer, output in outputs:
                    outbox.queue(peer, output)
            if outbox.pending:  # 6
                _forget_peers(core, outbox.flush(core.stats()))
            _forget_peers(core, outbox.heartbeat(core.stats(), tick))
    except _Stop as stop:
        core.abort_all()
        aborted = core.step()
        if lifeline.standalone:  # its peers run on: their requests fail with the reason
            outbox.flush(core.stats())
            _report_death(sock, outbox, str(stop), wait_for_peers=False)
            return 0
        for peer, output in aborted:
            outbox.queue(peer, output)
        outbox.flush(core.stats())
        return 0
    except Exception:
        reason = traceback.format_exc(limit=8)
        log.error("engine failed:\n%s", reason)
        _report_death(sock, outbox, reason.strip().splitlines()[-1], wait_for_peers=False)
        return 1


def _drain_inbox(
    core: Core, sock: zmq.Socket[bytes], outbox: Outbox, timeout: float, shared: bool
) -> None:
    """Apply the frames waiting on the socket; wait up to ``timeout`` for the first."""
    if timeout > 0 and not sock.poll(int(timeout * 1000), zmq.POLLIN):
        return
    for _ in range(MAX_FRAMES_PER_DRAIN):
        try:
            peer, frame = sock.recv_multipart(flags=zmq.NOBLOCK, copy=True)
        except zmq.Again:
            return
        _apply(core, outbox, peer, frame, shared)


def _apply(core: Core, outbox: Outbox, peer: bytes, frame: bytes, shared: bool) -> None:
    """Act on one frame from ``peer``. A ``shared`` engine (``tserve engine``)
    ignores Shutdown: one of its API servers leaving must not stop the others'."""
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
        case Hello(tokenizer=tokenizer, grammars=grammars):
            outbox.add_peer(peer)
            if grammars:
                core.prepare_grammars()  # blocks, once: before this peer is ready
            ready = core.ready_info()
            outbox.send(peer, ready)
            if tokenizer and not outbox.send(peer, tokenizer_bundle(Path(ready.model_path))):
                log.error("could not send the tokenizer to peer %r (gone or at its HWM)", peer)
        case Shutdown(reason=reason) if shared:
            log.warning("ignored a Shutdown from peer %r%s", peer, f" ({reason})" if reason else "")
        case Shutdown(reason=reason):
            log.info("shutdown requested%s", f": {reason}" if reason else "")
            raise _Stop("shutdown requested")
        case _:
            log.error("unexpected %s from peer %r", type(message).__name__, peer)


def _forget_peers(core: Core, gone: list[bytes]) -> None:
    for peer in gone:
        log.warning("API peer %r is gone; aborting its requests", peer)
        core.abort_peer(peer)


def _report_load_failure(
    sock: zmq.Socket[bytes], outbox: Outbox, reason: str, lifeline: Lifeline
) -> None:
    """:func:`_report_death` for a load that failed. An engine that an API process
    started waits for that process's Hello (which may come only after another
    engine it starts has loaded), up to ``LOAD_FAILURE_WAIT`` s or until the
    process is gone, so that the reason reaches it rather than only an exit
    status; ``tserve engine`` waits 2 s for peers."""
    if lifeline.standalone:
        _report_death(sock, outbox, reason, wait_for_peers=True)
    else:
        _report_death(sock, outbox, reason, wait_for_peers=True, until=lifeline)


def _report_death(
    sock: zmq.Socket[bytes],
    outbox: Outbox,
    reason: str,
    *,
    wait_for_peers: bool,
    until: Lifeline | None = None,
) -> None:
    """Send EngineDead to every peer, including any whose Hello is still queued.

    ``wait_for_peers``: Hellos are awaited for 2 s, or with ``until``, until
    the first peer's, or ``until`` says stop, or ``LOAD_FAILURE_WAIT`` s.
    A peer at its HWM is retried for up to ``DEAD_SEND_TIMEOUT`` seconds.
    """
    wait = 0.0 if not wait_for_peers else 2.0 if until is None else LOAD_FAILURE_WAIT
    deadline = time.monotonic() + wait
    while True:
        remaining = deadline - time.monotonic()
        if until is not None and (outbox.peers or until.stop_reason() is not None):
            remaining = 0.0  # what is queued already, no more waiting
        # In slices, so that ``until`` is asked again at least every half second.
        if not sock.poll(max(0, int(min(remaining, 0.5) * 1000)), zmq.POLLIN):
            if remaining > 0.5:
                continue
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
