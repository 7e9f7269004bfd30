"""A fake engine process that speaks the real wire (blocking pyzmq; no torch, no trio).

Run it as ``python -m tests.mux.fake_engine ADDRESS [options]`` or, from a
test, with :func:`run_fake_engine`. It binds a ROUTER with ROUTER_MANDATORY at
ADDRESS and then, like the real engine:

* answers ``Hello`` with ``EngineReady`` (and an empty ``TokenizerBundle``
  when the Hello asks for one);
* answers each ``AddRequest`` with exactly ``params.max_tokens`` tokens --
  token i is ``prompt_token_ids[0] + i`` (``i`` for an empty prompt) -- spread
  over steps of ``--tokens-per-step`` tokens, the last output carrying
  ``FinishReason.LENGTH``;
* sends ONE ``StepOutputs`` frame per peer per step;
* honours aborts (the request ends with ``FinishReason.ABORT`` in the next
  step; adds in a frame apply before its aborts; unknown ids are ignored);
* never blocks on a slow peer: when a peer is at its high-water mark its
  outputs are kept and sent, coalesced, with a later step;
* sends ``Heartbeat`` while idle, exits 0 on ``Shutdown`` and exits when its
  parent process is gone.

Faults for tests: ``--die-after-steps K`` exits 1 after K steps (first sending
``EngineDead`` with ``--send-dead``); ``--hang-after-steps K`` goes silent
after K steps but stays alive; ``--ghost-deltas`` adds one delta per step for
a request id nobody has.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from tserve import protocol as p

_REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class _Request:
    peer: bytes
    request_id: str
    first_token: int
    max_tokens: int
    sent: int = 0
    aborted: bool = False


@dataclass
class _Options:
    tokens_per_step: int = 1
    step_delay: float = 0.0
    heartbeat_interval: float = 0.1
    die_after_steps: int | None = None
    send_dead: bool = False
    hang_after_steps: int | None = None
    ghost_deltas: bool = False


@dataclass
class FakeEngine:
    """The engine's state: peers, running requests, per-peer unsent outputs."""

    socket: zmq.Socket[bytes]
    options: _Options
    peers: set[bytes] = field(default_factory=set)
    running: dict[str, _Request] = field(default_factory=dict)
    # Outputs a peer could not take yet (it was at its HWM). Bound: every
    # token of every running request once, plus one final output each.
    backlog: dict[bytes, list[p.RequestOutput]] = field(default_factory=dict)
    steps: int = 0
    aborts_received: int = 0
    parent_pid: int = 0  # exit when our parent is no longer this process

    def serve(self, parent_pid: int) -> int:
        """The loop: 1 receive inputs, 2 step, 3 send outputs (or a heartbeat)."""
        self.parent_pid = parent_pid
        last_sent = time.monotonic()
        while os.getppid() == parent_pid:
            busy = bool(self.running or any(self.backlog.values()))
            timeout_ms = 0 if busy else int(self.options.heartbeat_interval * 1000)
            if self.socket.poll(timeout_ms, zmq.POLLIN) and self._receive_inputs():
                return 0
            if self.running or any(self.backlog.values()):
                self._step()
                last_sent = time.monotonic()
                code = self._fault()
                if code is not None:
                    return code
                if self.options.step_delay:
                    time.sleep(self.options.step_delay)
            elif time.monotonic() - last_sent >= self.options.heartbeat_interval:
                for peer in list(self.peers):
                    self._send(peer, p.Heartbeat(self._stats()))
                last_sent = time.monotonic()
        return 0

    def _receive_inputs(self) -> bool:
        """Apply every input frame waiting; True when told to shut down."""
        while True:
            try:
                peer, frame = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            message = p.decode(frame)
            if isinstance(message, p.Hello):
                self.peers.add(peer)
                self._send(peer, self._ready())
                if message.tokenizer:
                    self._send(peer, p.TokenizerBundle({}))
            elif isinstance(message, p.EngineInput):
                for add in message.adds:
                    first = add.prompt_token_ids[0] if add.prompt_token_ids else 0
                    max_tokens = add.params.max_tokens
                    self.running[add.request_id] = _Request(peer, add.request_id, first, max_tokens)
                for request_id in message.aborts:
                    self.aborts_received += 1
                    if request_id in self.running:
                        self.running[request_id].aborted = True
            elif isinstance(message, p.Shutdown):
                return True

    def _step(self) -> None:
        self.steps += 1
        outputs: dict[bytes, list[p.RequestOutput]] = {}
        per_step = self.options.tokens_per_step
        for request in list(self.running.values()):
            if request.aborted:
                output = p.RequestOutput(request.request_id, [], p.FinishReason.ABORT)
            else:
                count = min(per_step, request.max_tokens - request.sent)
                start = request.first_token + request.sent
                request.sent += count
                finish = p.FinishReason.LENGTH if request.sent == request.max_tokens else None
                tokens = list(range(start, start + count))
                output = p.RequestOutput(request.request_id, tokens, finish)
            if output.finish_reason is not None:
                del self.running[request.request_id]
            outputs.setdefault(request.peer, []).append(output)
        if self.options.ghost_deltas:
            for peer in self.peers:
                ghost = p.RequestOutput(f"ghost-{self.steps}", [0])
                outputs.setdefault(peer, []).append(ghost)
        for peer in set(outputs) | set(self.backlog):
            pending = self.backlog.pop(peer, []) + outputs.get(peer, [])
            if pending and not self._send(peer, p.StepOutputs(pending, self._stats())):
                self.backlog[peer] = pending  # coalesced into the next step's frame

    def _fault(self) -> int | None:
        options = self.options
        if options.die_after_steps is not None and self.steps >= options.die_after_steps:
            if options.send_dead:
                for peer in self.peers:
                    self._send(peer, p.EngineDead("fake engine died on purpose"))
            return 1
        if options.hang_after_steps is not None and self.steps >= options.hang_after_steps:
            while os.getppid() == self.parent_pid:
                time.sleep(0.05)
            return 0
        return None

    def _send(self, peer: bytes, message: p.Message) -> bool:
        """Send without blocking; False when the peer is at its HWM."""
        try:
            self.socket.send_multipart([peer, p.encode(message)], zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._forget(peer)  # the peer is gone
        return True

    def _forget(self, peer: bytes) -> None:
        self.peers.discard(peer)
        self.backlog.pop(peer, None)
        for request_id in [r.request_id for r in self.running.values() if r.peer == peer]:
            del self.running[request_id]

    def _stats(self) -> p.EngineStats:
        return p.EngineStats(
            running=len(self.running), steps=self.steps, aborts_received=self.aborts_received
        )

    def _ready(self) -> p.EngineReady:
        return p.EngineReady(
            model="fake",
            model_path="",
            max_model_len=1 << 20,
            vocab_size=1 << 30,
            eos_token_ids=[],
            max_num_seqs=1 << 20,
            kv_tokens_total=1 << 30,
            device="cpu",
            pid=os.getpid(),
        )


@contextmanager
def run_fake_engine(
    address: str,
    *,
    tokens_per_step: int = 1,
    step_delay: float = 0.0,
    heartbeat_interval: float = 0.1,
    die_after_steps: int | None = None,
    send_dead: bool = False,
    hang_after_steps: int | None = None,
    ghost_deltas: bool = False,
) -> Iterator[subprocess.Popen[bytes]]:
    """Start a fake engine process with these options for the block; kill it
    (if still alive) after."""
    argv = [sys.executable, "-m", "tests.mux.fake_engine", address]
    argv += ["--tokens-per-step", str(tokens_per_step), "--step-delay", str(step_delay)]
    argv += ["--heartbeat-interval", str(heartbeat_interval)]
    if die_after_steps is not None:
        argv += ["--die-after-steps", str(die_after_steps)]
    if send_dead:
        argv.append("--send-dead")
    if hang_after_steps is not None:
        argv += ["--hang-after-steps", str(hang_after_steps)]
    if ghost_deltas:
        argv.append("--ghost-deltas")
    env = {**os.environ, "PYTHONPATH": str(_REPO_ROOT)}
    process = subprocess.Popen(argv, cwd=_REPO_ROOT, env=env)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mux.fake_engine")
    parser.add_argument("address")
    parser.add_argument("--tokens-per-step", type=int, default=1)
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--heartbeat-interval", type=float, default=0.1)
    parser.add_argument("--die-after-steps", type=int)
    parser.add_argument("--send-dead", action="store_true")
    parser.add_argument("--hang-after-steps", type=int)
    parser.add_argument("--ghost-deltas", action="store_true")
    parser.add_argument("--hwm", type=int, default=1000)
    args = parser.parse_args(argv)
    options = _Options(
        tokens_per_step=args.tokens_per_step,
        step_delay=args.step_delay,
        heartbeat_interval=args.heartbeat_interval,
        die_after_steps=args.die_after_steps,
        send_dead=args.send_dead,
        hang_after_steps=args.hang_after_steps,
        ghost_deltas=args.ghost_deltas,
    )
    parent_pid = os.getppid()
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    socket.setsockopt(zmq.SNDHWM, args.hwm)
    socket.setsockopt(zmq.RCVHWM, args.hwm)
    socket.setsockopt(zmq.LINGER, 1000)
    socket.bind(args.address)
    try:
        return FakeEngine(socket, options).serve(parent_pid)
    finally:
        socket.close()
        context.term()


if __name__ == "__main__":
    sys.exit(main())
