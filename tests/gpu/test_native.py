"""The native runner (numpy and the C kernels, no torch) against the torch path
on the same GGUF file.

Both run a short step on the same kernels in the same order (the fused
decoder, the final norm, the head's product), so their logits agree bit for
bit; a step longer than one fused call splits into several there, the split
changing no bit of attention, while the torch path runs it op by op (SDPA,
and dequantized weights where a product is tuned to): those agree up to
float rounding.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.gpu.cores import generated, small_core
from tests.gpu.gguf_files import build_wide_model, write_gguf
from tserve.engine_config import default_threads
from tserve.gpu.engine._engine_core import EngineCore
from tserve.gpu.forward._gguf import load_gguf
from tserve.gpu.forward._native import NativeModel, NativeRunner, native_problem
from tserve.gpu.forward._quant import Activations, quant_kernels
from tserve.gpu.forward._runner import ModelRunner
from tserve.gpu.gguf._file import GgufFile
from tserve.gpu.kernels._decoder_abi import MAX_FUSED_TOKENS
from tserve.gpu.scheduling._sequence import ScheduledChunk, Sequence
from tserve.protocol import AddRequest, SamplingParams

KV_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BLOCK_SIZE, NUM_BLOCKS = 4, 96


def _runners(
    path: Path,
    tmp_path: Path,
    activations: Activations,
    kv: str,
    max_tokens: int = MAX_FUSED_TOKENS,
) -> tuple[NativeRunner, ModelRunner]:
    file = GgufFile(path, has_kernels=True)
    native = NativeModel(file, cache_dir=tmp_path, progress=lambda _: None, activations=activations)
    loaded = load_gguf(
        path,
        kernels=quant_kernels(),
        cache_dir=tmp_path,
        progress=lambda _: None,
        activations=activations,
    )
    return (
        NativeRunner(
            native, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, kv_dtype=kv, max_tokens=max_tokens
        ),
        ModelRunner(
            loaded.model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, kv_dtype=KV_DTYPES[kv]
        ),
    )


def _sequences() -> tuple[Sequence, Sequence]:
    """Two sequences whose blocks interleave, in reverse order."""
    blocks = list(range(NUM_BLOCKS))[::-1]
    a, b = Sequence("a", [], SamplingParams()), Sequence("b", [], SamplingParams())
    a.block_table, b.block_table = blocks[0::2], blocks[1::2]
    return a, b


def _mixed_steps() -> list[list[ScheduledChunk]]:
    """Chunked prefill beside decodes, then decodes, every step of at most 15
    tokens (a product is never tuned to dequantize below 16 rows, so the torch
    path runs each on its fused decoder)."""
    a, b = _sequences()
    tokens = [(i * 37 + 11) % 512 for i in range(40)]
    steps = [
        [ScheduledChunk(a, 0, tokens[:5], False), ScheduledChunk(b, 0, tokens[20:23], True)],
        [ScheduledChunk(a, 5, tokens[5:9], True), ScheduledChunk(b, 3, [tokens[23]], True)],
    ]
    for i in range(5):
        steps.append(
            [
                ScheduledChunk(a, 9 + i, [tokens[9 + i]], True),
                ScheduledChunk(b, 4 + i, [tokens[24 + i]], True),
            ]
        )
    return steps


@pytest.mark.parametrize(
    ("fmt", "activations"), [("Q4_1", "int8"), ("Q8_0", "int8"), ("Q4_0", "fp32"), ("F16", "fp32")]
)
@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
def test_native_steps_are_the_torch_path_s_fused_steps_bit_for_bit(
    smollm2_tiny_dir: Path, tmp_path: Path, fmt: str, activations: Activations, kv: str
) -> None:
    path = write_gguf(smollm2_tiny_dir, tmp_path / "gguf" / f"tiny-{fmt}.gguf", fmt)
    native, torch_runner = _runners(path, tmp_path, activations, kv)
    for chunks in _mixed_steps():
        ours = native.execute(chunks)
        expected = torch_runner.execute(chunks)
        assert ours.dtype == np.float32 and ours.shape == tuple(expected.shape)
        assert np.array_equal(ours, expected.numpy())


def test_a_k_quant_file_of_one_format_per_product_runs_natively(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Q4_K layers (int8 on their packed panels) and a Q6_K head: the K-quant routes."""
    wide = build_wide_model(tiny_model_dir, tmp_path / "wide")
    formats = {"output.weight": "Q6_K"}
    path = write_gguf(wide, tmp_path / "gguf" / "wide.gguf", "Q4_K", formats=formats)
    native, torch_runner = _runners(path, tmp_path, "int8", "fp32")
    for chunks in _mixed_steps():
        assert np.array_equal(native.execute(chunks), torch_runner.execute(chunks).numpy())


