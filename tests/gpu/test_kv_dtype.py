"""The KV cache in fp16 and bf16 (``--kv-cache-dtype``): what it stores, what it changes.

The pool holds the dtype itself (its tensors are fp16/bf16, half the bytes
of fp32), on tserve's own forward pass with the fused CPU kernels, on its
torch calls, on the Hugging Face modules, and on a GGUF file served as it
is. Rounding K and V changes the logits by a bounded amount (stated below),
in fp16 changes no greedy token of a short prompt, and, because attention
always sees K/V as the pool holds them, chunking, a cached prefix and a
recomputation after preemption change no token at all. A byte budget holds
twice the tokens in half the bytes.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gpu.cores import small_core
from tests.gpu.gguf_files import write_gguf
from tests.gpu.test_prefix_cache import _run
from tserve.gpu.forward._gguf import load_gguf
from tserve.gpu.forward._llama import PagedLlama
from tserve.gpu.forward._quant import quant_kernels
from tserve.gpu.forward._runner import ModelRunner, resolve_kv_dtype
from tserve.gpu.forward._step_ops import TORCH_OPS
from tserve.gpu.models._directory import load_model
from tserve.gpu.scheduling._sequence import ScheduledChunk, Sequence
from tserve.protocol import AddRequest, SamplingParams

VOCAB = 512  # the tiny models'
PEER = b"api-1"
KV_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# Teacher-forced logits of a KV cache in `dtype` stay within ERROR_EPS * eps(dtype)
# of fp32's. The tiny random models amplify rounding (logits of std ~4-5 from
# activations that are not trained to be small): measured ~60 eps for fp16 and
# ~110 for bf16 over 20 decodes; the bound leaves room for that.
ERROR_EPS = 200
PROMPT_LEN, DECODES = 12, 20


def _tf_logits(runner: ModelRunner, prompt: list[int], forced: list[int]) -> torch.Tensor:
    """Logits after the prompt (one prefill chunk) and after each of ``forced``
    (one decode each): ``[1 + len(forced), vocab]``. Blocks in reverse order."""
    seq = Sequence("s", prompt, SamplingParams())
    seq.block_table = list(range(runner.num_blocks))[::-1]
    rows = [runner.execute([ScheduledChunk(seq, 0, prompt, True)])]
    for i, token in enumerate(forced):
        rows.append(runner.execute([ScheduledChunk(seq, len(prompt) + i, [token], True)]))
    return torch.cat(rows)


def _greedy_reference(runner: ModelRunner, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    """fp32's own greedy run: its logits and the tokens it chose (fed to the others)."""
    seq = Sequence("ref", prompt, SamplingParams())
    seq.block_table = list(range(runner.num_blocks))[::-1]
    rows = [runner.execute([ScheduledChunk(seq, 0, prompt, True)])]
    tokens = [int(rows[-1].argmax())]
    for i in range(DECODES):
        rows.append(runner.execute([ScheduledChunk(seq, len(prompt) + i, tokens[-1:], True)]))
        tokens.append(int(rows[-1].argmax()))
    return torch.cat(rows), tokens[:-1]


def _assert_close_to_fp32(reference: torch.Tensor, ours: torch.Tensor, dtype: torch.dtype) -> float:
    """Within the bound; returns the error."""
    bound = ERROR_EPS * torch.finfo(dtype).eps
    error = float((ours - reference).abs().max())
    assert error <= bound, f"{dtype}: logits off by {error:.3g} > {bound:.3g}"
    return error


def _runner(model_dir: Path, model_impl: Any, kv_dtype: torch.dtype) -> ModelRunner:
    model, _ = load_model(model_dir, device="cpu", dtype=torch.float32)
    return ModelRunner(
        model, num_blocks=16, block_size=4, kv_dtype=kv_dtype, model_impl=model_impl,
        cpu_gemm="blas",
    )  # fmt: skip


@pytest.mark.parametrize("model_impl", ["auto", "hf"])
def test_the_pool_stores_the_dtype_and_the_logits_stay_within_the_bound(
    smollm2_tiny_dir: Path, model_impl: str
) -> None:
    """tserve's forward pass (fused kernels) and transformers' modules (torch's
    casts), SmolLM2's layout (3:1 GQA, tied head); bf16 rounds more than fp16."""
    rng = random.Random(3)
    prompt = [rng.randrange(VOCAB) for _ in range(PROMPT_LEN)]
    reference, forced = _greedy_reference(
        _runner(smollm2_tiny_dir, model_impl, torch.float32), prompt
    )
    errors = {}
    for name, dtype in KV_DTYPES.items():
        runner = _runner(smollm2_tiny_dir, model_impl, dtype)
        assert runner.pool.k.dtype == runner.pool.v.dtype == dtype
        assert runner.pool.k.element_size() == 2
        logits = _tf_logits(runner, prompt, forced)
        if name == "fp16":  # its own greedy choices are fp32's; bf16's may part
            assert _greedy_reference(runner, prompt)[1] == forced
        # The sequence's 32 positions went to the last 8 blocks (its table runs backwards).
        assert runner.pool.k[:, :, 32:].count_nonzero() > 0
        assert not runner.pool.k[:, :, :32].any() and not runner.pool.v[:, :, :32].any()
        errors[name] = _assert_close_to_fp32(reference, logits, dtype)
    assert 0 < errors["fp16"] < errors["bf16"]


