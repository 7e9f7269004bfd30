"""Where benchmark results go: ``results/`` at the repository root (gitignored)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from tserve.gpu.kernels._library import MAX_ISA_ENV

__all__ = ["REPO_ROOT", "kernel_meta", "result_stem", "write_json"]

REPO_ROOT = Path(__file__).resolve().parents[1]


def result_stem(name: str, stamp: str | None = None) -> Path:
    """``results/<name>-<stamp>`` (no suffix), creating ``results/``.

    ``stamp`` defaults to the local time as YYYYmmdd-HHMMSS.
    """
    results = REPO_ROOT / "results"
    results.mkdir(exist_ok=True)
    return results / f"{name}-{stamp or time.strftime('%Y%m%d-%H%M%S')}"


def kernel_meta(**fields: Any) -> dict[str, Any]:
    """``fields`` with what a one-core kernel figure depends on besides the code:
    the load averages, and the kernels' instruction-set cap (``TSERVE_MAX_ISA``;
    "" when none)."""
    return {**fields, "load_average": os.getloadavg(), "max_isa": os.environ.get(MAX_ISA_ENV, "")}


def write_json(stem: Path, data: Any, *, indent: int = 2) -> Path:
    """Write ``data`` to ``<stem>.json`` and return that path."""
    path = stem.with_suffix(".json")
    path.write_text(json.dumps(data, indent=indent) + "\n")
    return path