def test_a_step_longer_than_a_fused_call_splits_and_matches_the_torch_path(
    smollm2_tiny_dir: Path, tmp_path: Path
) -> None:
    """A 200-token prompt in one step: four fused calls of at most 64 tokens here.
    Against the torch path fed the same prompt in 8-token steps (each on its
    fused decoder): bit for bit (a prefill attends as one causal block, whose
    rows do not depend on the split); against its own 200-token step (op by
    op): up to float rounding."""
    path = write_gguf(smollm2_tiny_dir, tmp_path / "gguf" / "tiny.gguf", "Q4_1")
    native, chunked = _runners(path, tmp_path, "fp32", "fp32", max_tokens=64)
    whole = _runners(path, tmp_path, "fp32", "fp32")[1]
    assert 3 * native.max_tokens < 200
    prompt = [(i * 13 + 5) % 512 for i in range(200)]
    decodes = [7, 99, 300]
    results = []
    for runner, step in ((native, 200), (chunked, 8), (whole, 200)):
        seq = Sequence("s", prompt, SamplingParams())
        seq.block_table = list(range(NUM_BLOCKS))[::-1]
        rows = []
        for start in range(0, len(prompt), step):
            sample = start + step >= len(prompt)
            logits = runner.execute(
                [ScheduledChunk(seq, start, prompt[start : start + step], sample)]
            )
            if sample:
                rows.append(np.asarray(logits))
        for i, token in enumerate(decodes):
            rows.append(np.asarray(runner.execute([ScheduledChunk(seq, 200 + i, [token], True)])))
        results.append(np.concatenate(rows))
    ours, by_chunks, op_by_op = results
    assert np.array_equal(ours, by_chunks)
    difference = float(np.abs(ours - op_by_op).max() / np.abs(op_by_op).max())
    assert difference <= 1e-5, difference


_MLP_WIDTH = 288
"""The mixes' MLP width: not a multiple of 256, so (as llama.cpp quantizes) the
down weight takes a 32-weight block format where the rest are K-quants."""

_MIXES: dict[str, tuple[str, str, dict[str, str]]] = {
    # name: (model, base format, {tensor: its own format})
    "Q4_K_M": (
        "wide",
        "Q4_K",
        {
            "output.weight": "Q6_K",
            "blk.0.attn_v.weight": "Q6_K",  # qkv: Q4_K, Q6_K
            "blk.1.attn_k.weight": "Q5_0",  # qkv: Q4_K, Q5_0, Q4_K
            "blk.0.ffn_down.weight": "Q5_0",
            "blk.1.ffn_down.weight": "Q5_0",
            "blk.1.ffn_up.weight": "Q6_K",  # gate_up: Q4_K, Q6_K
        },
    ),
    "Q5_K_M": (
        "wide",
        "Q5_K",
        {
            "output.weight": "Q6_K",
            "blk.1.attn_v.weight": "Q6_K",
            "blk.0.ffn_down.weight": "Q5_1",
            "blk.1.ffn_down.weight": "Q5_1",
        },
    ),
    "Q6_K": (
        "wide",
        "Q6_K",
        {"blk.0.ffn_down.weight": "Q8_0", "blk.1.ffn_down.weight": "Q8_0"},
    ),
    "Q8_0": ("smollm2", "Q8_0", {}),
    "Q8_0+F32 head": ("smollm2", "Q8_0", {"token_embd.weight": "F32"}),
    "Q5_1": ("smollm2", "Q5_1", {"blk.1.attn_q.weight": "Q5_0"}),
    "Q5_1+F32+F16": (
        "smollm2",
        "Q5_1",
        {
            "token_embd.weight": "F16",  # and the tied head
            "blk.0.attn_output.weight": "F32",
            "blk.1.attn_v.weight": "F32",  # qkv: Q5_1, F32
            "blk.1.ffn_up.weight": "F16",  # gate_up: Q5_1, F16
        },
    ),
}
"""Files as people download them, in small: Q4_K_M's and Q5_K_M's mixes, Q6_K
and Q8_0 files, Q5_1 ones, dense tensors among quantized ones; some products
join tensors of two or three formats."""
_QUANTIZED_MIXES = [name for name in _MIXES if "F32" not in name]


@pytest.fixture(scope="module")
def mix_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mix-model")
    return build_wide_model(tiny_model_dir, out, intermediate=_MLP_WIDTH)


