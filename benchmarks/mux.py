"""Token deltas per second through the real mux, against raw pyzmq as the ceiling.

Run: ``python -m benchmarks.mux [--readers 1000] [--steps 3000] [--backend trio]
[--no-gc-freeze]``

An engine-side process (blocking pyzmq, a ROUTER as in the engine) answers
Hello, waits for one AddRequest per reader, then sends ``--steps`` StepOutputs
frames, each holding one one-token RequestOutput for every reader (the last
with a finish reason). It does this twice, over the same ipc:// transport:

* mux: the API side is the real :class:`tserve.mux.Mux`, with one task per
  reader draining its Mailbox (``async for``);
* raw: the API side is a blocking pyzmq DEALER that receives and decodes the
  same frames with the same protocol and only counts the deltas.

Both clocks run from sending the adds to the last delta read. Runs alternate
(raw, mux, raw, mux, ...) in this one process, so both see the same heap, and
each side reports its best run. Prints both rates and mux/raw, and writes a
JSON result under ``results/``.

CPython's cyclic GC is a large part of the cost on both sides: decoding a
step allocates one tracked list per delta, which triggers collections, and
full collections walk every live object (with a thousand reader tasks, the
mux side has many). By default each run first does ``gc.collect()`` and
``gc.freeze()`` once its side is connected, as the API process does after
start-up (``open_llm(freeze_gc=True)``), and ``gc.unfreeze()`` after it; the
readers' tasks are created after the freeze, as requests are in a server.
``--no-gc-freeze`` measures without it.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import anyio
import zmq

from benchmarks._results import REPO_ROOT, result_stem, write_json
from tserve import protocol as p
from tserve._gc import serving_gc
from tserve.mux import Mailbox, Mux


def _request_ids(readers: int) -> list[str]:
    return [f"req-{i}" for i in range(readers)]


def _adds(readers: int, steps: int) -> p.EngineInput:
    params = p.SamplingParams(max_tokens=steps)
    return p.EngineInput([p.AddRequest(rid, [1], params) for rid in _request_ids(readers)])


# -- the engine side -----------------------------------------------------------


def serve_engine(address: str, readers: int, steps: int) -> None:
    """Answer one peer: Ready, wait for its adds, then stream every step."""
    ids = _request_ids(readers)
    stats = p.EngineStats(running=readers)
    middle = p.encode(p.StepOutputs([p.RequestOutput(rid, [7]) for rid in ids], stats))
    last_outputs = [p.RequestOutput(rid, [7], p.FinishReason.LENGTH) for rid in ids]
    last = p.encode(p.StepOutputs(last_outputs, stats))
    ready = p.EngineReady(
        model="bench",
        model_path="",
        max_model_len=steps + 1,
        vocab_size=8,
        eos_token_ids=[],
        max_num_seqs=readers,
        kv_tokens_total=readers * (steps + 1),
        device="cpu",
        pid=os.getpid(),
    )
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    socket.setsockopt(zmq.LINGER, 5000)
    socket.bind(address)
    peer, frame = socket.recv_multipart()
    assert isinstance(p.decode(frame), p.Hello)
    socket.send_multipart([peer, p.encode(ready)])
    added = 0
    while added < readers:
        peer, frame = socket.recv_multipart()
        message = p.decode(frame)
        if isinstance(message, p.EngineInput):
            added += len(message.adds)
    for _ in range(steps - 1):
        socket.send_multipart([peer, middle])  # blocks at the HWM: the API side sets the pace
    socket.send_multipart([peer, last])
    socket.close()
    context.term()


def _start_engine(address: str, readers: int, steps: int) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "benchmarks.mux", "--engine", address]
    argv += ["--readers", str(readers), "--steps", str(steps)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen(argv, cwd=REPO_ROOT, env=env)


# -- the API side --------------------------------------------------------------


def run_raw(address: str, readers: int, steps: int, freeze: bool) -> float:
    """Blocking pyzmq: receive and decode every frame. Returns deltas/s."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    socket.send(p.encode(p.Hello(os.getpid())))
    assert isinstance(p.decode(socket.recv()), p.EngineReady)
    adds = p.encode(_adds(readers, steps))
    deltas = 0
    finished = 0
    with _gc_frozen(freeze):
        start = time.perf_counter()
        socket.send(adds)
        while finished < readers:
            step = p.decode(socket.recv())
            assert isinstance(step, p.StepOutputs)
            deltas += len(step.outputs)
            finished += sum(output.finish_reason is not None for output in step.outputs)
        elapsed = time.perf_counter() - start
    socket.close()
    context.term()
    assert deltas == readers * steps
    return deltas / elapsed


