"""Linear layers on CPU, each run by the matrix-product library that measured fastest.

Three libraries, all over the same weights:

* ``blas``: ``F.linear``, the BLAS torch was built with (MKL in the PyPI
  wheels). Fine for one row; with a few rows MKL streams a weight that does
  not fit in the caches once PER ROW (SmolLM2's 113 MB output head: 2 rows
  take twice as long as 1).
* ``onednn``: oneDNN over a copy of the weight reordered once into its
  blocked layout ("prepacked", as inductor's CPU backend and IPEX do); the
  best at many rows.
* ``panels``: tserve's own kernel (``_cpu_kernels``, AVX-512 where the CPU
  has it, else AVX2 + FMA) over a copy packed in column panels, which reads each weight byte
  from memory once whatever the row count. A decode step of a small model
  on one core is bound by reading its weights, so this is the few-rows case.

Measured on this project's 2-core Xeon (AVX-512), one thread, fp32, one pass
over SmolLM2's linear layers (538 MB, each weight read cold from memory, as
in a decode step), ms:

=======  =====  ======  ======  ======  =======
library  1 row  4 rows  8 rows  16 rows  64 rows
=======  =====  ======  ======  ======  =======
blas     42     77      108     91       218
onednn   50     59      64      71       181
panels   40     43      44      61       152
=======  =====  ======  ======  ======  =======

Which one wins depends on the CPU, the BLAS and the row count, so it is
measured once per weight shape when the runner is built, at each row count
of :data:`TUNED_ROWS`; above the last one that one's choice holds. That
measurement repeats one weight, warm in the caches as it is not in a real
pass, so it underrates ``panels``, whose gain is in reading memory: ``panels``
is kept where it measured within :data:`PANELS_MARGIN` of the fastest. Each
time is the fastest of at least :data:`_REPEATS` runs (more for small
products, up to :data:`_BUDGET_S` of runs each), by the thread's CPU time
when torch runs on one thread (what other processes on a shared machine
take does not count), else by the wall clock.

The libraries give the same products up to float rounding (the summation
order inside each differs), the same kind of difference that batching
itself makes: ``F.linear`` over 1 row and over 8 rows differ in the last bits
too. Memory: a layer keeps a packed copy of its weight for each of
``onednn`` and ``panels`` that its plan uses, next to the original (which
tied embeddings and the BLAS rows still read).
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

from tserve.gpu.kernels._cpu_kernels import CpuKernels, cpu_kernels
from tserve.protocol import CpuGemm

__all__ = [
    "TUNED_ROWS",
    "Plan",
    "TunedLinear",
    "available_libraries",
    "measure",
    "onednn_available",
    "tune_linears",
]

log = logging.getLogger(__name__)

Library = Literal["blas", "onednn", "panels"]
"""``blas``: ``F.linear``; ``onednn``: oneDNN over a prepacked copy of the
weight; ``panels``: tserve's few-rows kernel over a panel-packed copy."""

TUNED_ROWS: Final = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
"""Row counts measured; a count between two uses the lower one's choice."""

_REPEATS: Final = 2  # timed runs per (rows, library) after one warm-up, at least; fastest counts
_MAX_REPEATS: Final = 12
_BUDGET_S: Final = 0.002  # further runs while a (rows, library)'s runs took less than this

PANELS_MARGIN: Final = 0.05
"""``panels`` is chosen where it measured at most this much slower than the fastest."""


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


class _Weights:
    """One layer's weight in the layout of each library its plan uses."""

    def __init__(self, linear: torch.nn.Linear, libraries: Sequence[Library]) -> None:
        self.weight, self.bias = linear.weight, linear.bias
        self.out_features = linear.out_features
        self.onednn = _pack(linear.weight) if "onednn" in libraries else None
        self.kernels = cpu_kernels() if "panels" in libraries else None
        self.panels = None
        self._panels: Callable[[torch.Tensor], torch.Tensor] | None = None
        if self.kernels is not None:
            with torch.inference_mode():
                self.panels = self.kernels.pack_linear(linear.weight)
            self._panels = self.kernels.bound_linear(self.panels, self.bias, self.out_features)

    def product(self, library: Library, x: torch.Tensor) -> torch.Tensor:
        if library == "onednn":
            assert self.onednn is not None, "a layer that uses oneDNN keeps a packed weight"
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, self.onednn, self.bias, "none", [], ""
            )
            return out
        if library == "panels":
            assert self._panels is not None, "a layer that uses the panels keeps packed ones"
            return self._panels(x)
        return F.linear(x, self.weight, self.bias)


