"""Cyclic-GC settings for a serving process: an API process once it has
started, an engine once its model has loaded. Imports nothing of tserve.

Both hold a large, long-lived heap by then (the tokenizer, the web app, the
mux; the model's modules, the scheduler, the grammar compiler) and then
allocate many short-lived, acyclic containers per engine step (token-id
lists of every delta, a step's sequences and outputs). With
CPython's defaults, each full collection walks the whole startup heap, and
gen-0 collections fire every 700 allocations in the middle of decoding a
frame, promoting its lists into older generations. Both costs scale with
load and buy nothing: none of these objects form cycles.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["GEN0_THRESHOLD", "serving_gc"]

# Allocations between gen-0 collections while serving (CPython's default is
# 700). One engine step routes up to one delta per live request, so 10,000
# lets a whole frame decode and route without a collection in the middle.
GEN0_THRESHOLD = 10_000


@contextlib.contextmanager
def serving_gc() -> Iterator[None]:
    """Collect, freeze everything alive now, and raise the gen-0 threshold.

    Frozen objects are never scanned again; later cycles are still
    collected. Both settings are process-wide and restored on exit.
    """
    gc.collect()
    gc.freeze()
    threshold = gc.get_threshold()
    gc.set_threshold(max(GEN0_THRESHOLD, threshold[0]), *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()
