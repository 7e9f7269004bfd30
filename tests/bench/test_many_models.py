"""The pieces of ``benchmarks/many_models.py`` that run without a server: the
folder of model names and the sampler of a process's children's memory."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks._memory import children, process_memory
from benchmarks.many_models import MODELS, RssSampler, model_folder


def test_the_folder_holds_each_name_of_the_same_file(tmp_path: Path) -> None:
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF" + bytes(range(256)))
    paths = model_folder(source, tmp_path / "models")
    assert [p.name for p in paths] == [f"{name}.gguf" for name in MODELS]
    assert all(p.read_bytes() == source.read_bytes() for p in paths)
    assert model_folder(source, tmp_path / "models") == paths  # a second run replaces them


@pytest.fixture
def parent() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """A process with one sleeping child; its process and the child's pid."""
    child = "import time; time.sleep(120)"
    code = (
        f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', {child!r}]); "
        "print(p.pid, flush=True); p.wait()"
    )
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert process.stdout is not None
    pid = int(process.stdout.readline())
    try:
        yield process, pid
    finally:
        subprocess.run(["kill", str(pid)], check=False)
        process.kill()
        process.wait()


def test_the_sampler_sums_the_children_and_keeps_each_peak(
    parent: tuple[subprocess.Popen[bytes], int],
) -> None:
    process, child = parent
    assert list(children(process.pid)) == [child]
    sampler = RssSampler(process.pid).start()
    found = sampler.stop()  # its first sample comes before it looks for a stop
    assert found["samples"] >= 1
    assert found["peak_per_process_mib"] == [found["peak_total_mib"]]
    assert 0 < found["peak_total_mib"] <= process_memory(child)["VmHWM"]
    assert sampler.checkpoint() == {"peak_total_mib": 0, "peak_per_process_mib": [], "samples": 0}
