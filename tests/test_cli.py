"""``python -m tserve``'s command line: the commands its help lists."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tserve.__main__ import _server_config, main, parse_args
from tserve._options import REASONING_PARSERS
from tserve.web import AppConfig
from tserve.web._reasoning import PARSER_NAMES


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "{serve,engine,keys,bench}" in out
    assert "serve a model" in out and "benchmark a running server" in out
    assert "serve one engine at an address" in out and "CURVE keys" in out


def test_engine_and_serve_share_the_engine_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """One declaration, the same names and environment variables for both."""
    monkeypatch.setenv("TSERVE_THREADS", "4")
    engine = parse_args(["engine", "default", "--bind", "tcp://0.0.0.0:5555", "--dtype", "bf16"])
    serve = parse_args(["serve", "--dtype", "bf16"])
    assert (engine.threads, engine.dtype) == (serve.threads, serve.dtype) == (4, "bf16")
    shared = {"max_num_seqs", "kv_cache_tokens", "no_prefix_caching", "cache_dir", "keys"}
    assert shared <= vars(engine).keys() & vars(serve).keys()
    assert engine.heartbeat_interval == serve.heartbeat_interval == 0.5


ENGINE_GROUPS = {
    "engine: model": ["--max-model-len", "--model-impl", "--dequantize", "--cache-dir"],
    "engine: batching": ["--max-num-seqs", "--max-num-batched-tokens", "--max-decode-slowdown"],
    "engine: KV cache": [
        "--kv-cache-tokens",
        "--kv-cache-memory-bytes",
        "--kv-cache-dtype",
        "--no-prefix-caching",
    ],
    "engine: device": ["--device", "--dtype", "--threads", "--gguf-activations"],
    "engine: sampling defaults": ["--generation-config"],
    "engine: structured outputs": ["--grammar-compile-timeout", "--grammar-mask-budget"],
    "engine: advanced (diagnostics and overrides of automatic choices)": [
        "--gguf-runner",
        "--cpu-gemm",
        "--engine-kind",
        "--echo-step-time",
    ],
}


@pytest.mark.parametrize("command", ["serve", "engine"])
def test_help_groups_the_engine_options_by_concern(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each engine option is listed under its concern's heading, advanced ones last."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    headings = [line[:-1] for line in out.splitlines() if line.startswith("engine: ")]
    assert headings == list(ENGINE_GROUPS)
    for heading, flags in ENGINE_GROUPS.items():
        section = out.split(f"\n{heading}:\n", 1)[1].split("\n\n", 1)[0]
        listed = [line.split()[0] for line in section.splitlines() if line.startswith("  --")]
        assert listed == flags, heading


def test_help_does_not_import_the_benchmark() -> None:
    code = (
        "import sys\n"
        "from tserve.__main__ import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('tserve.bench' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_bench_help_is_the_benchmarks_own(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])
    assert info.value.code == 0
    assert "--base-url" in capsys.readouterr().out


def test_cpu_gemm_from_the_flag_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_args([]).cpu_gemm == "auto"
    assert parse_args(["serve", "--cpu-gemm", "onednn"]).cpu_gemm == "onednn"
    monkeypatch.setenv("TSERVE_CPU_GEMM", "blas")
    assert parse_args([]).cpu_gemm == "blas"
    with pytest.raises(SystemExit) as info:
        parse_args(["--cpu-gemm", "fastest"])
    assert info.value.code == 2


def test_prefix_caching_is_on_unless_the_flag_or_the_environment_says_no(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert parse_args([]).no_prefix_caching is False
    assert parse_args(["serve", "--no-prefix-caching"]).no_prefix_caching is True
    monkeypatch.setenv("TSERVE_NO_PREFIX_CACHING", "1")
    assert parse_args([]).no_prefix_caching is True


def test_dequantize_from_the_flag_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_args([]).dequantize is False
    assert parse_args(["serve", "--dequantize"]).dequantize is True
    monkeypatch.setenv("TSERVE_DEQUANTIZE", "1")
    assert parse_args([]).dequantize is True


def test_gguf_activations_from_the_flag_or_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert parse_args([]).gguf_activations == "int8"
    assert parse_args(["serve", "--gguf-activations", "fp32"]).gguf_activations == "fp32"
    monkeypatch.setenv("TSERVE_GGUF_ACTIVATIONS", "fp32")
    assert parse_args([]).gguf_activations == "fp32"
    with pytest.raises(SystemExit):
        parse_args(["serve", "--gguf-activations", "int4"])
    assert "--gguf-activations" in capsys.readouterr().err


def test_model_impl_from_the_flag_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_args([]).model_impl == "auto"
    assert parse_args(["serve", "--model-impl", "hf"]).model_impl == "hf"
    monkeypatch.setenv("TSERVE_MODEL_IMPL", "hf")
    assert parse_args([]).model_impl == "hf"
    with pytest.raises(SystemExit) as info:
        parse_args(["--model-impl", "vllm"])
    assert info.value.code == 2


def test_metrics_port_from_the_flag_or_the_environment_and_apart_from_the_port(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert parse_args([]).metrics_port is None
    monkeypatch.setenv("TSERVE_METRICS_PORT", "9090")
    args = parse_args([])
    assert args.metrics_port == 9090
    assert _server_config(args).publish_stats  # every API process writes its stats file
    assert not _server_config(parse_args(["--metrics-port", "0"])).reuse_port
    for bad in (["--port", "9090"], ["--metrics-port", "70000"]):
        with pytest.raises(SystemExit) as info:
            _server_config(parse_args(bad))
        assert info.value.code == 2
        assert "--metrics-port" in capsys.readouterr().err


def test_reasoning_parser_from_the_flag_or_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert REASONING_PARSERS == PARSER_NAMES
    assert _server_config(parse_args([])).app.reasoning_parser == "auto"
    assert _server_config(parse_args(["--reasoning-parser", "qwen3"])).app.reasoning_parser == (
        "qwen3"
    )
    monkeypatch.setenv("TSERVE_REASONING_PARSER", "deepseek_r1")
    assert _server_config(parse_args([])).app.reasoning_parser == "deepseek_r1"
    monkeypatch.setenv("TSERVE_REASONING_PARSER", "o1")
    with pytest.raises(SystemExit) as info:
        _server_config(parse_args([]))
    assert info.value.code == 2
    assert "--reasoning-parser" in capsys.readouterr().err
    with pytest.raises(ValueError, match="reasoning_parser"):
        AppConfig(reasoning_parser="o1")


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--reasoning-parser", "o1"], "--reasoning-parser"),
        (["--api-processes", "0"], "--api-processes"),
        (["--stall-timeout", "0"], "--stall-timeout"),
        (["--api-key", " "], "--api-key"),
        (["--no-such-flag"], "--no-such-flag"),
    ],
)
def test_bad_arguments_exit_2_naming_the_flag(argv: list[str], named: str) -> None:
    """As the module says: exit status 2 for bad arguments, before anything starts."""
    done = subprocess.run(
        [sys.executable, "-m", "tserve", *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert named in done.stderr


def test_kv_cache_dtype_and_byte_budget_from_the_flags_or_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tserve._options import engine_options
    from tserve.protocol import EngineConfig

    default = EngineConfig(**engine_options(parse_args([])))
    assert (default.kv_cache_dtype, default.kv_cache_memory_bytes) == ("auto", None)
    args = parse_args(["serve", "--kv-cache-dtype", "bf16", "--kv-cache-memory-bytes", "1000000"])
    config = EngineConfig(**engine_options(args))
    assert (config.kv_cache_dtype, config.kv_cache_memory_bytes) == ("bf16", 1_000_000)
    monkeypatch.setenv("TSERVE_KV_CACHE_DTYPE", "fp32")
    assert (
        parse_args(["engine", "default", "--bind", "tcp://0.0.0.0:5555"]).kv_cache_dtype == "fp32"
    )
    with pytest.raises(SystemExit) as info:
        parse_args(["--kv-cache-dtype", "fp8"])
    assert info.value.code == 2


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["a", "b", "--api-processes", "2"], "--api-processes"),
        (["a", "b", "--metrics-port", "0"], "--metrics-port"),
        (["a", "--engine", "tcp://127.0.0.1:5555", "--insecure"], "--engine"),
        (["--models-dir", ".", "--engine", "tcp://127.0.0.1:5555", "--insecure"], "--engine"),
        (["a", "b", "--served-model-name", "x"], "--served-model-name"),
        (["x=a", "x=b"], "'x'"),
        (["a", "b", "--preload", "c"], "--preload c"),
        (["a", "--preload", "c"], "--preload c"),
        (["a", "b", "--model-load-timeout", "0"], "--model-load-timeout"),
        (["--models-dir", "/no/such/dir"], "--models-dir"),
        (["a", "b", "--keep-alive", "5 min"], "--keep-alive"),
        (["a", "b", "--keep-alive", "forever"], "--keep-alive"),
        (["a", "b", "--models-memory", "8Q"], "--models-memory"),
        (["a", "b", "--models-memory", "0"], "--models-memory"),
        (["a", "b", "--models-memory=-1G"], "--models-memory"),
        (["a", "b", "--model-fit-timeout", "0"], "--model-fit-timeout"),
        (["a", "--keep-alive", "1m"], "--keep-alive"),
        (["a", "--models-memory", "8G"], "--models-memory"),
        (
            ["tcp", "--engine", "tcp://127.0.0.1:5555", "--insecure", "--keep-alive", "0"],
            "--keep-alive",
        ),
    ],
)
def test_what_several_models_cannot_serve_is_refused_in_one_line(
    argv: list[str], named: str
) -> None:
    """Several models with one API process only and no remote engine; names that
    clash or are unknown: exit 2 with one line naming the flag, nothing started."""
    done = subprocess.run(
        [sys.executable, "-m", "tserve", "serve", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], done.stderr


def test_several_models_are_named_by_alias_flag_or_file(tmp_path: Path) -> None:
    """NAME=MODEL, then --served-model-name (one per MODEL, in order), then the
    file or directory name; --models-dir adds its folder's models after them."""
    from tserve.__main__ import _plan

    (tmp_path / "c.gguf").write_bytes(b"")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("")
    plan = _plan(parse_args(["serve", "x=m/a.gguf", "m/b", "--models-dir", str(tmp_path)]))
    assert plan.several and [s.name for s in plan.models] == ["x", "b"]
    assert plan.models_dir is not None
    assert [s.name for s in plan.models_dir.specs({"x", "b"})] == ["c", "d"]
    assert plan.models[0].embedding_model is not None and plan.models[1].embedding_model is None
    named = _plan(parse_args(["serve", "m/a.gguf", "m/b", "--served-model-name", "p,q"]))
    assert [s.name for s in named.models] == ["p", "q"]
    one = _plan(parse_args(["serve", "tiny=m/a.gguf"]))
    assert not one.several and one.server.app.served_model_names == ("tiny",)
    assert one.models[0].config.model == "m/a.gguf"


