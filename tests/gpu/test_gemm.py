"""Linear layers on the library measured fastest: same products, tied weights kept."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tserve.gpu.forward._gemm import (
    _MAX_REPEATS,
    _REPEATS,
    TUNED_ROWS,
    Plan,
    TunedLinear,
    available_libraries,
    measure,
    onednn_available,
    tune_linears,
)
from tserve.gpu.forward._runner import ModelRunner
from tserve.gpu.models._directory import load_model

pytestmark = pytest.mark.skipif(
    not onednn_available(torch.float32), reason="this torch has no oneDNN linear"
)
LIBRARIES = available_libraries(torch.float32)
needs_panels = pytest.mark.skipif("panels" not in LIBRARIES, reason="no AVX2 (or AVX-512) here")


def test_a_plan_uses_the_lower_measured_row_count() -> None:
    plan = Plan((1, 4, 16), ("blas", "onednn", "blas"))
    assert [plan.library(n) for n in (1, 2, 3)] == ["blas"] * 3
    assert [plan.library(n) for n in (4, 9, 15)] == ["onednn"] * 3
    assert [plan.library(n) for n in (16, 17, 5000)] == ["blas"] * 3  # the last holds above
    assert plan.describe() == "blas from 1 row, onednn from 4 rows, blas from 16 rows"


@pytest.mark.parametrize("library", ["blas", "onednn", pytest.param("panels", marks=needs_panels)])
@pytest.mark.parametrize("bias", [False, True])
def test_every_library_computes_the_same_product(library: str, bias: bool) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 200, bias=bias)  # 200: the last 32-column panel is partial
    tuned = TunedLinear(linear, Plan((1,), (library,)))  # type: ignore[arg-type]
    assert (tuned.packed is not None) == (library == "onednn")
    with torch.inference_mode():
        for rows in (1, 2, 3, 7, 64, 129):
            x = torch.randn(1, rows, 96)  # packed step layout: [1, T, hidden]
            out = tuned(x)
            assert out.shape == (1, rows, 200)
            # Equal up to float rounding: the libraries sum in different orders.
            torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias))


def test_a_mixed_plan_switches_library_by_row_count() -> None:
    torch.manual_seed(1)
    linear = torch.nn.Linear(32, 48, bias=False)
    tuned = TunedLinear(linear, Plan((1, 8), ("blas", "onednn")))
    with torch.inference_mode():
        few, many = torch.randn(3, 32), torch.randn(8, 32)
        # Below 8 rows the BLAS runs: exactly F.linear's bits.
        assert torch.equal(tuned(few), F.linear(few, linear.weight))
        torch.testing.assert_close(tuned(many), F.linear(many, linear.weight))


def test_measure_returns_a_library_per_row_count() -> None:
    linear = torch.nn.Linear(64, 64)
    plan = measure(linear, TUNED_ROWS, time.perf_counter, LIBRARIES)
    assert plan.rows == TUNED_ROWS
    assert len(plan.libraries) == len(TUNED_ROWS)
    assert set(plan.libraries) <= set(LIBRARIES)


class _Clock:
    """A timer that advances by ``tick`` on every read, and counts the reads."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick, self.reads = 0.0, tick, 0

    def __call__(self) -> float:
        self.now += self.tick
        self.reads += 1
        return self.now


@needs_panels
def test_measure_keeps_the_panels_where_they_tie_with_the_fastest() -> None:
    """Every run takes as long (one tick), so each library ties: the warm
    measurement underrates the panels, which the tie goes to."""
    clock = _Clock(1.0)
    plan = measure(torch.nn.Linear(64, 64), (1, 4), clock, LIBRARIES)
    assert plan.libraries == ("panels", "panels")
    assert clock.reads == 2 * len(LIBRARIES) * _REPEATS * 2  # a tick is over the budget


def test_measure_runs_small_products_more_often() -> None:
    """Runs far below the time budget repeat up to the most runs allowed."""
    clock = _Clock(1e-6)
    measure(torch.nn.Linear(64, 64), (1,), clock, LIBRARIES)
    assert clock.reads == len(LIBRARIES) * _MAX_REPEATS * 2


@pytest.mark.parametrize("cpu_gemm", ["auto", "onednn", pytest.param("panels", marks=needs_panels)])
def test_tuning_a_model_keeps_its_logits_and_tied_weights(
    tiny_model_dir: Path, cpu_gemm: Any
) -> None:
    model, _ = load_model(tiny_model_dir, device="cpu", dtype=torch.float32)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    ids = torch.tensor([[5, 17, 230, 9, 41, 300, 2]])
    with torch.inference_mode():
        before = model(ids).logits
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())

    plans = tune_linears(model, cpu_gemm)

    assert len(plans) == linears  # every linear layer, the output head included
    tuned = [m for m in model.modules() if isinstance(m, TunedLinear)]
    assert len(tuned) == linears
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert tune_linears(model, cpu_gemm) == {}  # already tuned: left alone
    if cpu_gemm == "onednn":
        assert all(t.packed is not None for t in tuned)
    if cpu_gemm == "panels":
        assert all(set(t.plan.libraries) == {"panels"} for t in tuned)
    with torch.inference_mode():
        after = model(ids).logits
    # Logits of magnitude ~10 through two layers: float rounding only (measured <= 4e-5).
    torch.testing.assert_close(after, before, rtol=0, atol=2e-4)


def test_the_blas_setting_leaves_the_model_alone(tiny_model_dir: Path) -> None:
    model, _ = load_model(tiny_model_dir, device="cpu", dtype=torch.float32)
    runner = ModelRunner(model, num_blocks=4, block_size=16, cpu_gemm="blas")
    assert not any(isinstance(m, TunedLinear) for m in runner.model.modules())
    runner = ModelRunner(
        load_model(tiny_model_dir, device="cpu", dtype=torch.float32)[0],
        num_blocks=4,
        block_size=16,
        cpu_gemm="onednn",
    )
    tuned = [m for m in runner.model.modules() if isinstance(m, TunedLinear)]
    assert tuned and all(set(t.plan.libraries) == {"onednn"} for t in tuned)
