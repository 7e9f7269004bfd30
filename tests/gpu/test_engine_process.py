"""A real engine process (``python -m tserve.gpu``, tiny model, CPU) driven over its socket.

The test side is a blocking pyzmq DEALER per simulated API process. Waits are
hang guards only (generous timeouts), never timing assertions. Each test
starts its own engine (about 6 s: importing torch and transformers).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from tests.guards import HANG_GUARD
from tserve import protocol as p
from tserve.gpu.engine._core import FORWARD_FAULT_ENV, STALL_FAULT_ENV

REPO_ROOT = Path(__file__).resolve().parents[2]


def _config(model_dir: Path, **overrides: Any) -> p.EngineConfig:
    settings: dict[str, Any] = {
        "model": str(model_dir),
        "device": "cpu",
        "dtype": "float32",
        "heartbeat_interval": 0.1,
    }
    settings.update(overrides)
    return p.EngineConfig(**settings)


def _engine_argv(address: str, config: p.EngineConfig, parent_pid: int | None) -> list[str]:
    """The engine's command line; without ``parent_pid`` it watches its real parent."""
    argv = [sys.executable, "-m", "tserve.gpu", address, msgspec.json.encode(config).decode()]
    if parent_pid is not None:
        argv += ["--parent-pid", str(parent_pid)]
    return [*argv, "--log-level", "WARNING"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TSERVE_TEST_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    env.update(extra)
    return env


@contextlib.contextmanager
def _engine(
    tmp_path: Path, config: p.EngineConfig, **env: str
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """An engine process that is ours; killed on the way out if still running."""
    address = f"ipc://{tmp_path}/engine.sock"
    argv = _engine_argv(address, config, os.getpid())
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=_env(**env), stdin=subprocess.DEVNULL)
    try:
        yield proc, address
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(HANG_GUARD)


class _Peer:
    """One simulated API process: a blocking DEALER."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], address: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, message: p.Message) -> None:
        self.sock.send(p.encode(message))

    def recv(self, timeout: float = HANG_GUARD) -> p.Message:
        if not self.sock.poll(int(timeout * 1000), zmq.POLLIN):
            raise AssertionError(f"nothing from the engine in {timeout} s")
        return p.decode(self.sock.recv())

    def hello(self) -> p.EngineReady:
        self.send(p.Hello(os.getpid()))
        ready = self.recv()
        assert isinstance(ready, p.EngineReady), ready
        return ready

    def stats_until(self, done: Callable[[p.EngineStats], bool]) -> p.EngineStats:
        """Read frames until one carries stats for which ``done`` holds."""
        deadline = time.monotonic() + HANG_GUARD
        while time.monotonic() < deadline:
            message = self.recv()
            if isinstance(message, p.StepOutputs | p.Heartbeat) and done(message.stats):
                return message.stats
        raise AssertionError("the engine never reached the expected state")


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _params(max_tokens: int) -> p.SamplingParams:
    return p.SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=max_tokens)


# ------------------------------------------------------------------------- 200 requests


def test_200_requests_half_aborted_then_shutdown(
    tmp_path: Path, tiny_model_dir: Path, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """Every request ends exactly once; unaborted ones get exactly max_tokens;
    afterwards nothing runs and the whole KV budget is free. Then Shutdown ends
    a live request with ABORT and the process exits 0."""
    kv_tokens = 8192
    config = _config(tiny_model_dir, max_num_seqs=48, kv_cache_tokens=kv_tokens)
    rng = random.Random(7)
    # Aborted requests ask for many tokens so the abort (sent after 1-20 of
    # them arrived) lands mid-generation; the others ask for 4-40.
    plan = {}
    for i in range(200):
        aborted = i % 2 == 1
        max_tokens = 300 if aborted else rng.randint(4, 40)
        abort_after = rng.randint(1, 20) if aborted else None
        prompt = [rng.randrange(512) for _ in range(rng.randint(1, 60))]
        plan[f"r{i}"] = (p.AddRequest(f"r{i}", prompt, _params(max_tokens)), abort_after)
    tokens: dict[str, int] = {rid: 0 for rid in plan}
    finish: dict[str, p.FinishReason] = {}
    aborts_sent: set[str] = set()

    with _engine(tmp_path, config) as (proc, address):
        api = _Peer(ctx, address)
        ready = api.hello()
        assert ready.kv_tokens_total == kv_tokens and ready.pid == proc.pid
        adds = [request for request, _ in plan.values()]
        api.send(p.EngineInput(adds=adds[:50]))
        waves = [adds[50:100], adds[100:150], adds[150:]]
        frames = 0
        while len(finish) < len(plan):
            message = api.recv()
            assert not isinstance(message, p.EngineDead), message
            if not isinstance(message, p.StepOutputs):
                continue
            aborts = []
            for out in message.outputs:
                assert out.request_id not in finish, f"{out.request_id}: output after the end"
                tokens[out.request_id] += len(out.token_ids)
                if out.finish_reason is not None:
                    finish[out.request_id] = out.finish_reason
                    continue
                abort_after = plan[out.request_id][1]
                due = abort_after is not None and tokens[out.request_id] >= abort_after
                if due and out.request_id not in aborts_sent:
                    aborts.append(out.request_id)
            aborts_sent.update(aborts)
            frames += 1
            more = waves.pop(0) if waves and frames % 8 == 0 else []
            if aborts or more:
                api.send(p.EngineInput(adds=more, aborts=aborts))

        for rid, (request, abort_after) in plan.items():
            if abort_after is None:
                assert finish[rid] is p.FinishReason.LENGTH, rid
                assert tokens[rid] == request.params.max_tokens, rid
            else:
                assert finish[rid] is p.FinishReason.ABORT, rid
                assert abort_after <= tokens[rid] < request.params.max_tokens, rid
        assert aborts_sent == {rid for rid, (_, after) in plan.items() if after is not None}
        stats = api.stats_until(lambda s: s.running == 0)
        assert stats == p.EngineStats(
            running=0,
            waiting=0,
            kv_tokens_used=0,
            kv_tokens_total=kv_tokens,
            steps=stats.steps,
            aborts_received=len(aborts_sent),
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
        )
        assert stats.prefix_cache_queries > 0  # the cache is on by default

        # Shutdown with a request still generating: it ends with ABORT, exit 0.
        api.send(p.EngineInput(adds=[p.AddRequest("last", [1, 2, 3], _params(400))]))
        first = api.recv()
        assert isinstance(first, p.StepOutputs) and first.outputs[0].request_id == "last"
        api.send(p.Shutdown("test over"))
        final: p.RequestOutput | None = None
        while final is None:
            message = api.recv()
            if isinstance(message, p.StepOutputs):
                final = next((o for o in message.outputs if o.finish_reason is not None), None)
        assert final.request_id == "last" and final.finish_reason is p.FinishReason.ABORT
        assert proc.wait(HANG_GUARD) == 0


# ------------------------------------------------------------------------- peers


def test_a_vanished_api_process_gets_its_requests_aborted(
    tmp_path: Path, tiny_model_dir: Path, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """Peer A disconnects mid-generation: the engine frees A's requests. Peer B,
    with nothing running, hears heartbeats all along."""
    with _engine(tmp_path, _config(tiny_model_dir)) as (proc, address):
        a, b = _Peer(ctx, address), _Peer(ctx, address)
        a.hello()
        b.hello()
        adds = [p.AddRequest(f"a{i}", [1, 2, 3, i], _params(500)) for i in range(4)]
        a.send(p.EngineInput(adds=adds))
        first = a.recv()
        assert isinstance(first, p.StepOutputs) and first.stats.running == 4
        # B has no outputs, yet hears from the engine while A's requests run.
        b.stats_until(lambda s: s.running == 4)
        a.sock.close()
        stats = b.stats_until(lambda s: s.running == 0 and s.kv_tokens_used == 0)
        assert stats.steps < 500, "A's requests were aborted, not run to the end"
        assert proc.poll() is None


# ------------------------------------------------------------------------- lifecycle


_LAUNCHER = """
import subprocess, sys, time
proc = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL)
print(proc.pid, flush=True)
while True:
    time.sleep(60)