class TunedLinear(torch.nn.Linear):
    """An ``nn.Linear`` that runs on the library its plan names for the row count.

    Shares the original layer's parameters, so tied weights stay tied. For
    inference only: the packed copies are not parameters and do not follow
    later changes to the weight. The hot path is one list lookup and one
    call: a decode step of SmolLM2 runs 121 of these.
    """

    def __init__(self, linear: torch.nn.Linear, plan: Plan) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        self.plan = plan
        # A plain attribute, read without nn.Module's __getattr__ on every call.
        self._weights = _Weights(linear, plan.libraries)
        self._last = plan.rows[-1]
        self._choice = [plan.library(n) for n in range(self._last + 1)]

    @property
    def packed(self) -> torch.Tensor | None:
        """oneDNN's copy of the weight (None unless the plan uses oneDNN)."""
        return self._weights.onednn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        return self._weights.product(self._choice[min(rows, self._last)], x)


def onednn_available(dtype: torch.dtype) -> bool:
    """Whether this torch can run a prepacked oneDNN linear in ``dtype``."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    try:
        linear = torch.nn.Linear(4, 4, bias=False, dtype=dtype)
        _Weights(linear, ("onednn",)).product("onednn", torch.ones(2, 4, dtype=dtype))
    except (RuntimeError, AttributeError):  # no such op in this build, or not for this dtype
        return False
    return True


def available_libraries(dtype: torch.dtype) -> tuple[Library, ...]:
    """The libraries that can run a CPU linear layer in ``dtype`` here."""
    kernels: CpuKernels | None = cpu_kernels() if dtype == torch.float32 else None
    return (
        "blas",
        *(("onednn",) if onednn_available(dtype) else ()),
        *(("panels",) if kernels is not None and kernels.linear_available else ()),
    )


def _pack(weight: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    return packed


def tune_linears(
    model: torch.nn.Module,
    cpu_gemm: CpuGemm = "auto",
    *,
    timer: Callable[[], float] | None = None,
) -> dict[str, Plan]:
    """Replace every CPU ``nn.Linear`` of ``model`` with a :class:`TunedLinear`.

    ``cpu_gemm`` "auto" measures: blocks while it does (SmolLM2: a second
    or two, mostly its output head); weights of one shape and dtype are
    measured once. "onednn" or "panels" is used at every row count instead
    (where it cannot run here: logged, and the model is left alone);
    "blas" leaves the model alone. For a model on CPU (the runner's call).
    Returns the plan of each replaced module.
    """
    if cpu_gemm == "blas":
        return {}
    linears = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and not isinstance(module, TunedLinear)
    ]
    if not linears:
        return {}
    libraries = available_libraries(linears[0][1].weight.dtype)
    if cpu_gemm != "auto" and cpu_gemm not in libraries:
        log.warning("%s cannot run linear layers here; they stay on the BLAS", cpu_gemm)
        return {}
    if len(libraries) == 1:
        return {}
    if timer is None:
        timer = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    by_shape: dict[tuple[object, ...], Plan] = {}
    plans: dict[str, Plan] = {}
    for name, linear in linears:
        key = (*linear.weight.shape, linear.weight.dtype, linear.bias is not None)
        if key not in by_shape and cpu_gemm != "auto":
            by_shape[key] = Plan((1,), (cpu_gemm,))  # from one row up
        elif key not in by_shape:
            by_shape[key] = measure(linear, TUNED_ROWS, timer, libraries)
            log.info("%s %s: %s", name, tuple(linear.weight.shape), by_shape[key].describe())
        plans[name] = by_shape[key]
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, TunedLinear(linear, plans[name]))
    return plans


def measure(
    linear: torch.nn.Linear,
    rows: Sequence[int],
    timer: Callable[[], float],
    libraries: Sequence[Library],
) -> Plan:
    """The fastest of ``libraries`` for ``linear`` at each row count (fastest of a
    few runs; ``panels`` where within :data:`PANELS_MARGIN` of it)."""
    weights = _Weights(linear, libraries)
    chosen: list[Library] = []
    with torch.inference_mode():
        for n in rows:
            x = torch.randn(n, linear.in_features, dtype=linear.weight.dtype)
            seconds: dict[Library, float] = {}
            for library in libraries:
                weights.product(library, x)  # warm-up
                seconds[library] = float("inf")
                spent, runs = 0.0, 0
                while runs < _REPEATS or (spent < _BUDGET_S and runs < _MAX_REPEATS):
                    start = timer()
                    weights.product(library, x)
                    took = timer() - start
                    seconds[library] = min(seconds[library], took)
                    spent, runs = spent + took, runs + 1
            fastest = min(seconds, key=seconds.__getitem__)
            if seconds.get("panels", float("inf")) <= seconds[fastest] * (1 + PANELS_MARGIN):
                fastest = "panels"
            chosen.append(fastest)
    return Plan(tuple(rows), tuple(chosen))
