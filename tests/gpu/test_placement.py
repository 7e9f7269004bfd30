"""The one decision of runner, device, dtype and KV dtype (``tserve.gpu.models._placement``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.gpu.torch_free import assert_runs_without_torch
from tserve.gpu.forward._runner import resolve_device, resolve_kv_dtype, runs_gguf
from tserve.gpu.models import _placement as placement
from tserve.protocol import EngineConfig, KvCacheDtype


@pytest.mark.parametrize(
    ("options", "cuda", "want"),
    [
        ({}, False, ("cpu", "float32")),
        ({}, True, ("cuda", "bfloat16")),
        ({"device": "cpu"}, True, ("cpu", "float32")),
        ({"device": "cuda:1"}, False, ("cuda:1", "bfloat16")),
        ({"dtype": "bf16"}, False, ("cpu", "bfloat16")),
        ({"dtype": "float16", "device": "cuda"}, True, ("cuda", "float16")),
    ],
)
def test_device_and_dtype(options: dict[str, Any], cuda: bool, want: tuple[str, str]) -> None:
    assert placement.device_and_dtype(EngineConfig(**options), cuda=cuda) == want


def test_an_unknown_dtype_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown dtype 'int4'.*float32"):
        placement.device_and_dtype(EngineConfig(dtype="int4"), cuda=False)


@pytest.mark.parametrize(
    ("kv", "dtype", "want"),
    [("auto", "float32", "fp32"), ("auto", "bfloat16", "bf16"), ("fp16", "float32", "fp16")],
)
def test_the_kv_cache_stores_the_models_dtype_unless_told(
    kv: KvCacheDtype, dtype: str, want: str
) -> None:
    config = EngineConfig(kv_cache_dtype=kv)
    assert placement.kv_dtype(config, dtype) == want
    as_torch = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    assert resolve_kv_dtype(config.kv_cache_dtype, getattr(torch, dtype)) == as_torch[want]


@pytest.mark.parametrize(
    ("options", "cuda", "problem"),
    [
        ({}, False, None),
        ({"device": "cpu"}, True, None),
        ({}, True, "a CUDA device may be present"),
        ({"gguf_runner": "torch"}, False, "--gguf-runner torch"),
        ({"dtype": "bfloat16"}, False, "runs on CPU in float32"),
        ({"device": "cuda"}, False, "runs on CPU in float32"),
        ({"model_impl": "hf"}, False, "--model-impl hf"),
    ],
)
def test_what_keeps_a_file_off_the_native_runner(
    options: dict[str, Any], cuda: bool, problem: str | None
) -> None:
    found = placement.native_config_problem(EngineConfig(**options), cuda=cuda)
    assert found is None if problem is None else problem in (found or "")


def test_a_file_runs_as_it_is_on_cpu_in_float32_only() -> None:
    assert placement.as_is_problem("m.gguf", "cpu", "float32") is None
    problem = placement.as_is_problem("m.gguf", "cuda", "bfloat16")
    assert problem is not None and "m.gguf" in problem and "--dequantize" in problem
    assert runs_gguf(torch.device("cpu"), torch.float32)
    assert not runs_gguf(torch.device("cpu"), torch.bfloat16)


def test_the_torch_path_carries_out_the_placement() -> None:
    device, dtype = resolve_device(EngineConfig(device="cpu", dtype="bf16"))
    assert (device, dtype) == (torch.device("cpu"), torch.bfloat16)


def test_the_placement_imports_without_torch() -> None:
    """The native engine decides its placement before (and without) importing torch."""
    assert_runs_without_torch("import tserve.gpu.models._placement, tserve.gpu.forward._load")