def _mix_file(
    name: str, smollm2_tiny_dir: Path, mix_model_dir: Path, tmp_path: Path
) -> tuple[Path, set[str]]:
    """The mix ``name`` written as a GGUF file, and the formats it holds."""
    model, base, formats = _MIXES[name]
    source = mix_model_dir if model == "wide" else smollm2_tiny_dir
    path = write_gguf(source, tmp_path / "gguf" / "mix.gguf", base, formats=formats)
    return path, set(GgufFile(path, has_kernels=True).formats) - {"F32"} | set(formats.values())


@pytest.mark.parametrize("activations", ["int8", "fp32"])
@pytest.mark.parametrize("mix", _QUANTIZED_MIXES)
def test_every_mix_of_quantized_formats_runs_natively_as_the_torch_path_s_fused_steps(
    smollm2_tiny_dir: Path,
    mix_model_dir: Path,
    tmp_path: Path,
    mix: str,
    activations: Activations,
) -> None:
    """A product of parts (each on its own format's kernel, its columns side by
    side) is the torch path's concatenation of its layers, bit for bit, for a
    decode (parts written in place) and a prefill chunk (through scratch)."""
    path, _ = _mix_file(mix, smollm2_tiny_dir, mix_model_dir, tmp_path)
    assert native_problem(GgufFile(path, has_kernels=True)) is None
    native, torch_runner = _runners(path, tmp_path, activations, "fp32")
    steps = _mixed_steps()
    last = steps[-1][0]
    steps.append([ScheduledChunk(last.seq, last.start + 1, [5], True)])  # one row alone
    for chunks in steps:
        assert np.array_equal(native.execute(chunks), torch_runner.execute(chunks).numpy())
    assert torch_runner.model.decoder is not None  # the torch path fused its steps too


def test_dense_tensors_among_quantized_ones_run_natively_on_the_f32_kernel(
    smollm2_tiny_dir: Path, mix_model_dir: Path, tmp_path: Path
) -> None:
    """F32 weights run on the F32 kernel natively and on the BLAS on the torch
    path (which then runs op by op): the logits agree up to float rounding."""
    path, _ = _mix_file("Q5_1+F32+F16", smollm2_tiny_dir, mix_model_dir, tmp_path)
    native, torch_runner = _runners(path, tmp_path, "fp32", "fp32")
    for chunks in _mixed_steps():
        ours, expected = native.execute(chunks), torch_runner.execute(chunks).numpy()
        assert float(np.abs(ours - expected).max() / np.abs(expected).max()) <= 1e-5
    assert torch_runner.model.decoder is None


@pytest.mark.parametrize("mix", sorted(_MIXES))
def test_auto_serves_every_mix_natively_as_its_fp32_conversion_would(
    smollm2_tiny_dir: Path, mix_model_dir: Path, tmp_path: Path, mix: str
) -> None:
    """``--gguf-runner auto`` picks the native runner for each mix, whose greedy
    tokens (fp32 activations) are those of the file dequantized to fp32 and run
    by transformers."""
    path, formats = _mix_file(mix, smollm2_tiny_dir, mix_model_dir, tmp_path)
    cache = str(tmp_path / "cache")
    native = small_core(path, cache_dir=cache, gguf_activations="fp32")
    assert isinstance(native.runner, NativeRunner)
    assert set(native.runner.model.formats) >= formats
    converted = small_core(path, cache_dir=cache, dequantize=True)
    for length in (3, 11):
        prompt = [(i * 17 + length) % 512 for i in range(length)]
        assert _greedy(native, prompt, 10) == _greedy(converted, prompt, 10)


def _greedy(core: EngineCore, prompt: list[int], n: int, request_id: str = "r") -> list[int]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return generated(core, AddRequest(request_id, prompt, params))


