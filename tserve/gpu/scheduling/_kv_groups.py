"""Which layers share a KV block: the KV cache's layer groups; no torch.

A model whose layers all attend alike (every one globally, or every one
within the same sliding window) keeps its KV in one group: a block holds
``block_size`` positions of every layer, as in a plain paged cache. A model
that mixes kinds (Gemma 2: local and global alternating; Gemma 3: five local
to one global) splits its layers into groups of equal size, each of one kind,
each with a block table of its own per sequence. All blocks come from one
pool, so any group may take any free block (their pages are the same size:
``block_size`` positions of ``group_size`` layers).

Why: a global layer needs every position's K/V; a local layer only its last
``window``. With one block for every layer, a block outside the window still
holds the global layers' K/V and cannot be freed. With a group per kind, a
local group's blocks that have fallen out of the window go back to the pool
(``BlockManager.reclaim``) while the global group keeps its own.

The group size is the greatest common divisor of the kinds' layer counts, so
no page has an idle layer: Gemma 3 270M (15 local, 3 global) has six groups
of three layers; Gemma 2 2B (13 and 13) two groups of 13.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

__all__ = ["KVGroups"]


@dataclasses.dataclass(frozen=True)
class KVGroups:
    """Layer groups of the KV cache, each of ``group_size`` layers of one kind.

    Invariants: ``layers`` partitions ``range(num_layers)``, every group has
    ``group_size`` layers, and the layers of a group share ``windows[group]``.
    Layer ``layers[g][i]`` keeps its K/V in row ``i`` of the pool's first axis
    (``[group_size, kv_heads, slots, head_dim]``), at the slots of group ``g``'s
    block table.
    """

    windows: tuple[int, ...]
    """Each group's sliding window (0: global attention)."""
    layers: tuple[tuple[int, ...], ...]
    """Each group's layers, ascending."""

    @classmethod
    def of(cls, layer_windows: Sequence[int]) -> KVGroups:
        """The groups of layers whose windows are ``layer_windows`` (0: global)."""
        if not layer_windows:
            raise ValueError("a model has at least one layer")
        kinds: dict[int, list[int]] = {}
        for layer, window in enumerate(layer_windows):
            kinds.setdefault(window, []).append(layer)
        size = math.gcd(*(len(members) for members in kinds.values()))
        windows: list[int] = []
        layers: list[tuple[int, ...]] = []
        for window, members in kinds.items():
            for first in range(0, len(members), size):
                windows.append(window)
                layers.append(tuple(members[first : first + size]))
        return cls(tuple(windows), tuple(layers))

    @classmethod
    def single(cls, num_layers: int) -> KVGroups:
        """Every layer in one group without a window: a block holds all of them."""
        return cls.of([0] * num_layers)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def group_size(self) -> int:
        """Layers per group: the pool's first axis."""
        return len(self.layers[0])

    @property
    def num_layers(self) -> int:
        return self.num_groups * self.group_size

    def place(self, layer: int) -> tuple[int, int]:
        """``(group, row)`` of ``layer``: its group's block tables, its row of the pool."""
        for group, members in enumerate(self.layers):
            if layer in members:
                return group, members.index(layer)
        raise IndexError(f"layer {layer} of {self.num_layers}")

    def describe(self) -> str:
        """One line for the engine log: the groups and their windows."""
        if not any(self.windows):
            return "one KV group"
        kinds = ", ".join(
            f"{self.windows.count(w)} of window {w}" if w else f"{self.windows.count(0)} global"
            for w in dict.fromkeys(self.windows)
        )
        groups = "1 KV group" if self.num_groups == 1 else f"{self.num_groups} KV groups"
        layers = "1 layer" if self.group_size == 1 else f"{self.group_size} layers"
        return f"{groups} of {layers} ({kinds})"
