"""Every architecture tserve's own forward pass runs, against transformers' own.

For each, a tiny random model from its transformers config is saved as a
directory and written as a GGUF file as llama.cpp's converter lays it out.
The file runs on the native runner (the C decoder), the directory on the
torch forward pass; both give transformers' eager logits on the same
weights, for a prompt run in chunks and for decode steps after it over the
paged KV pool, and an engine on either generates ``generate``'s greedy tokens.
The transformers path gives the same logits: the directory on transformers'
modules over the paged pool (``--model-impl hf``), and the file converted to
fp32 (``--dequantize``) on either forward pass. The models are
:mod:`tests.gpu.tiny_architectures`'.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.gpu.cores import generated, small_core
from tests.gpu.gguf_files import write_gguf
from tests.gpu.tiny_architectures import KINDS, build_tiny_architecture
from tserve.gpu.forward._llama import PagedLlama
from tserve.gpu.forward._native import NativeModel, NativeRunner
from tserve.gpu.forward._runner import ModelRunner
from tserve.gpu.gguf._convert import converted_gguf_dir
from tserve.gpu.gguf._file import GgufFile
from tserve.gpu.models._architectures import ARCHITECTURES, hf_architecture
from tserve.gpu.models._directory import ModelLoadError, load_model
from tserve.gpu.scheduling._sequence import ScheduledChunk, Sequence
from tserve.protocol import AddRequest, ModelImpl, SamplingParams

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
BLOCK_SIZE, NUM_BLOCKS = 4, 64


@pytest.fixture(scope="module", params=sorted(KINDS))
def model_dir(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A tiny random model of one architecture with the tiny model's tokenizer."""
    kind = request.param
    tokenizer = json.loads((tiny_model_dir / "config.json").read_text())
    out = build_tiny_architecture(
        kind,
        tmp_path_factory.mktemp(kind),
        vocab_size=tokenizer["vocab_size"],
        eos_token_id=tokenizer["eos_token_id"],
        pad_token_id=tokenizer["pad_token_id"],
    )
    for name in _TOKENIZER_FILES:
        if (tiny_model_dir / name).is_file():
            shutil.copy(tiny_model_dir / name, out / name)
    return out


