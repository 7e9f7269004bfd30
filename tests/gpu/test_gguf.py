"""GGUF files served as they are, against the same files dequantized by transformers.

The files are written by the tests (``gguf_files.write_gguf``: the ``gguf``
package's writer and quantizers) from the tiny test models. The reference is
transformers' own GGUF loader, which dequantizes every tensor to fp32 and
undoes the converter's Q/K permutation: an implementation independent of
tserve's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.gpu.cores import generated, small_core
from tests.gpu.gguf_files import build_wide_model, write_gguf
from tserve.gpu.engine._engine_core import EngineCore
from tserve.gpu.forward._gguf import Concat, load_gguf
from tserve.gpu.forward._llama import PagedLlama
from tserve.gpu.forward._quant import QuantizedEmbedding, QuantizedLinear, quant_kernels
from tserve.gpu.forward._runner import ModelRunner
from tserve.gpu.kernels._quant_abi import K_FORMATS
from tserve.gpu.models._directory import ModelLoadError, default_cache_root, default_gguf
from tserve.gpu.scheduling._sequence import ScheduledChunk, Sequence
from tserve.protocol import AddRequest, SamplingParams


def _load(path: Path, tmp_path: Path) -> Any:
    return load_gguf(path, kernels=quant_kernels(), cache_dir=tmp_path, progress=lambda _: None)


def _reference(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def _logits(runner: ModelRunner, prompt: list[int], split: int) -> torch.Tensor:
    """Logits after positions ``split - 1 ..``: one prefill chunk, then one decode each."""
    seq = Sequence("s", prompt, SamplingParams())
    seq.block_table = list(range(len(prompt) // 4 + 1))[::-1]
    rows = [runner.execute([ScheduledChunk(seq, 0, prompt[:split], True)])]
    rows += [
        runner.execute([ScheduledChunk(seq, p, [prompt[p]], True)])
        for p in range(split, len(prompt))
    ]
    return torch.cat(rows)


def _logits_and_fp32_conversion_s(
    model: torch.nn.Module, path: Path, prompt: list[int], split: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``model``'s logits (:func:`_logits`) and transformers' on ``path`` dequantized
    to fp32, after the same positions; asserted close: the weights are the same
    values, only the order of fp32 sums differs."""
    ours = _logits(ModelRunner(model, num_blocks=16, block_size=4), prompt, split)
    with torch.inference_mode():
        expected = _reference(path)(torch.tensor([prompt])).logits[0, split - 1 :]
    torch.testing.assert_close(ours, expected, atol=2e-3, rtol=1e-4)
    return ours, expected


@pytest.mark.parametrize("fmt", ["Q4_1", "Q4_0", "Q8_0", "F16", "BF16", "F32"])
def test_a_gguf_runs_in_its_format_with_the_logits_of_its_fp32_conversion(
    smollm2_tiny_dir: Path, tmp_path: Path, fmt: str
) -> None:
    """SmolLM2's layout (tied output head, 3:1 GQA), every weight in ``fmt``."""
    path = write_gguf(smollm2_tiny_dir, tmp_path / "gguf" / f"tiny-{fmt}.gguf", fmt)
    loaded = _load(path, tmp_path)
    assert loaded.tokenizer_dir == path.parent  # the files beside it
    linears = [m for m in loaded.model.modules() if isinstance(m, QuantizedLinear)]
    if fmt == "F32":
        assert not linears and isinstance(loaded.model.embed, torch.nn.Embedding)
    else:
        assert len(linears) == 2 * 4 + 1 and isinstance(loaded.model.embed, QuantizedEmbedding)
        # The tied head reads the embedding's bytes where they lie: no copy.
        head = loaded.model.lm_head
        assert isinstance(head, QuantizedLinear)
        assert head.weight_q.data.data_ptr() == loaded.model.embed.weight_q.data.data_ptr()
    prompt = [(i * 37) % 512 for i in range(24)]
    ours, expected = _logits_and_fp32_conversion_s(loaded.model, path, prompt, split=13)
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


class _Rounded(torch.nn.Module):
    """A linear layer whose input is first rounded as the int8 kernels round it:
    per block of 32, to multiples of its largest magnitude / 127, with their
    float operations (times 127 / that magnitude, rounded half to even: a
    division by the step instead rounds some elements the other way)."""

    def __init__(self, linear: torch.nn.Module) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(_rounded(x))
        return out


