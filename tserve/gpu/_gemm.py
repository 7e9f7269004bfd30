"""Linear layers on CPU, each run by the matrix-product library that measured fastest.

``F.linear`` on CPU goes to the BLAS torch was built with (MKL in the PyPI
wheels). That BLAS may be far from the machine's peak: on this project's AMD
EPYC test machine MKL's fp32 GEMM reaches about 110 GFLOP/s on one thread,
while oneDNN with the weight reordered once into its blocked layout
("prepacked", as inductor's CPU backend and IPEX do) reaches about 250, and
MKL streams a weight that does not fit in the caches once PER ROW when the
rows are few (SmolLM2's 113 MB output head: 2 rows take twice as long as 1).
Measured there, one thread, fp32, ``F.linear`` vs prepacked oneDNN:

===========  ========  ======  =======  =======  ========
weight       library   1 row   8 rows   64 rows  512 rows
===========  ========  ======  =======  =======  ========
1536 x 576   F.linear  47 us   207 us   1076 us  8.3 ms
1536 x 576   oneDNN    49 us   78 us    449 us   3.5 ms
49152 x 576  F.linear  6.8 ms  14.2 ms  43.9 ms
49152 x 576  oneDNN    2.8 ms  4.4 ms   16.6 ms
===========  ========  ======  =======  =======  ========

Which one wins depends on the CPU, the BLAS and the row count (one row of a
small weight: the BLAS), so it is measured once per weight shape when the
runner is built, at each row count of :data:`TUNED_ROWS`; above the last one
that one's choice holds.

The two give the same products up to float rounding (the summation order
inside the libraries differs), the same kind of difference that batching
itself makes: ``F.linear`` over 1 row and over 8 rows differ in the last bits
too. Memory: a layer that uses oneDNN at any row count keeps a packed copy of
its weight next to the original (which tied embeddings and the BLAS rows
still read), so the linear weights take up to twice their size.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Final, Literal

import torch
import torch.nn.functional as F

from tserve.protocol import CpuGemm

__all__ = ["TUNED_ROWS", "Plan", "TunedLinear", "measure", "onednn_available", "tune_linears"]

log = logging.getLogger(__name__)

Library = Literal["blas", "onednn"]
"""``blas``: ``F.linear``; ``onednn``: oneDNN over a prepacked copy of the weight."""

TUNED_ROWS: Final = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
"""Row counts measured; a count between two uses the lower one's choice."""

_REPEATS: Final = 2  # timed runs per (rows, library) after one warm-up; the fastest counts


@dataclasses.dataclass(frozen=True)
class Plan:
    """The library for each measured row count (ascending); the last holds above it."""

    rows: tuple[int, ...]
    libraries: tuple[Library, ...]

    def library(self, rows: int) -> Library:
        return self.libraries[max(0, bisect.bisect_right(self.rows, rows) - 1)]

    def describe(self) -> str:
        """``"blas from 1 row, onednn from 2 rows"``: where the choice changes."""
        changes = [
            f"{library} from {rows} row{'s' if rows > 1 else ''}"
            for i, (rows, library) in enumerate(zip(self.rows, self.libraries, strict=True))
            if i == 0 or library != self.libraries[i - 1]
        ]
        return ", ".join(changes)


class TunedLinear(torch.nn.Linear):
    """An ``nn.Linear`` that runs on the library its plan names for the row count.

    Shares the original layer's parameters, so tied weights stay tied. For
    inference only: the packed copy is not a parameter and does not follow
    later changes to the weight. The hot path is one list lookup and one
    call: a decode step of SmolLM2 runs 211 of these.
    """

    def __init__(self, linear: torch.nn.Linear, plan: Plan) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        self.plan = plan
        self.packed = _pack(linear.weight) if "onednn" in plan.libraries else None
        # Plain attributes, read without nn.Module's __getattr__ on every call.
        self._tensors = (linear.weight, linear.bias, self.packed)
        self._last = plan.rows[-1]
        self._onednn = [plan.library(n) == "onednn" for n in range(self._last + 1)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias, packed = self._tensors
        if packed is not None and self._onednn[min(x.numel() // x.shape[-1], self._last)]:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
            return out
        return F.linear(x, weight, bias)


def onednn_available(dtype: torch.dtype) -> bool:
    """Whether this torch can run a prepacked oneDNN linear in ``dtype``."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    try:
        linear = torch.nn.Linear(4, 4, bias=False, dtype=dtype)
        _product("onednn", torch.ones(2, 4, dtype=dtype), linear, _pack(linear.weight))
    except (RuntimeError, AttributeError):  # no such op in this build, or not for this dtype
        return False
    return True


def _pack(weight: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    return packed


def _product(
    library: Library, rows: torch.Tensor, linear: torch.nn.Linear, packed: torch.Tensor | None
) -> torch.Tensor:
    if library == "blas":
        return F.linear(rows, linear.weight, linear.bias)
    assert packed is not None, "a layer that uses oneDNN keeps a packed weight"
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
        rows, packed, linear.bias, "none", [], ""
    )
    return out


def tune_linears(
    model: torch.nn.Module,
    cpu_gemm: CpuGemm = "auto",
    *,
    timer: Callable[[], float] = time.perf_counter,
) -> dict[str, Plan]:
    """Replace every CPU ``nn.Linear`` of ``model`` with a :class:`TunedLinear`.

    ``cpu_gemm`` "auto" measures: blocks while it does (SmolLM2: about a
    second, mostly its output head); weights of one shape and dtype are
    measured once. "onednn" is used at every row count instead; "blas"
    leaves the model alone. Layers on another device are left alone, and
    so is everything when oneDNN cannot run here (logged when it was asked
    for). Returns the plan of each replaced module.
    """
    if cpu_gemm == "blas":
        return {}
    linears = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and not isinstance(module, TunedLinear)
        and module.weight.device.type == "cpu"
    ]
    if not linears or not onednn_available(linears[0][1].weight.dtype):
        if cpu_gemm == "onednn":
            log.warning("oneDNN cannot run linear layers here; they stay on the BLAS")
        return {}
    by_shape: dict[tuple[object, ...], Plan] = {}
    plans: dict[str, Plan] = {}
    for name, linear in linears:
        key = (*linear.weight.shape, linear.weight.dtype, linear.bias is not None)
        if key not in by_shape and cpu_gemm == "onednn":
            by_shape[key] = Plan((1,), ("onednn",))  # from one row up
        elif key not in by_shape:
            by_shape[key] = measure(linear, TUNED_ROWS, timer)
            log.info("%s %s: %s", name, tuple(linear.weight.shape), by_shape[key].describe())
        plans[name] = by_shape[key]
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, TunedLinear(linear, plans[name]))
    return plans


def measure(linear: torch.nn.Linear, rows: Sequence[int], timer: Callable[[], float]) -> Plan:
    """The fastest library for ``linear`` at each row count (fastest of a few runs)."""
    weight = linear.weight
    packed = _pack(weight)
    libraries: list[Library] = []
    with torch.inference_mode():
        for n in rows:
            x = torch.randn(n, weight.shape[1], dtype=weight.dtype)
            best: tuple[float, Library] | None = None
            for library in ("blas", "onednn"):
                _product(library, x, linear, packed)  # warm-up
                seconds = float("inf")
                for _ in range(_REPEATS):
                    start = timer()
                    _product(library, x, linear, packed)
                    seconds = min(seconds, timer() - start)
                if best is None or seconds < best[0]:
                    best = (seconds, library)
            assert best is not None
            libraries.append(best[1])
    return Plan(tuple(rows), tuple(libraries))