async def run_mux(address: str, readers: int, steps: int, freeze: bool) -> float:
    """The real mux with one reader task per request. Returns deltas/s."""
    received = 0

    async def read(mailbox: Mailbox) -> None:
        nonlocal received
        tokens = 0
        async for output in mailbox:
            tokens += len(output.token_ids)
        received += tokens

    with anyio.fail_after(600):
        async with anyio.create_task_group() as tg:
            mux = Mux()
            await tg.start(mux.run, address)
            with _gc_frozen(freeze):
                start = time.perf_counter()
                async with anyio.create_task_group() as reading:
                    for add in _adds(readers, steps).adds:
                        mailbox = mux.open_mailbox(add.request_id, steps)
                        mux.submit(add)
                        reading.start_soon(read, mailbox)
                elapsed = time.perf_counter() - start
            tg.cancel_scope.cancel()
    assert received == readers * steps, (received, readers * steps)
    return received / elapsed


@contextmanager
def _gc_frozen(freeze: bool) -> Iterator[None]:
    """With ``freeze``: the GC settings the API process uses once it has
    started (``open_llm(freeze_gc=True)``: freeze, larger gen-0 threshold)."""
    if not freeze:
        yield
        return
    with serving_gc():
        yield


def _measure(mode: str, readers: int, steps: int, backend: str, freeze: bool) -> float:
    directory = tempfile.mkdtemp(prefix="tserve-bench-", dir="/tmp")
    address = f"ipc://{directory}/engine.sock"
    engine = _start_engine(address, readers, steps)
    try:
        if mode == "raw":
            return run_raw(address, readers, steps, freeze)
        return anyio.run(run_mux, address, readers, steps, freeze, backend=backend)
    finally:
        engine.wait(timeout=60)
        shutil.rmtree(directory, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mux", description=__doc__)
    parser.add_argument("--readers", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--backend", choices=["trio", "asyncio"], default="trio")
    parser.add_argument("--repeat", type=int, default=3, help="best of N runs each")
    parser.add_argument(
        "--gc-freeze",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="gc.freeze() once connected, as the API process does (default: on)",
    )
    parser.add_argument("--engine", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        serve_engine(args.engine, args.readers, args.steps)
        return 0
    raws: list[float] = []
    muxes: list[float] = []
    for _ in range(args.repeat):
        raws.append(_measure("raw", args.readers, args.steps, args.backend, args.gc_freeze))
        muxes.append(_measure("mux", args.readers, args.steps, args.backend, args.gc_freeze))
    raw, mux = max(raws), max(muxes)
    ratio = mux / raw
    print(f"deltas: {args.readers} readers x {args.steps} steps, one token each")
    print(f"gc.freeze(): {'yes' if args.gc_freeze else 'no'}")
    print(f"raw pyzmq (ceiling): {raw:,.0f} deltas/s")
    print(f"mux ({args.backend}):         {mux:,.0f} deltas/s")
    print(f"mux / raw:           {ratio:.2f}")
    result = {
        "benchmark": "mux",
        "readers": args.readers,
        "steps": args.steps,
        "backend": args.backend,
        "repeat": args.repeat,
        "gc_freeze": args.gc_freeze,
        "raw_runs": raws,
        "mux_runs": muxes,
        "raw_deltas_per_s": raw,
        "mux_deltas_per_s": mux,
        "ratio": ratio,
        "python": platform.python_version(),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    path = write_json(result_stem("mux"), result)
    print(f"wrote {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
