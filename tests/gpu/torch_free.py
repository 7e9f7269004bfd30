"""Whether some lines of tserve run without importing torch: a fresh interpreter runs them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.guards import HANG_GUARD

ROOT = Path(__file__).resolve().parents[2]


def assert_runs_without_torch(code: str) -> None:
    """Run ``code`` in a new interpreter on this checkout; fail if it raises or if
    torch (or any module of it) was imported by the end. Blocks until it exits."""
    check = (
        "\nimport sys\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    subprocess.run(
        [sys.executable, "-c", code + check], check=True, timeout=HANG_GUARD, cwd=ROOT, env=env
    )