@pytest.mark.parametrize("kv", list(KV_DTYPES))
def test_the_fused_kernels_and_torch_agree_over_the_same_pool(
    smollm2_tiny_dir: Path, kv: str
) -> None:
    """The kernels widen and round K/V exactly as torch's casts do: the two paths
    differ only by fp32 summation order, which can tip a K/V value by one step
    of the dtype (checked on the pools below). Their logits then differ by a
    small part of what the dtype's rounding moves them from an fp32 pool's,
    whatever the machine's fp32 kernels (a rounding of its own, truncation
    say, would differ by about as much as the rounding itself)."""
    rng = random.Random(4)
    prompt = [rng.randrange(VOCAB) for _ in range(PROMPT_LEN)]
    forced = [rng.randrange(VOCAB) for _ in range(DECODES)]
    fused = _runner(smollm2_tiny_dir, "auto", KV_DTYPES[kv])
    torch_calls = _runner(smollm2_tiny_dir, "auto", KV_DTYPES[kv])
    assert isinstance(torch_calls.model, PagedLlama) and torch_calls.model.ops is not TORCH_OPS
    torch_calls.model.ops = TORCH_OPS
    fused_logits = _tf_logits(fused, prompt, forced)
    torch_logits = _tf_logits(torch_calls, prompt, forced)
    reference = _tf_logits(_runner(smollm2_tiny_dir, "auto", torch.float32), prompt, forced)
    rounding = float((fused_logits - reference).abs().max())
    assert rounding > 0
    apart = float((fused_logits - torch_logits).abs().max())
    assert apart <= 0.1 * rounding, f"{kv}: paths {apart:.3g} apart, rounding {rounding:.3g}"
    for ours, theirs in ((fused.pool.k, torch_calls.pool.k), (fused.pool.v, torch_calls.pool.v)):
        assert ours.dtype == theirs.dtype == KV_DTYPES[kv]
        # One rounding step of the dtype at most, where fp32 summation order tips it.
        ulp = torch.finfo(KV_DTYPES[kv]).eps * theirs.float().abs().clamp(min=1)
        assert bool(((ours.float() - theirs.float()).abs() <= ulp).all())


@pytest.mark.parametrize("kv", list(KV_DTYPES))
def test_a_gguf_served_as_it_is_with_a_half_precision_cache(
    smollm2_tiny_dir: Path, tmp_path: Path, kv: str
) -> None:
    """Quantized weights (tserve's kernels) over an fp16/bf16 pool."""
    path = write_gguf(smollm2_tiny_dir, tmp_path / "gguf" / "tiny-Q8_0.gguf", "Q8_0")

    def runner(kv_dtype: torch.dtype) -> ModelRunner:
        loaded = load_gguf(
            path, kernels=quant_kernels(), cache_dir=tmp_path, progress=lambda _: None
        )
        return ModelRunner(loaded.model, num_blocks=16, block_size=4, kv_dtype=kv_dtype)

    rng = random.Random(5)
    prompt = [rng.randrange(VOCAB) for _ in range(PROMPT_LEN)]
    reference, forced = _greedy_reference(runner(torch.float32), prompt)
    half = runner(KV_DTYPES[kv])
    assert half.pool.k.dtype == KV_DTYPES[kv]
    _assert_close_to_fp32(reference, _tf_logits(half, prompt, forced), KV_DTYPES[kv])
    if kv == "fp16":
        assert _greedy_reference(half, prompt)[1] == forced


def test_auto_is_the_models_dtype() -> None:
    assert resolve_kv_dtype("auto", torch.float32) == torch.float32
    assert resolve_kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_dtype("bf16", torch.float32) == torch.bfloat16
    assert resolve_kv_dtype("fp16", torch.bfloat16) == torch.float16


# -------------------------------------------------------------------------- the engine