def _rounded(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """``x`` rounded to 8 bits per ``block`` values, as an int8 kernel rounds its
    input (32: the block formats'; 256: llama.cpp's q8_K, the K-quants')."""
    blocks = x.reshape(x.shape[0], -1, block)
    top = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(top > 0, 127 / top, 0)
    return (torch.round(blocks * inverse) * (top / 127)).reshape(x.shape)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_int8_activations_are_the_model_with_its_activations_rounded(
    smollm2_tiny_dir: Path, tmp_path: Path, fmt: str
) -> None:
    """Every product on the packed int8 kernel (no tuning: one row or many alike)
    against the same file on fp32 activations with each product's input rounded
    to 8 bits per block: the integer sums are exact, so only float rounding
    differs. (A random tiny model is far more sensitive to the rounding than a
    trained one: its logits move by about 9 %.)"""
    path = write_gguf(smollm2_tiny_dir, tmp_path / "gguf" / f"tiny-{fmt}.gguf", fmt)
    logits = []
    for activations in ("int8", "fp32"):
        loaded = load_gguf(
            path, kernels=quant_kernels(), cache_dir=tmp_path, progress=lambda _: None,
            activations=activations,
        )  # fmt: skip
        model = loaded.model
        linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
        assert linears and {linear.activations for linear in linears} == {activations}
        # The tied embedding reads its rows from the head's bytes (packed for int8).
        head = model.lm_head
        assert isinstance(model.embed, QuantizedEmbedding) and isinstance(head, QuantizedLinear)
        assert model.embed.weight_q.data.data_ptr() == head.weight_q.data.data_ptr()
        runner = ModelRunner(model, num_blocks=16, block_size=4)
        for linear in linears:
            linear.kernel_rows = None
        if activations == "fp32":
            for layer in model.layers:
                for name in ("qkv", "o", "gate_up", "down"):
                    setattr(layer, name, _Rounded(getattr(layer, name)))
            model.lm_head = _Rounded(model.lm_head)
        logits.append(_logits(runner, [(i * 37) % 512 for i in range(24)], split=13))
    ours, expected = logits
    torch.testing.assert_close(ours, expected, atol=2e-4, rtol=1e-4)


def test_layers_of_mixed_formats_and_an_untied_head(tiny_model_dir: Path, tmp_path: Path) -> None:
    """K in Q8_0 beside Q and V in Q4_1 cannot be one weight: they run side by side."""
    formats = {f"blk.{i}.attn_k.weight": "Q8_0" for i in range(2)} | {"output.weight": "Q8_0"}
    path = write_gguf(tiny_model_dir, tmp_path / "gguf" / "mixed.gguf", "Q4_1", formats=formats)
    loaded = _load(path, tmp_path)
    assert loaded.formats == {"F32": 5, "Q4_1": 1 + 2 * 6, "Q8_0": 3}
    layer = loaded.model.layers[0]
    assert isinstance(layer.qkv, Concat) and isinstance(layer.gate_up, QuantizedLinear)
    _logits_and_fp32_conversion_s(loaded.model, path, [(i * 11) % 512 for i in range(20)], split=7)


@pytest.fixture(scope="module")
def wide_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wide_model(tiny_model_dir, tmp_path_factory.mktemp("wide-model"))


_Q4_K_M: dict[str, str] = {
    "token_embd.weight": "Q4_K",
    "output.weight": "Q6_K",
    "blk.0.attn_v.weight": "Q6_K",
    "blk.0.ffn_down.weight": "Q6_K",
    "blk.1.attn_output.weight": "Q5_K",
    "blk.1.ffn_up.weight": "Q5_K",
}
"""llama.cpp's Q4_K_M mix in small: Q4_K, with Q6_K for the head and some V and
down weights (and here a few Q5_K)."""


def test_a_k_quant_gguf_runs_in_its_formats_with_the_logits_of_its_fp32_conversion(
    wide_model_dir: Path, tmp_path: Path
) -> None:
    path = write_gguf(wide_model_dir, tmp_path / "gguf" / "wide.gguf", "Q4_K", formats=_Q4_K_M)
    loaded = _load(path, tmp_path)
    assert loaded.formats == {"F32": 5, "Q4_K": 11, "Q5_K": 2, "Q6_K": 3}
    assert isinstance(loaded.model.layers[0].qkv, Concat)  # V is Q6_K beside Q4_K Q and K
    assert isinstance(loaded.model.embed, QuantizedEmbedding)
    prompt = [(i * 29) % 512 for i in range(22)]
    ours, expected = _logits_and_fp32_conversion_s(loaded.model, path, prompt, split=11)
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def test_int8_activations_on_k_quants_round_each_product_s_input(
    wide_model_dir: Path, tmp_path: Path
) -> None:
    """The Q4_K_M mix on int8 activations: every product of a forward pass (the
    K-quant int8 kernel on its packed panels) is the fp32 product of its own
    input rounded to 8 bits per block (of 256 for a K-quant weight, q8_K; of
    32 for the others), the integer sums being exact. (Per
    product: over the whole model, float rounding of one layer's output flips
    some roundings of the next one's input.)"""
    path = write_gguf(wide_model_dir, tmp_path / "gguf" / "wide.gguf", "Q4_K", formats=_Q4_K_M)
    kernels = quant_kernels()
    assert kernels is not None
    loaded = load_gguf(
        path, kernels=kernels, cache_dir=tmp_path, progress=lambda _: None, activations="int8"
    )
    linears = [m for m in loaded.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 11  # Q and K of layer 0 apart from V, gate and up of layer 1
    assert {linear.activations for linear in linears} == {"int8"}
    runner = ModelRunner(loaded.model, num_blocks=16, block_size=4)
    runner._fused_tokens = 0  # op by op, so that each product's module runs (and is hooked)
    seen: list[tuple[QuantizedLinear, torch.Tensor, torch.Tensor]] = []
    hooks = []
    for linear in linears:
        linear.kernel_rows = None  # the kernel at every row count (no dequantized route)
        # copies: the step goes on to write in place (RoPE on the Q and K outputs)
        hook = linear.register_forward_hook(
            lambda m, a, y: seen.append((m, a[0].clone(), y.clone()))
        )
        hooks.append(hook)
    _logits(runner, [(i * 29) % 512 for i in range(22)], split=11)
    for hook in hooks:
        hook.remove()
    assert {id(m) for m, _, _ in seen} == {id(m) for m in linears}
    with torch.inference_mode():
        for module, x, y in seen:
            block = 256 if module.weight_q.fmt in K_FORMATS else 32
            expected = F.linear(_rounded(x, block), kernels.dequantize(module.weight_q))
            assert float((y - expected).norm() / expected.norm()) < 1e-5


def test_the_engine_serves_a_k_quant_file_as_its_fp32_conversion_would(
    wide_model_dir: Path, tmp_path: Path
) -> None:
    """With fp32 activations, as the Q4_1 test above."""
    path = write_gguf(wide_model_dir, tmp_path / "gguf" / "wide.gguf", "Q4_K", formats=_Q4_K_M)
    native = small_core(path, cache_dir=str(tmp_path / "cache"), gguf_activations="fp32")
    converted = small_core(path, cache_dir=str(tmp_path / "cache"), dequantize=True)
    prompt = [(i * 17) % 512 for i in range(9)]
    assert _greedy(native, prompt, 12) == _greedy(converted, prompt, 12)


def test_a_format_without_a_kernel_is_an_error_naming_the_tensor(
    wide_model_dir: Path, tmp_path: Path
) -> None:
    formats = {"blk.1.attn_q.weight": "TQ1_0"}  # ternary: no kernel
    path = write_gguf(wide_model_dir, tmp_path / "gguf" / "tq.gguf", "Q8_0", formats=formats)
    with pytest.raises(ModelLoadError, match=r"'blk\.1\.attn_q\.weight' is TQ1_0.*--dequantize"):
        _load(path, tmp_path)


def test_another_architecture_is_an_error_naming_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = write_gguf(tiny_model_dir, tmp_path / "gguf" / "m.gguf", "Q8_0", architecture="mamba")
    with pytest.raises(ModelLoadError) as raised:
        _load(path, tmp_path)
    message = str(raised.value)
    assert "\n" not in message
    supported = "llama, qwen2, qwen3, phi3, gemma2, gemma3"
    assert message == f"m.gguf: architecture 'mamba' is not supported; tserve runs {supported}"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"rope_dimensions": 8},
            r"^q\.gguf: RoPE on 8 of each head's 16 dimensions \(partial rotary\) is not one",
        ),
        (
            {"extra_tensors": {"rope_factors_long.weight": np.ones(8, np.float32)}},
            r"^q\.gguf: its RoPE scaling is not one tserve reads from GGUF",
        ),
        (
            {"extra_tensors": {"rope_freqs.weight": np.ones(3, np.float32)}},
            r"^q\.gguf: 'rope_freqs\.weight' holds 3 factors, not one F32 factor for each of its 8",
        ),
    ],
    ids=["partial-rotary", "longrope", "rope-freqs-length"],
)
def test_a_rope_tserve_cannot_run_is_one_line_naming_it(
    tiny_model_dir: Path, tmp_path: Path, extra: dict[str, Any], message: str
) -> None:
    path = write_gguf(tiny_model_dir, tmp_path / "gguf" / "q.gguf", "Q8_0", **extra)
    with pytest.raises(ModelLoadError, match=message) as raised:
        _load(path, tmp_path)
    assert "\n" not in str(raised.value)


