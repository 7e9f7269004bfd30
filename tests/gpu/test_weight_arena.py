"""The product weights' arena: one mapping on transparent huge pages.

A decode step streams every product weight once; :class:`WeightArena` lays
them one after another in an anonymous mapping that asks for 2 MiB pages
(``MADV_HUGEPAGE``). Checked on the mapping itself (``/proc/self/smaps``
flags), never on a timing: its arrays are aligned and disjoint and keep
their bytes, a full arena hands out heap arrays, and the native runner's
every product weight lies in its model's arena.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pytest

from tests.gpu.gguf_files import write_gguf
from tserve.gpu.forward._native import NativeModel
from tserve.gpu.forward._quant import Activations
from tserve.gpu.gguf._file import GgufFile
from tserve.gpu.kernels._heap import ARENA_ALIGN, WeightArena

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping(address: int) -> tuple[int, int, set[str]]:
    """The mapping of this process that holds ``address``: start, end, VmFlags."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    found: tuple[int, int] | None = None
    for line in lines:
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            start, end = int(head.group(1), 16), int(head.group(2), 16)
            found = (start, end) if start <= address < end else None
        elif found is not None and line.startswith("VmFlags:"):
            return found[0], found[1], set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_its_arrays_are_aligned_disjoint_and_keep_their_bytes() -> None:
    arena = WeightArena(1 << 20)
    rng = np.random.default_rng(0)
    sources = [rng.integers(0, 255, size, dtype=np.uint8) for size in (1, 100, 4097, 65)]
    sources.append(rng.standard_normal((7, 33)).astype(np.float32))
    copies = [arena.copy(a) for a in sources]
    spans = []
    for source, copy in zip(sources, copies, strict=True):
        assert copy.dtype == source.dtype and copy.shape == source.shape
        assert np.array_equal(copy, source)
        assert copy.ctypes.data % ARENA_ALIGN == 0
        spans.append((copy.ctypes.data, copy.ctypes.data + copy.nbytes))
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))  # in order
    start, end, _ = _mapping(spans[0][0])
    assert all(start <= a and b <= end for a, b in spans)  # one mapping
    assert arena.used == spans[-1][1] - spans[0][0]


def test_a_full_arena_hands_out_heap_arrays() -> None:
    arena = WeightArena(4096)
    inside = arena.take(4000)
    outside = arena.take(200)  # 4032 + 200 > 4096
    assert len(outside) == 200 and outside.flags.writeable
    start, end, _ = _mapping(inside.ctypes.data)
    assert not start <= outside.ctypes.data < end
    assert arena.used == 4000


@pytest.mark.skipif(not THP.exists(), reason="a kernel without transparent huge pages")
def test_the_arena_asks_for_huge_pages() -> None:
    arena = WeightArena(8 << 20)
    _, _, flags = _mapping(arena.take(1).ctypes.data)
    assert "hg" in flags  # VM_HUGEPAGE: madvise(MADV_HUGEPAGE) took


@pytest.mark.parametrize(("fmt", "activations"), [("Q4_1", "int8"), ("F16", "fp32")])
def test_every_product_weight_of_a_native_model_lies_in_its_arena(
    smollm2_tiny_dir: Path, tmp_path: Path, fmt: str, activations: Activations
) -> None:
    """Packed (int8 activations) or copied from the file (fp32 ones), the head's
    too; the file's mapping keeps none of them."""
    path = write_gguf(smollm2_tiny_dir, tmp_path / "gguf" / f"tiny-{fmt}.gguf", fmt)
    file = GgufFile(path, has_kernels=True)
    model = NativeModel(file, cache_dir=tmp_path, progress=lambda _: None, activations=activations)
    products = [p for layer in model.layers for p in layer[0]] + [model.head]
    addresses = [p.parts[i].data for p in products for i in range(p.count)]
    start, end, _ = _mapping(addresses[0])
    assert all(start <= a < end for a in addresses)
    assert model._arena.used >= model.product_bytes > 0
