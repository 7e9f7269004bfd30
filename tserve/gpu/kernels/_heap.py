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
"""

from __future__ import annotations

import logging
import mmap

from tserve._host import libc_function

__all__ = [
    "MALLOC_MMAP_THRESHOLD",
    "MALLOC_TRIM_THRESHOLD",
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