def test_residency_flags_reach_the_plan_of_several_models() -> None:
    """--keep-alive in Ollama's forms, --models-memory with binary and decimal
    suffixes, --model-fit-timeout; unset, the registry's defaults."""
    from tserve.__main__ import _plan
    from tserve.nursery._keeper import DEFAULT_FIT_TIMEOUT
    from tserve.nursery._residency import DEFAULT_KEEP_ALIVE

    plain = _plan(parse_args(["serve", "a", "b"]))
    assert (plain.keep_alive, plain.memory_budget, plain.fit_timeout) == (
        DEFAULT_KEEP_ALIVE,
        None,
        DEFAULT_FIT_TIMEOUT,
    )
    for keep, memory, seconds in [
        ("1h30m", "1.5GiB", 90 * 60.0),
        ("-1", "8G", -1.0),
        ("0", "2GB", 0.0),
        ("45", "4096", 45.0),
    ]:
        argv = ["serve", "a", "b", "--keep-alive", keep, "--models-memory", memory]
        plan = _plan(parse_args([*argv, "--model-fit-timeout", "2.5"]))
        assert plan.keep_alive == seconds and plan.fit_timeout == 2.5
    sizes = {
        "1.5GiB": 3 * 2**29,
        "8G": 8 * 2**30,
        "512M": 512 * 2**20,
        "2GB": 2 * 10**9,
        "4096": 4096,
        "1k": 1024,
    }
    for text, size in sizes.items():
        plan = _plan(parse_args(["serve", "a", "b", "--models-memory", text]))
        assert plan.memory_budget == size, text