@pytest.mark.parametrize(
    ("activations", "step_tokens"), [("int8", 15), ("fp32", 64)], ids=["int8", "fp32"]
)
@pytest.mark.parametrize("kv", ["fp32", "bf16"])
def test_the_engine_on_the_native_runner_serves_as_on_the_torch_path(
    smollm2_tiny_dir: Path, tmp_path: Path, kv: str, activations: Activations, step_tokens: int
) -> None:
    """Greedy outputs of both engines on the same file, prompts of every length
    up to past one fused call. In steps of at most 15 tokens both run the same
    kernels (bit for bit, whatever the torch path's tuning measured); in
    longer ones the torch path runs op by op, which rounds otherwise: on fp32
    activations too little to move a greedy token (on int8 ones a rounding
    of an activation to 8 bits may flip, moving a near-tie)."""
    path = write_gguf(smollm2_tiny_dir, tmp_path / "gguf" / "tiny.gguf", "Q4_1")
    cores = [
        small_core(
            path,
            cache_dir=str(tmp_path),
            gguf_runner=runner,
            kv_cache_dtype=kv,
            gguf_activations=activations,
            max_num_batched_tokens=step_tokens,
            max_num_seqs=4,
        )
        for runner in ("native", "torch")
    ]
    assert isinstance(cores[0].runner, NativeRunner)
    assert isinstance(cores[1].runner, ModelRunner)
    assert cores[0].model_name == cores[1].model_name == "tiny.gguf"
    assert cores[0].model_path == cores[1].model_path == path.parent.resolve()
    for length in (1, 9, 40, 100):
        prompt = [(i * 13 + length) % 512 for i in range(length)]
        assert _greedy(cores[0], prompt, 10) == _greedy(cores[1], prompt, 10)


def test_prefix_caching_hits_on_the_native_runner_and_changes_no_token(
    smollm2_tiny_dir: Path, tmp_path: Path
) -> None:
    path = write_gguf(smollm2_tiny_dir, tmp_path / "gguf" / "tiny.gguf", "Q4_1")
    system = [(i * 7 + 3) % 512 for i in range(70)]
    prompts = [system + [(i * 31 + k) % 512 for i in range(5)] for k in range(3)]
    outputs = []
    for caching in (False, True):
        core = small_core(
            path, cache_dir=str(tmp_path), gguf_runner="native", enable_prefix_caching=caching
        )
        outputs.append([_greedy(core, p, 8, f"r{k}") for k, p in enumerate(prompts)])
        if caching:
            assert core.stats().prefix_cache_hits > 0
    assert outputs[0] == outputs[1]


_SERVE_DEFAULT = """
import sys
from tserve.gpu.engine._engine_core import EngineCore
from tserve._host import trim_heap
from tserve.gpu.kernels._heap import keep_freed_heap
from tserve.protocol import AddRequest, EngineConfig, SamplingParams

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024

keep_freed_heap()  # as the engine process does (tserve/gpu/engine/_process.py)
core = EngineCore(EngineConfig(device="cpu", cache_dir=sys.argv[1]), progress=print)
trim_heap()
print("rss after load", rss(), "MiB")
params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
core.add(AddRequest("r", list(range(100, 160)), params), b"p")
tokens = []
while core.has_work:
    for _, out in core.step():
        tokens += out.token_ids
print("rss after a request", rss(), "MiB")
print("tokens", len(tokens))
print("imported", sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


def test_an_engine_on_the_default_model_never_imports_torch(tmp_path: Path) -> None:
    """EngineCore in a fresh interpreter, as the engine process builds it: the
    native runner, and neither torch nor transformers imported after loading
    (the tokenizer converted in a child) and serving a request. Its resident
    memory is reported (``-s``), not asserted."""
    done = subprocess.run(
        [sys.executable, "-c", _SERVE_DEFAULT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    lines = done.stdout.splitlines()
    print(*[line for line in lines if line.startswith("rss")], sep="\n")
    loading = next(line for line in lines if "on the native runner (no torch)" in line)
    assert f"as it is, on cpu, {default_threads()} thread" in loading  # the host's default
    assert "tokens 16" in lines
    assert lines[-1] == "imported []"


def test_progress_counts_every_layer_of_every_call_on_both_runners(
    smollm2_tiny_dir: Path, tmp_path: Path
) -> None:
    """A 200-token prefill in fused calls of at most 64 tokens adds one per layer
    per call (four calls) on the native runner; on the torch path a fused step
    and an op-by-op one each add one per layer."""
    path = write_gguf(smollm2_tiny_dir, tmp_path / "gguf" / "tiny.gguf", "Q4_1")
    native, torch_runner = _runners(path, tmp_path, "fp32", "fp32", max_tokens=64)
    layers = native.model.config.num_hidden_layers
    prompt = [(i * 13 + 5) % 512 for i in range(200)]
    for runner, calls in ((native, 4), (torch_runner, 1)):
        seq = Sequence("s", prompt, SamplingParams())
        seq.block_table = list(range(NUM_BLOCKS))[::-1]
        assert runner.progress.shape == (1,) and runner.progress.dtype == np.int64
        before = int(runner.progress[0])
        runner.execute([ScheduledChunk(seq, 0, prompt, True)])
        assert runner.progress[0] == before + calls * layers
        runner.execute([ScheduledChunk(seq, 200, [7], True)])  # a decode: one fused call
        assert runner.progress[0] == before + (calls + 1) * layers