"""


def _is_gone(pid: int) -> bool:
    """No such process, or only its zombie (its parent has not reaped it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


class _Orphanable:
    """An engine started by a launcher process of its own, so that a test can
    kill the engine's parent; ``orphan()`` does, and waits for the engine to go."""

    def __init__(self, address: str, config: p.EngineConfig, **env: str) -> None:
        self.launcher = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER, *_engine_argv(address, config, parent_pid=None)],
            cwd=REPO_ROOT,
            env=_env(**env),
            stdout=subprocess.PIPE,
        )
        assert self.launcher.stdout is not None
        self.engine_pid = int(self.launcher.stdout.readline())

    def orphan(self, what: str) -> None:
        self.launcher.send_signal(signal.SIGKILL)
        self.launcher.wait(HANG_GUARD)
        deadline = time.monotonic() + HANG_GUARD
        while not _is_gone(self.engine_pid):
            assert time.monotonic() < deadline, f"the engine outlived its parent {what}"
            time.sleep(0.05)

    def close(self) -> None:
        if self.launcher.poll() is None:
            self.launcher.kill()
            self.launcher.wait()
        if not _is_gone(self.engine_pid):
            os.kill(self.engine_pid, signal.SIGKILL)


def test_killing_the_parent_makes_the_engine_exit(
    tmp_path: Path, tiny_model_dir: Path, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    address = f"ipc://{tmp_path}/engine.sock"
    engine = _Orphanable(address, _config(tiny_model_dir))
    try:
        api = _Peer(ctx, address)
        assert api.hello().pid == engine.engine_pid
        api.send(p.EngineInput(adds=[p.AddRequest("r", [1, 2, 3], _params(500))]))
        assert isinstance(api.recv(), p.StepOutputs)
        engine.orphan("while generating")
    finally:
        engine.close()


def test_killing_the_parent_while_the_model_loads_stops_the_load(tmp_path: Path) -> None:
    """The first start with ``dequantize`` converts the default model to fp32 (many
    seconds); the API process dies meanwhile. The engine stops converting, leaves
    no half-written model behind, and exits, instead of finishing the load for nobody."""
    cache = tmp_path / "cache"
    # "default": SmolLM2's GGUF, which only the dequantize path converts.
    config = _config(Path("default"), cache_dir=str(cache), dequantize=True)
    engine = _Orphanable(f"ipc://{tmp_path}/engine.sock", config)
    try:
        deadline = time.monotonic() + HANG_GUARD
        while not list(cache.glob(".converting-*")):
            assert time.monotonic() < deadline, "the engine never started converting"
            assert not _is_gone(engine.engine_pid), "the engine died before converting"
            time.sleep(0.05)
        engine.orphan("while loading")
        assert list(cache.iterdir()) == [], "the conversion went on, or left its staging behind"
    finally:
        engine.close()


def test_a_fatal_forward_error_sends_engine_dead_and_exits_1(
    tmp_path: Path, tiny_model_dir: Path, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    with _engine(tmp_path, _config(tiny_model_dir), **{FORWARD_FAULT_ENV: "5"}) as (proc, address):
        a, b = _Peer(ctx, address), _Peer(ctx, address)
        a.hello()
        b.hello()
        a.send(p.EngineInput(adds=[p.AddRequest("r", [1, 2, 3], _params(50))]))
        for peer in (a, b):
            message = peer.recv()
            while not isinstance(message, p.EngineDead):
                assert isinstance(message, p.StepOutputs | p.Heartbeat), message
                message = peer.recv()
            assert "injected forward fault at step 5" in message.reason
        assert proc.wait(HANG_GUARD) == 1


def test_a_model_that_fails_to_load_sends_engine_dead(
    tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    config = _config(tmp_path / "no-such-model")
    with _engine(tmp_path, config) as (proc, address):
        api = _Peer(ctx, address)
        api.send(p.Hello(os.getpid()))
        message = api.recv()
        assert isinstance(message, p.EngineDead), message
        assert "failed to start" in message.reason and "no-such-model" in message.reason
        assert proc.wait(HANG_GUARD) == 1


# ------------------------------------------------------------------------- liveness in a step


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + HANG_GUARD
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.01)


def test_a_long_step_that_progresses_keeps_heartbeating(
    tmp_path: Path, tiny_model_dir: Path, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """Step 2 is held for as long as the test likes while it makes progress:
    only the pulse thread can speak meanwhile, and it does, every interval; then
    the step ends and the request runs to its end."""
    stall = f"2:progress:{tmp_path}"
    with _engine(tmp_path, _config(tiny_model_dir), **{STALL_FAULT_ENV: stall}) as (proc, address):
        api = _Peer(ctx, address)
        api.hello()
        api.send(p.EngineInput(adds=[p.AddRequest("r", [1, 2, 3], _params(8))]))
        _wait_for(tmp_path / "held")
        tokens: list[int] = []
        finish: list[p.FinishReason] = []

        def read() -> p.Message:
            message = api.recv()
            if isinstance(message, p.StepOutputs):
                for output in message.outputs:
                    tokens.extend(output.token_ids)
                    finish.extend([output.finish_reason] if output.finish_reason else [])
            return message

        while not isinstance(read(), p.Heartbeat):
            pass  # what step 1 sent before step 2 began
        for _ in range(5):  # 5 more intervals of the held step, each with its heartbeat
            assert isinstance(read(), p.Heartbeat)
        (tmp_path / "release").touch()
        while not finish:
            read()
        assert (finish, len(tokens)) == ([p.FinishReason.LENGTH], 8)
        assert proc.poll() is None


def test_a_wedged_step_falls_silent(
    tmp_path: Path, tiny_model_dir: Path, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """A step that never returns and never progresses sends nothing: the engine
    goes silent, which is what the API process takes for its death."""
    stall = f"2:wedge:{tmp_path}"
    with _engine(tmp_path, _config(tiny_model_dir), **{STALL_FAULT_ENV: stall}) as (proc, address):
        api = _Peer(ctx, address)
        api.hello()
        api.send(p.EngineInput(adds=[p.AddRequest("r", [1, 2, 3], _params(8))]))
        _wait_for(tmp_path / "held")
        # What step 1 queued may still arrive; after it, silence (20 intervals).
        while api.sock.poll(2000, zmq.POLLIN):
            message = p.decode(api.sock.recv())
            assert isinstance(message, p.StepOutputs | p.Heartbeat), message
        assert proc.poll() is None  # alive, and silent


def test_killing_the_parent_during_a_wedged_step_makes_the_engine_exit(
    tmp_path: Path, tiny_model_dir: Path, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """The main thread never comes back from its step; the pulse thread sees the
    API process gone and ends the engine: no orphan keeps the device."""
    address = f"ipc://{tmp_path}/engine.sock"
    engine = _Orphanable(
        address, _config(tiny_model_dir), **{STALL_FAULT_ENV: f"2:wedge:{tmp_path}"}
    )
    try:
        api = _Peer(ctx, address)
        assert api.hello().pid == engine.engine_pid
        api.send(p.EngineInput(adds=[p.AddRequest("r", [1, 2, 3], _params(50))]))
        _wait_for(tmp_path / "held")
        engine.orphan("in a wedged step")
    finally:
        engine.close()
