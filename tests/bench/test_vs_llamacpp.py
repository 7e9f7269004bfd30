"""The pieces of ``benchmarks/vs_llamacpp.py`` that run without llama.cpp: the
build's configure options, the bandwidth reader, the memory probes and the
weight bytes of a decode step."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks._bandwidth import read_bandwidth
from benchmarks._memory import engine_child, process_memory
from benchmarks.vs_llamacpp import cmake_options, decode_bytes
from tests.gpu.gguf_files import write_gguf


def test_the_build_turns_on_what_the_cpu_has_and_never_amx() -> None:
    avx2 = cmake_options({"avx", "avx2", "fma", "f16c", "bmi2", "amx_tile", "amx_int8"})
    assert "-DGGML_NATIVE=OFF" in avx2 and "-DGGML_AVX2=ON" in avx2 and "-DGGML_FMA=ON" in avx2
    assert "-DGGML_AVX512=OFF" in avx2 and "-DGGML_AVX512_VNNI=OFF" in avx2
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(avx2)
    assert not any(o.startswith("-DGGML_AMX") and o.endswith("ON") for o in avx2)
    avx512 = cmake_options({"avx", "avx2", "avx512f", "avx512_vnni"})
    assert "-DGGML_AVX512=ON" in avx512 and "-DGGML_AVX512_VNNI=ON" in avx512
    assert "-DGGML_AVX512_BF16=OFF" in avx512


def test_the_bandwidth_reader_reports_every_pass() -> None:
    found = read_bandwidth(mib=8, passes=3)
    assert found["mib"] == 8 and len(found["passes"]) == 3
    assert found["best_gb_s"] == max(found["passes"]) > 0
    assert found["sum"] == 3 * (8 << 20) // 8 * 0x0101010101010101 % 2**64


@pytest.fixture
def fake_engine() -> Iterator[subprocess.Popen[bytes]]:
    """A process with an engine-like child: ``python -c ... tserve.gpu``."""
    child = "import time; time.sleep(120)"
    parent = (
        f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', {child!r}, "
        "'tserve.gpu']); print(p.pid, flush=True); p.wait()"
    )
    process = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE)
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def test_the_engine_child_and_its_memory_are_found(
    fake_engine: subprocess.Popen[bytes],
) -> None:
    assert fake_engine.stdout is not None
    child = int(fake_engine.stdout.readline())
    try:
        assert engine_child(fake_engine.pid) == child
        with pytest.raises(LookupError):
            engine_child(child)  # it has none
        memory = process_memory(child)
        assert set(memory) == {"VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"}
        parts = memory["RssAnon"] + memory["RssFile"] + memory["RssShmem"]
        assert 0 < memory["VmRSS"] <= memory["VmHWM"]
        assert abs(memory["VmRSS"] - parts) < 1  # MiB, rounding
    finally:
        subprocess.run(["kill", str(child)], check=False)


@pytest.mark.parametrize("tied", [True, False])
def test_a_decode_step_reads_every_weight_once(
    smollm2_tiny_dir: Path, tiny_model_dir: Path, tmp_path: Path, tied: bool
) -> None:
    from gguf import GGUFReader

    source = smollm2_tiny_dir if tied else tiny_model_dir
    path = write_gguf(source, tmp_path / "gguf" / "tiny.gguf", "Q8_0")
    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    assert ("output.weight" not in tensors) == tied
    embedding = 0 if tied else tensors["token_embd.weight"]
    assert decode_bytes(path) == sum(tensors.values()) - embedding
