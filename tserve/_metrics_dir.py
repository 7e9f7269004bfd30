"""The directory where every API process of one server writes its request metrics.

With ``--api-processes N`` a scrape lands on one of N processes, yet must
see the whole server. prometheus-client's multiprocess mode gives that: each
process writes its counters and histograms to memory-mapped files in one
directory, and a scrape of any process sums the files of all of them.

prometheus-client picks how it stores values when it is first imported, from
the environment variable :data:`ENV`. So the main process calls
:func:`shared_metrics_dir` before anything imports ``prometheus_client``
(this module imports only the standard library, for that reason), and the
API worker processes inherit the variable from it.

Lifecycle: the directory is private to the server's user (mode 0700, made by
``tempfile.mkdtemp``), on ``/dev/shm`` where it exists so that a scrape reads
memory, and removed with everything in it when the block exits in any way.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["ENV", "shared_metrics_dir"]

ENV = "PROMETHEUS_MULTIPROC_DIR"

_MEMORY = Path("/dev/shm")


@contextlib.contextmanager
def shared_metrics_dir() -> Iterator[str]:
    """Make the shared directory and point :data:`ENV` at it for this process and its children.

    Raises RuntimeError if ``prometheus_client`` was imported already without
    the variable (its values would stay private to each process). Leaving the
    block (any way) unsets the variable and removes the directory; that
    cleanup is synchronous.
    """
    if "prometheus_client" in sys.modules and not os.environ.get(ENV):
        raise RuntimeError(
            f"prometheus_client was imported before {ENV} was set: "
            "API processes could not share their metrics"
        )
    parent = _MEMORY if _MEMORY.is_dir() and os.access(_MEMORY, os.W_OK) else None
    path = tempfile.mkdtemp(prefix="tserve-metrics-", dir=parent)
    previous = os.environ.get(ENV)
    os.environ[ENV] = path
    try:
        yield path
    finally:
        if previous is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = previous
        shutil.rmtree(path, ignore_errors=True)