def _greedy(core: EngineCore, prompt: list[int], n: int) -> list[int]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return generated(core, AddRequest("r", prompt, params))


def test_the_engine_serves_a_gguf_file_as_its_fp32_conversion_would(
    smollm2_tiny_dir: Path, tmp_path: Path
) -> None:
    """With fp32 activations (int8 ones round them: their own test is below)."""
    path = write_gguf(smollm2_tiny_dir, tmp_path / "gguf" / "tiny.gguf", "Q4_1")
    native = small_core(
        path, cache_dir=str(tmp_path / "cache"), gguf_activations="fp32", gguf_runner="torch"
    )
    assert isinstance(native.runner, ModelRunner) and isinstance(native.runner.model, PagedLlama)
    assert native.model_path == path.parent.resolve() and native.model_name == "tiny.gguf"
    converted = small_core(path, cache_dir=str(tmp_path / "cache"), dequantize=True)
    [converted_dir] = (tmp_path / "cache").glob("tiny-fp32-*")
    assert (converted_dir / "config.json").is_file()
    prompt = [(i * 13) % 512 for i in range(9)]
    assert _greedy(native, prompt, 12) == _greedy(converted, prompt, 12)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_the_default_model_runs_quantized_and_knows_paris(
    tmp_path: Path, kv_dtype: torch.dtype
) -> None:
    """The bundled Q4_1 file, its tokenizer from its metadata (converted once), on
    fp32 activations (int8 ones can flip this near-tie: tserve/gpu/forward/_quant.py),
    over a KV cache of each dtype."""
    from transformers import AutoTokenizer

    loaded = load_gguf(
        default_gguf(),
        kernels=quant_kernels(),
        cache_dir=tmp_path,
        progress=lambda _: None,
        activations="fp32",
    )
    assert loaded.formats == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert loaded.tokenizer_dir.parent == tmp_path / "gguf-tokenizers"
    tokenizer: Any = AutoTokenizer.from_pretrained(loaded.tokenizer_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_dict=True,
    )["input_ids"]
    runner = ModelRunner(loaded.model, num_blocks=8, block_size=16, kv_dtype=kv_dtype)
    assert runner.pool.k.dtype == kv_dtype
    seq = Sequence("s", list(prompt), SamplingParams())
    seq.block_table = list(range(8))
    tokens = list(prompt)
    logits = runner.execute([ScheduledChunk(seq, 0, tokens, True)])
    answer: list[int] = []
    for _ in range(8):
        answer.append(int(logits[-1].argmax()))
        logits = runner.execute([ScheduledChunk(seq, len(tokens), [answer[-1]], True)])
        tokens.append(answer[-1])
    assert tokenizer.decode(answer).startswith("The capital of France is Paris")
    assert default_cache_root() != tmp_path  # nothing written outside the test's directory


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_engine_process_of_the_installed_package_serves_a_quantized_file(
    smollm2_tiny_dir: Path, tmp_path: Path
) -> None:
    """Q4_1 weights load only through the compiled kernels: the engine process
    (a fresh interpreter) finds them, and answers as the in-process core does."""
    import anyio

    from tserve.nursery import open_llm

    path = write_gguf(smollm2_tiny_dir, tmp_path / "gguf" / "tiny.gguf", "Q4_1")
    prompt = [(i * 13) % 512 for i in range(9)]
    expected = _greedy(small_core(path, cache_dir=str(tmp_path)), prompt, 8)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with anyio.fail_after(300):
        async with open_llm(
            path, log_level="WARNING", cache_dir=str(tmp_path), kv_cache_dtype="fp32"
        ) as llm:
            assert llm.ready.model == "tiny.gguf"
            assert llm.ready.model_path == str(path.parent.resolve())
            assert (await llm.complete(prompt, params)).token_ids == expected
