"""The engine process's glibc heap: kept between steps, given back after loading.

glibc's malloc maps large blocks (a step's activations, logits, gathered K/V)
fresh from the kernel and unmaps them on free, and gives freed heap back once
128 KiB sit free at its top: every step then faults its memory back in page
by page, zeroed by the kernel. Measured on SmolLM2 (64 requests of 64 tokens
through open_llm): 13 of the engine's 39 s were system time; with blocks up
to :data:`MALLOC_MMAP_THRESHOLD` kept in the heap and up to
:data:`MALLOC_TRIM_THRESHOLD` of freed heap kept, 24 s, system time 0.

Kept heap is also kept garbage: what loading a model frees (a GGUF file's
parsed metadata, the layers' tuning scratch, the parse of a tokenizer) would
stay resident for the process's life, about 80 MB for the default model.
:func:`tserve._host.trim_heap` gives the free part back once, after loading; the steps'
memory is kept as before. Elsewhere than glibc both are no-ops.

A KV pool is neither: :func:`untouched_pages` maps it fresh from the kernel,
so that only the pages K/V are written to become resident.

A model's product weights are neither either: :class:`WeightArena` lays them
one after another in memory the kernel backs with 2 MiB pages. A decode
step streams every weight once; on 4 KiB pages each page of that stream
costs a page walk, and the hardware prefetcher stops at every page's end.
SmolLM2's Q4_1 panels (66 MB of them, one row of x, one thread) were read at
7.8-10 GB/s from the heap and at 12-16 GB/s from huge pages.
"""

from __future__ import annotations

import logging
import mmap
from typing import Final

import numpy as np

from tserve._host import libc_function

__all__ = [
    "ARENA_ALIGN",
    "MALLOC_MMAP_THRESHOLD",
    "MALLOC_TRIM_THRESHOLD",
    "WeightArena",
    "keep_freed_heap",
    "untouched_pages",
]

log = logging.getLogger(__name__)

MALLOC_MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit
MALLOC_TRIM_THRESHOLD = 1 << 30


def keep_freed_heap() -> None:
    """Tell glibc's malloc to keep a step's memory (see above)."""
    mallopt = libc_function("mallopt")
    if mallopt is None:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    ok = mallopt(m_mmap_threshold, MALLOC_MMAP_THRESHOLD)
    if not (ok and mallopt(m_trim_threshold, MALLOC_TRIM_THRESHOLD)):
        log.warning("mallopt refused the heap settings; the engine may spend time in page faults")


def untouched_pages(nbytes: int) -> mmap.mmap:
    """``nbytes`` (at least 1) of zeros that take no memory until written: a fresh
    private anonymous mapping, whose pages the kernel supplies zeroed at their
    first touch, 4 KiB at a time. (``torch.zeros`` writes every byte, making a
    whole KV pool resident before any request; ``np.empty`` of a large array
    asks for transparent huge pages, so that one K/V row written per
    ``[kv_heads, slots, D]`` plane of each layer makes 2 MiB of it resident: the
    default model's 755 MB pool all but whole after one request.)"""
    return mmap.mmap(-1, max(1, nbytes), flags=mmap.MAP_PRIVATE)


ARENA_ALIGN: Final = 64
"""Where each array in a :class:`WeightArena` starts: a cache line."""


class WeightArena:
    """Up to ``capacity`` bytes of arrays laid out one after another in one
    anonymous mapping that asks for transparent huge pages (``MADV_HUGEPAGE``;
    on a kernel without them, or with them turned off, ordinary pages).

    Pages are taken only as arrays are written; the unused end of the
    capacity costs address space alone. When it is full, :meth:`take` hands
    out ordinary heap arrays. Not thread-safe. The arrays keep the mapping
    alive; nothing is ever freed but all of it at once, with the last of them.
    """

    def __init__(self, capacity: int) -> None:
        self._pages = mmap.mmap(-1, max(1, capacity), flags=mmap.MAP_PRIVATE)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._pages.madvise(mmap.MADV_HUGEPAGE)
            except OSError as exc:  # a kernel without them: ordinary pages
                log.debug("no transparent huge pages for the weights: %s", exc)
        self._bytes = np.frombuffer(self._pages, dtype=np.uint8)
        self._used = 0

    @property
    def used(self) -> int:
        """Bytes handed out so far, alignment included."""
        return self._used

    def take(self, nbytes: int) -> np.ndarray:
        """A new uint8 array of ``nbytes``, uninitialised (zeros in the arena),
        cache-line aligned: in the arena while it has room, else on the heap."""
        start = -(-self._used // ARENA_ALIGN) * ARENA_ALIGN
        if start + nbytes > len(self._bytes):
            return np.empty(nbytes, dtype=np.uint8)
        self._used = start + nbytes
        return self._bytes[start : start + nbytes]

    def copy(self, a: np.ndarray) -> np.ndarray:
        """``a``'s bytes in the arena, as an array of ``a``'s dtype and shape."""
        out = self.take(a.nbytes).view(a.dtype).reshape(a.shape)
        np.copyto(out, a)
        return out
