"""One core's streaming read bandwidth, measured by ``read_bandwidth.c``.

The C file is compiled with the system's ``cc -O3 -march=native`` into a
temporary directory at each call (a second); see it for the method.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["read_bandwidth"]

_SOURCE = Path(__file__).with_name("read_bandwidth.c")


def read_bandwidth(mib: int = 512, passes: int = 7) -> dict[str, Any]:
    """``read_bandwidth.c``'s JSON: each pass's GB/s over a ``mib`` MiB buffer,
    ``best_gb_s`` and ``median_gb_s``. Blocks (about a second per GiB read);
    CalledProcessError if ``cc`` is missing or fails."""
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "read_bandwidth"
        compile_it = ["cc", "-O3", "-march=native", str(_SOURCE), "-o", str(binary)]
        subprocess.run(compile_it, check=True)
        run = subprocess.run(
            [str(binary), str(mib), str(passes)], check=True, capture_output=True, text=True
        )
    result: dict[str, Any] = json.loads(run.stdout)
    result["method"] = (
        f"one thread sums a {mib} MiB buffer of 64-bit words {passes} times "
        "(benchmarks/read_bandwidth.c, cc -O3 -march=native)"
    )
    return result