def _reference(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def _prompt(length: int) -> list[int]:
    return [(i * 37 + 5) % 500 for i in range(length)]


def _chunked_logits(execute: Any, prompt: list[int], chunk: int, decodes: int) -> np.ndarray:
    """Logits after every position from ``chunk - 1`` on: the first ``len(prompt)
    - decodes`` tokens as prefill chunks of ``chunk`` (each sampled), then one
    decode step per remaining token, over blocks in reverse order."""
    seq = Sequence("s", prompt, SamplingParams())
    seq.block_table = list(range(NUM_BLOCKS))[::-1]
    prefill = len(prompt) - decodes
    rows = []
    for start in range(0, prefill, chunk):
        piece = prompt[start : min(start + chunk, prefill)]
        rows.append(np.asarray(execute([ScheduledChunk(seq, start, piece, True)])))
    for p in range(prefill, len(prompt)):
        rows.append(np.asarray(execute([ScheduledChunk(seq, p, [prompt[p]], True)])))
    return np.concatenate(rows)


def _expected(model_dir: Path, prompt: list[int], chunk: int, decodes: int) -> np.ndarray:
    """transformers' logits at the positions :func:`_chunked_logits` samples."""
    prefill = len(prompt) - decodes
    sampled = [min(s + chunk, prefill) - 1 for s in range(0, prefill, chunk)]
    sampled += list(range(prefill, len(prompt)))
    with torch.inference_mode():
        logits = _reference(model_dir)(torch.tensor([prompt])).logits[0]
    expected: np.ndarray = logits[sampled].numpy()
    return expected


def test_every_architecture_is_in_the_table(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    arch = hf_architecture(config["model_type"])
    assert arch is not None and ARCHITECTURES[arch.name] is arch


def test_a_gguf_file_on_the_native_runner_gives_transformers_logits(
    model_dir: Path, tmp_path: Path
) -> None:
    path = write_gguf(model_dir, tmp_path / "gguf" / "m.gguf", "F32")
    file = GgufFile(path, has_kernels=True)
    model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
    assert file.config.architecture is hf_architecture(model_type)
    model = NativeModel(file, cache_dir=tmp_path, progress=lambda _: None)
    runner = NativeRunner(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_tokens=5)
    prompt = _prompt(30)
    ours = _chunked_logits(runner.execute, prompt, chunk=7, decodes=6)
    np.testing.assert_allclose(ours, _expected(model_dir, prompt, 7, 6), atol=1e-4, rtol=0)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0"])
def test_a_quantized_file_runs_as_the_torch_path_s_fused_steps_bit_for_bit(
    model_dir: Path, tmp_path: Path, fmt: str
) -> None:
    """Native and torch runners on one quantized file: the same C decoder."""
    from tserve.gpu.forward._gguf import load_gguf
    from tserve.gpu.forward._quant import quant_kernels

    path = write_gguf(model_dir, tmp_path / "gguf" / f"m-{fmt}.gguf", fmt)
    file = GgufFile(path, has_kernels=True)
    native = NativeRunner(
        NativeModel(file, cache_dir=tmp_path, progress=lambda _: None, activations="int8"),
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
    )
    loaded = load_gguf(
        path, kernels=quant_kernels(), cache_dir=tmp_path, progress=lambda _: None,
        activations="int8",
    )  # fmt: skip
    torch_runner = ModelRunner(loaded.model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    prompt = _prompt(20)
    ours = _chunked_logits(native.execute, prompt, chunk=6, decodes=5)
    theirs = _chunked_logits(lambda c: torch_runner.execute(c).numpy(), prompt, 6, 5)
    assert isinstance(loaded.model, PagedLlama) and loaded.model.decoder is not None
    assert np.array_equal(ours, theirs)


@pytest.mark.parametrize("fused", [True, False], ids=["cpu-kernels", "torch-ops"])
def test_a_directory_on_the_torch_forward_pass_gives_transformers_logits(
    model_dir: Path, fused: bool
) -> None:
    from tserve.gpu.forward._step_ops import TORCH_OPS

    model, _ = load_model(model_dir, device="cpu", dtype=torch.float32)
    runner = ModelRunner(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, cpu_gemm="blas")
    assert isinstance(runner.model, PagedLlama)
    if not fused:
        runner.model.ops = TORCH_OPS
    prompt = _prompt(30)
    ours = _chunked_logits(lambda c: runner.execute(c).numpy(), prompt, chunk=7, decodes=6)
    np.testing.assert_allclose(ours, _expected(model_dir, prompt, 7, 6), atol=1e-4, rtol=0)


@pytest.mark.parametrize("impl", ["auto", "hf"])
def test_a_directory_on_transformers_modules_gives_transformers_logits(
    model_dir: Path, impl: ModelImpl
) -> None:
    """``--model-impl hf``: transformers' modules over the paged KV pool honour each
    layer's window and soft-cap (``auto``: tserve's own forward pass, as above)."""
    model, _ = load_model(model_dir, device="cpu", dtype=torch.float32)
    runner = ModelRunner(
        model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, cpu_gemm="blas", model_impl=impl
    )
    assert isinstance(runner.model, PagedLlama) is (impl == "auto")
    prompt = _prompt(30)  # past the Gemma models' 8-key windows
    ours = _chunked_logits(lambda c: runner.execute(c).numpy(), prompt, chunk=7, decodes=6)
    np.testing.assert_allclose(ours, _expected(model_dir, prompt, 7, 6), atol=1e-4, rtol=0)


def _converted(model_dir: Path, tmp_path: Path, fmt: str = "F32") -> Path:
    """The directory's model as a GGUF file, converted back by ``--dequantize``'s
    converter into a transformers directory."""
    path = write_gguf(model_dir, tmp_path / "gguf" / "m.gguf", fmt)
    return converted_gguf_dir(path, tmp_path / "cache", progress=lambda _: None)


@pytest.mark.parametrize("impl", ["auto", "hf"])
def test_dequantize_gives_transformers_logits(
    model_dir: Path, tmp_path: Path, impl: ModelImpl
) -> None:
    """A file (F32: the directory's own weights) converted to fp32 by tserve's
    plan, on tserve's forward pass and on transformers' modules, gives
    transformers' logits on the directory (Llama 3.1's RoPE scaling from the
    file's factors)."""
    model, _ = load_model(_converted(model_dir, tmp_path), device="cpu", dtype=torch.float32)
    runner = ModelRunner(
        model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, cpu_gemm="blas", model_impl=impl
    )
    prompt = _prompt(30)
    ours = _chunked_logits(lambda c: runner.execute(c).numpy(), prompt, chunk=7, decodes=6)
    np.testing.assert_allclose(ours, _expected(model_dir, prompt, 7, 6), atol=1e-4, rtol=0)


def test_dequantize_refuses_rope_factors_of_no_llama3_scaling(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Factors that no Llama 3 parameters give (a transformers config states no
    others), in one line; served as it is, the file runs."""
    factors = {"rope_freqs.weight": np.array([1, 2, 1, 2, 1, 2, 1, 2], np.float32)}
    path = write_gguf(tiny_model_dir, tmp_path / "gguf" / "m.gguf", "F32", extra_tensors=factors)
    with pytest.raises(ModelLoadError) as refused:
        converted_gguf_dir(path, tmp_path / "cache", progress=lambda _: None)
    assert str(refused.value) == (
        "m.gguf: its RoPE frequency factors ('rope_freqs.weight') are not Llama 3's scaling, "
        "which is all a transformers config states; serve it as it is (without --dequantize)"
    )
    assert list((tmp_path / "cache").iterdir()) == []  # nothing half written
    assert isinstance(small_core(path, cache_dir=str(tmp_path / "cache")).runner, NativeRunner)


def test_dequantize_gives_a_llamas_transformers_logits(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A Llama without RoPE scaling (the tiny model), as the test above."""
    model, _ = load_model(_converted(tiny_model_dir, tmp_path), device="cpu", dtype=torch.float32)
    runner = ModelRunner(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, cpu_gemm="blas")
    prompt = _prompt(20)
    ours = _chunked_logits(lambda c: runner.execute(c).numpy(), prompt, chunk=7, decodes=4)
    np.testing.assert_allclose(ours, _expected(tiny_model_dir, prompt, 7, 4), atol=1e-4, rtol=0)


@pytest.mark.parametrize("source", ["gguf", "directory"])
def test_an_engine_generates_transformers_greedy_tokens(
    model_dir: Path, tmp_path: Path, source: str
) -> None:
    """Chunked prefill (8-token steps) then decodes, on the native runner for the
    file and the torch forward pass for the directory."""
    served = write_gguf(model_dir, tmp_path / "gguf" / "m.gguf", "F32")
    core = small_core(
        served if source == "gguf" else model_dir,
        cache_dir=str(tmp_path),
        max_num_batched_tokens=8,
        max_num_seqs=2,
        block_size=4,
    )
    kind = NativeRunner if source == "gguf" else ModelRunner
    assert isinstance(core.runner, kind)
    prompt = _prompt(19)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ours = generated(core, AddRequest("r", prompt, params))
    with torch.inference_mode():
        out = _reference(model_dir).generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None
        )
    assert ours == out[0, len(prompt) :].tolist()


# llama-server's greedy continuations (llama.cpp 0.6.0-dev, ``-t 1``, temperature
# 0, ``/completion`` with ``n_predict`` 16) on the same Gemma 3 270M Q4_K_M file:
# of "The capital of France is": " the capital of the country of France. It is
# the largest city in France."; of the first 3,000 characters of
# benchmarks/sonnet.txt (789 tokens, past the 512-key window): "ry dew\nWere the
# most beautiful of all, and the most\nOf all".
_LLAMA_SERVER_GEMMA3 = {
    "The capital of France is": [
        506, 5279, 529, 506, 2891, 529, 7001, 236761, 1030, 563, 506, 7488, 3207, 528, 7001, 236761
    ],
    "sonnet": [
        824, 58343, 107, 114498, 506, 1346, 4148, 529, 784, 236764, 532, 506, 1346, 107, 4088, 784
    ],
}  # fmt: skip


def test_the_gemma3_270m_file_runs_natively_and_continues_as_llama_server(
    gemma3_gguf: Path, tmp_path: Path
) -> None:
    """The real file (Q4_K, Q6_K, Q5_0, Q8_0 and F32 tensors; 18 layers, 5 local
    of window 512 to 1 global, one KV head of 256) on the native runner, a
    short prompt and one longer than the window (in 256-token chunks). Greedy
    tokens agree with llama-server's up to where the two engines' roundings
    meet a near-tie ("capital" or "largest" after " It is the"; "," or " of"
    after "beautiful")."""
    from tokenizers import Tokenizer

    core = small_core(
        gemma3_gguf, cache_dir=str(tmp_path), gguf_activations="fp32", max_num_batched_tokens=256
    )
    assert isinstance(core.runner, NativeRunner)
    tokenizer = Tokenizer.from_file(str(core.model_path / "tokenizer.json"))
    sonnet = Path(__file__).parents[2] / "benchmarks" / "sonnet.txt"
    prompts = {
        "The capital of France is": "The capital of France is",
        "sonnet": sonnet.read_text()[:3000],
    }
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    agree = {"The capital of France is": 11, "sonnet": 7}
    for name, text in prompts.items():
        prompt = tokenizer.encode(text).ids
        assert len(prompt) == (6 if name != "sonnet" else 789)  # llama-server's counts
        ours = generated(core, AddRequest(name, prompt, params))
        assert ours[: agree[name]] == _LLAMA_SERVER_GEMMA3[name][: agree[name]]
    assert tokenizer.decode(ours).startswith("ry dew\nWere the most beautiful")
