"""Short live runs: against the trivial echo server, and against ``python -m tserve serve``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest

from tserve.__main__ import main as tserve_main
from tserve.bench import main
from tserve.bench._client import RunConfig, run_benchmark
from tserve.bench._datasets import BenchRequest
from tserve.bench._metrics import summarize
from tserve.bench.echo_server import serve


async def _echo_run(config: RunConfig, requests: list[BenchRequest]) -> tuple[int, ...]:
    async with anyio.create_task_group() as tg:
        url = await tg.start(serve)
        run = await run_benchmark(RunConfig(**{**config.__dict__, "base_url": url}), "e", requests)
        tg.cancel_scope.cancel()
    s = summarize(run.results, run.duration)
    return s.completed, s.failed, s.output_tokens, s.peak_concurrency


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_echo_server_run(endpoint: str, backend: str) -> None:
    config = RunConfig(endpoint=endpoint, max_concurrency=8, extra_body={"echo_itl": 0.001})
    requests = [BenchRequest("x", 1, 20)] * 50
    got = anyio.run(_echo_run, config, requests, backend=backend)
    assert got == (50, 0, 1000, 8)


def test_reused_connection_closed_by_the_server_is_retried() -> None:
    config = RunConfig(max_concurrency=1, extra_body={"echo_close": True})
    got = anyio.run(_echo_run, config, [BenchRequest("x", 1, 3)] * 10, backend="trio")
    assert got == (10, 0, 30, 1)


def test_duration_cuts_the_run_and_reports_unfinished() -> None:
    config = RunConfig(duration=0.3, extra_body={"echo_itl": 0.05}, max_concurrency=4)

    async def go() -> dict[str, int]:
        async with anyio.create_task_group() as tg:
            url = await tg.start(serve)
            cfg = RunConfig(**{**config.__dict__, "base_url": url})
            run = await run_benchmark(cfg, "e", [BenchRequest("x", 1, 100)] * 10)
            tg.cancel_scope.cancel()
        return summarize(run.results, run.duration).errors

    # A request takes 100 x 0.05 s: uncut, all 10 would complete and none be unfinished.
    assert anyio.run(go, backend="trio") == {"unfinished": 4}  # only 4 ever started


def test_request_timeout_and_refused_connection() -> None:
    async def go(config: RunConfig) -> dict[str, int]:
        async with anyio.create_task_group() as tg:
            url = await tg.start(serve)
            if config.base_url == "refused":
                url = f"http://127.0.0.1:{_free_port()}"
            cfg = RunConfig(**{**config.__dict__, "base_url": url})
            run = await run_benchmark(cfg, "e", [BenchRequest("x", 1, 100)] * 3)
            tg.cancel_scope.cancel()
        return summarize(run.results, run.duration).errors

    slow = RunConfig(timeout=0.2, extra_body={"echo_itl": 0.05})
    assert anyio.run(go, slow, backend="trio") == {"timeout": 3}
    assert anyio.run(go, RunConfig(base_url="refused"), backend="trio") == {"connect_error": 3}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(
    command: list[str], ready: str, log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """A child process; waits until ``ready`` (a URL) answers 200 (a hang guard)."""
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{command} exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(ready, timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{command} did not start:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture
def echo_url(tmp_path: Path) -> Iterator[str]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "tserve.bench.echo_server", "--port", str(port)]
    proc = _start(command, f"{url}/health", tmp_path / "echo.log")
    yield url
    _stop(proc)


def test_cli_sweep_writes_json_and_png(echo_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    argv = [
        "--base-url", echo_url, "--tokenizer", str(tiny_model_dir),
        "--num-prompts", "12", "--max-concurrency", "1", "4",
        "--random-input-len", "16", "--random-output-len", "5", "--random-range-ratio", "0.5",
        "--result-dir", str(tmp_path), "--result-filename", "sweep", "--disable-tqdm",
        "--save-detailed",
    ]  # fmt: skip
    assert main(argv) == 0
    text = (tmp_path / "sweep.json").read_text()
    doc = json.loads(text, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert [r["max_concurrency"] for r in doc["runs"]] == [1, 4]
    assert all(r["summary"]["failed"] == 0 for r in doc["runs"])
    assert len(doc["runs"][0]["requests"]) == 12
    assert (tmp_path / "sweep.png").stat().st_size > 10_000


@pytest.mark.parametrize("name", ["missing", "model.gguf", "empty"])
def test_cli_unreadable_tokenizer_is_one_line(echo_url: str, tmp_path: Path, name: str) -> None:
    """A ``--tokenizer`` that is no tokenizer directory (a missing path, a file, a
    directory without one) ends the run with one line, not a traceback."""
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    (tmp_path / "empty").mkdir()
    source = tmp_path / name
    argv = ["--base-url", echo_url, "--tokenizer", str(source), "--num-prompts", "1"]
    with pytest.raises(SystemExit) as ended:
        main(argv)
    message = str(ended.value.code)
    assert message.startswith(f"--tokenizer {source}: ") and "\n" not in message


@pytest.fixture(scope="module")
def tserve_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "tserve", "serve", str(tiny_model_dir), "--port", str(port)]
    log = tmp_path_factory.mktemp("tserve") / "server.log"
    env = {**os.environ, "TSERVE_LOG_LEVEL": "warning"}
    proc = _start(command, f"{url}/health", log, env)
    yield url
    _stop(proc)


@pytest.mark.parametrize(
    "dataset",
    [
        ["--endpoint", "completions", "--dataset-name", "random", "--random-input-len", "32",
         "--random-output-len", "8", "--tokenizer", "TINY"],
        ["--endpoint", "chat", "--dataset-name", "sonnet", "--sonnet-input-len", "120",
         "--sonnet-prefix-len", "60", "--sonnet-output-len", "8"],  # the server's /tokenize
    ],
    ids=["completions-random", "chat-sonnet"],
)  # fmt: skip
def test_live_tserve_zero_errors(
    tserve_url: str, tiny_model_dir: Path, tmp_path: Path, dataset: list[str]
) -> None:
    argv = [
        "--base-url", tserve_url, "--num-prompts", "16", "--max-concurrency", "1", "8",
        "--ignore-eos", "--result-dir", str(tmp_path), "--result-filename", "live",
        "--disable-tqdm", "--timeout", "60",
        *(str(tiny_model_dir) if a == "TINY" else a for a in dataset),
    ]  # fmt: skip
    assert tserve_main(["bench", *argv]) == 0  # python -m tserve bench ...
    for run in json.loads((tmp_path / "live.json").read_text())["runs"]:
        s = run["summary"]
        assert (s["completed"], s["failed"], s["output_tokens"]) == (16, 0, 16 * 8)
        assert s["latency"]["ttft"]["count"] == 16
