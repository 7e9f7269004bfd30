"""The engine's default thread count: one fewer than the physical cores a
process may use (its affinity, hyperthread siblings once, a cgroup's quota),
at least one. Host trees are built under ``tmp_path`` in sysfs's layout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tserve.__main__ import parse_args
from tserve.engine_config import (
    EngineConfig,
    cgroup_cpus,
    default_threads,
    host_threads,
    physical_cores,
)


def _topology(root: Path, cores: list[tuple[int, int]]) -> None:
    """CPU i of ``root``'s sysfs is (package, core) ``cores[i]``."""
    for cpu, (package, core) in enumerate(cores):
        topology = root / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{core}\n")


def _cgroup(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / "fs" / "cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_hyperthread_siblings_count_once(tmp_path: Path) -> None:
    # 4 cores of 2 threads each, siblings numbered apart as Linux does (cpu i, i + 4)
    _topology(tmp_path, [(0, c) for c in range(4)] * 2)
    assert physical_cores(set(range(8)), tmp_path) == 4
    assert physical_cores({0, 4}, tmp_path) == 1  # affinity to one core's two threads
    assert host_threads(set(range(8)), tmp_path) == 3


def test_cores_of_two_packages_are_apart(tmp_path: Path) -> None:
    _topology(tmp_path, [(0, 0), (0, 1), (1, 0), (1, 1)])
    assert physical_cores({0, 1, 2, 3}, tmp_path) == 4


def test_a_cpu_without_topology_is_a_core(tmp_path: Path) -> None:
    _topology(tmp_path, [(0, 0)])
    assert physical_cores({0, 1, 2}, tmp_path) == 3


@pytest.mark.parametrize(
    ("cores", "expected"), [(1, 1), (2, 1), (3, 2), (16, 15)], ids=lambda v: str(v)
)
def test_one_core_is_left_over(tmp_path: Path, cores: int, expected: int) -> None:
    _topology(tmp_path, [(0, c) for c in range(cores)])
    assert host_threads(set(range(cores)), tmp_path) == expected


@pytest.mark.parametrize(
    ("files", "cpus"),
    [
        ({"cpu.max": "150000 100000\n"}, 2),  # v2: rounded up
        ({"cpu.max": "400000 100000\n"}, 4),
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2),  # v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({"cpu.max": "garbage\n"}, None),
        ({}, None),
    ],
)
def test_cgroup_quota(tmp_path: Path, files: dict[str, str], cpus: int | None) -> None:
    _cgroup(tmp_path, files)
    assert cgroup_cpus(tmp_path) == cpus


def test_a_quota_caps_the_cores(tmp_path: Path) -> None:
    """A container given 3 CPUs of a 16-core host runs 2 engine threads, not 15."""
    _topology(tmp_path, [(0, c) for c in range(16)])
    _cgroup(tmp_path, {"cpu.max": "300000 100000\n"})
    assert host_threads(set(range(16)), tmp_path) == 2


def test_the_config_and_the_command_line_default_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TSERVE_THREADS", raising=False)
    assert EngineConfig().threads == default_threads() >= 1
    assert parse_args(["serve"]).threads == default_threads()
    assert parse_args(["serve", "--threads", "3"]).threads == EngineConfig(threads=3).threads == 3


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_a_process_pinned_to_one_cpu_gets_one_thread() -> None:
    """What a fresh process under ``taskset -c 0`` computes, end to end."""
    code = (
        "import os; os.sched_setaffinity(0, {0}); "
        "from tserve.engine_config import EngineConfig; print(EngineConfig().threads)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"