def test_a_byte_budget_holds_twice_the_tokens_at_half_the_bytes(tiny_model_dir: Path) -> None:
    """2 (K, V) x 2 layers x 2 KV heads x 16 dims: 512 bytes a token in fp32."""
    budget = 512 * 16 * 40  # 40 blocks of 16 fp32 tokens
    cores = {
        kv: small_core(tiny_model_dir, kv_cache_memory_bytes=budget, kv_cache_dtype=kv)
        for kv in ("fp32", "fp16", "bf16")
    }
    assert {kv: core.blocks.num_blocks for kv, core in cores.items()} == {
        "fp32": 40, "fp16": 80, "bf16": 80,
    }  # fmt: skip
    for kv, core in cores.items():
        assert isinstance(core.runner, ModelRunner)
        pool = core.runner.pool
        assert pool.k.dtype == {"fp32": torch.float32, **KV_DTYPES}[kv]
        assert pool.k.nbytes + pool.v.nbytes == budget
        assert core.ready_info().kv_tokens_total == core.blocks.num_blocks * 16
        assert core.stats().kv_tokens_total == core.blocks.num_blocks * 16
    # A budget in tokens is the same number of tokens in either dtype, in fewer bytes.
    tokens = {
        kv: small_core(tiny_model_dir, kv_cache_tokens=1024, kv_cache_dtype=kv)
        for kv in ("fp32", "fp16")
    }
    assert tokens["fp32"].blocks.num_blocks == tokens["fp16"].blocks.num_blocks == 64
    fp32, fp16 = tokens["fp32"].runner, tokens["fp16"].runner
    assert isinstance(fp32, ModelRunner) and isinstance(fp16, ModelRunner)
    assert fp16.pool.k.nbytes * 2 == fp32.pool.k.nbytes


def test_a_byte_budget_below_one_block_is_an_error_naming_it(tiny_model_dir: Path) -> None:
    with pytest.raises(
        ValueError, match=r"kv_cache_memory_bytes \(4095\).*16 tokens \(4096 bytes\)"
    ):
        small_core(tiny_model_dir, kv_cache_memory_bytes=4095, kv_cache_dtype="fp16")


def _requests(rng: random.Random, n: int) -> list[AddRequest]:
    """Prompts of a few shared system prompts (or none) and a tail of their own."""
    systems = [[rng.randrange(VOCAB) for _ in range(k)] for k in (16, 40, 75)]
    requests = []
    for i in range(n):
        tail = [rng.randrange(VOCAB) for _ in range(rng.choice([1, 3, 9, 17, 33]))]
        params = SamplingParams(max_tokens=rng.randint(2, 24), temperature=0, ignore_eos=True)
        requests.append(AddRequest(f"r{i}", rng.choice([[], *systems]) + tail, params))
    return requests


def test_fp16_prefix_caching_and_preemption_change_no_token(tiny_model_dir: Path) -> None:
    """One fp16 workload three ways: the prefix cache off, on, and on under a
    budget tight enough to preempt and recompute. Chunked prefills (64-token
    steps) split the longer prompts as well."""
    requests = _requests(random.Random(6), 40)
    settings: dict[str, Any] = {"kv_cache_dtype": "fp16", "max_num_seqs": 16}
    off = small_core(tiny_model_dir, enable_prefix_caching=False, **settings)
    on = small_core(tiny_model_dir, enable_prefix_caching=True, **settings)
    tight = small_core(tiny_model_dir, kv_cache_tokens=256, **settings)
    assert isinstance(off.runner, ModelRunner) and isinstance(on.runner, ModelRunner)
    assert off.runner.pool.k.dtype == on.runner.pool.k.dtype == torch.float16

    expected = _run(off, requests, concurrency=16)
    assert _run(on, requests, concurrency=16) == expected
    assert on.stats().prefix_cache_hits > 0
    assert _run(tight, requests, concurrency=16) == expected
    assert tight.scheduler.num_preemptions > 0
    for core in (off, on, tight):
        assert core.stats().kv_tokens_used == 0
        core.blocks.check([])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv", ["fp16", "fp32"])
def test_a_cuda_cache_of_another_dtype_than_the_models(smollm2_tiny_dir: Path, kv: str) -> None:
    """bf16 weights on CUDA over an fp16 or fp32 pool (torch's casts both ways)."""
    model, _ = load_model(smollm2_tiny_dir, device="cpu", dtype=torch.float32)
    kv_dtype = {"fp32": torch.float32, **KV_DTYPES}[kv]
    runner = ModelRunner(
        model, num_blocks=16, block_size=4, device="cuda", dtype=torch.bfloat16, kv_dtype=kv_dtype
    )
    assert runner.pool.k.dtype == kv_dtype and runner.pool.k.device.type == "cuda"
    same, _ = load_model(smollm2_tiny_dir, device="cpu", dtype=torch.float32)
    bf16 = ModelRunner(same, num_blocks=16, block_size=4, device="cuda", dtype=torch.bfloat16)
    assert bf16.pool.k.dtype == torch.bfloat16
    rng = random.Random(7)
    prompt = [rng.randrange(VOCAB) for _ in range(PROMPT_LEN)]
    forced = [rng.randrange(VOCAB) for _ in range(DECODES)]
    ours, theirs = _tf_logits(runner, prompt, forced), _tf_logits(bf16, prompt, forced)
    bound = ERROR_EPS * torch.finfo(torch.bfloat16).eps  # the bf16 model's own rounding
    assert float((ours - theirs).abs().max()) <= bound
