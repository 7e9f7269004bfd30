"""tserve's own Llama-family forward pass: which models it takes, and the same logits.

Parity with ``generate`` on the tiny test models is shown through the model
runner and the engine core (test_model_runner.py, test_engine_core.py, both
paths). Here: the architectures and RoPE variants it also covers, against a
plain transformers forward over the whole sequence, and the models it leaves
on the Hugging Face path.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from tserve.gpu.forward._llama import PagedLlama, unsupported_reason
from tserve.gpu.forward._runner import ModelRunner
from tserve.gpu.forward._step_ops import TORCH_OPS
from tserve.gpu.kernels._cpu_kernels import CpuKernels
from tserve.gpu.scheduling._sequence import ScheduledChunk, Sequence
from tserve.protocol import SamplingParams

_SHAPE: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "initializer_range": 0.5,
}


def _random_model(kind: str, **overrides: Any) -> Any:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    classes: dict[str, tuple[Any, Any]] = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }
    config_class, model_class = classes[kind]
    config = config_class(**{**_SHAPE, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return model_class(config).eval()


def _prefill_then_decode(runner: ModelRunner, prompt: list[int], split: int) -> torch.Tensor:
    """Logits after positions ``split - 1 ..``: one prefill chunk, then one decode each."""
    seq = Sequence("s", prompt, SamplingParams())
    seq.block_table = list(range(len(prompt) // 4 + 1))[::-1]
    rows = [runner.execute([ScheduledChunk(seq, 0, prompt[:split], True)])]
    rows += [runner.execute([ScheduledChunk(seq, p, [prompt[p]], True)]) for p in range(split, 24)]
    return torch.cat(rows)


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True, "head_dim": 32}),  # heads * head_dim != hidden
        (
            "llama",
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 10000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                }
            },
        ),
        ("mistral", {"sliding_window": None}),
        ("qwen2", {}),  # biases on Q, K and V
    ],
    ids=["llama", "llama-tied-wide-heads", "llama3-rope", "mistral", "qwen2"],
)
@pytest.mark.parametrize("fused", [True, False], ids=["fused-kernels", "torch-only"])
def test_own_forward_matches_transformers(
    kind: str, overrides: dict[str, Any], fused: bool
) -> None:
    model = _random_model(kind, **overrides)
    reference = copy.deepcopy(model)
    assert unsupported_reason(model) is None
    runner = ModelRunner(model, num_blocks=16, block_size=4, cpu_gemm="blas")
    assert isinstance(runner.model, PagedLlama)
    assert isinstance(runner.model.ops, CpuKernels)  # the runner's choice for CPU fp32
    if not fused:
        runner.model.ops = TORCH_OPS  # the forward pass on torch alone

    prompt = [(i * 37) % 128 for i in range(24)]
    ours = _prefill_then_decode(runner, prompt, split=13)
    with torch.inference_mode():
        expected = reference(torch.tensor([prompt])).logits[0, 12:]
    # Float rounding only: fused products and a paged decode sum in other orders.
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"hidden_act": "gelu"}, "activation"),
        ({"mlp_bias": True}, "biases"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
            "RoPE type 'dynamic'",
        ),
    ],
)
def test_other_models_stay_on_the_hugging_face_path(overrides: dict[str, Any], reason: str) -> None:
    model = _random_model("llama", **overrides)
    found = unsupported_reason(model)
    assert found is not None and reason in found
    with pytest.raises(ValueError, match="cannot run"):
        PagedLlama.from_hf(model)
    runner = ModelRunner(model, num_blocks=16, block_size=4, cpu_gemm="blas")
    assert not isinstance(runner.model, PagedLlama)
    assert runner.execute([]).shape == (0, 128)


def test_hf_is_chosen_on_request() -> None:
    runner = ModelRunner(_random_model("llama"), num_blocks=16, block_size=4, model_impl="hf")
    assert not isinstance(runner.model, PagedLlama)


def test_a_step_that_samples_nothing_skips_the_head() -> None:
    runner = ModelRunner(_random_model("llama"), num_blocks=16, block_size=4, cpu_gemm="blas")
    seq = Sequence("s", list(range(10)), SamplingParams())
    seq.block_table = [0, 1, 2]
    logits = runner.execute([ScheduledChunk(seq, 0, seq.prompt_token_ids, False)])
    assert logits.shape == (0, 128) and logits.dtype == torch.float32


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_on_cuda_stays_close_to_transformers() -> None:
    model = _random_model("llama", initializer_range=0.02)
    reference = copy.deepcopy(model).to(device="cuda", dtype=torch.bfloat16)
    runner = ModelRunner(model, num_blocks=16, block_size=4, device="cuda", dtype=torch.bfloat16)
    assert isinstance(runner.model, PagedLlama)
    prompt = [(i * 37) % 128 for i in range(24)]
    ours = _prefill_then_decode(runner, prompt, split=13)
    with torch.inference_mode():
        expected = reference(torch.tensor([prompt], device="cuda")).logits[0, 12:].float()
    torch.testing.assert_close(ours, expected, atol=5e-2, rtol=5e-2)
