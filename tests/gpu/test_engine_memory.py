"""What keeps the engine's memory small on a GGUF file, checked on pages, not on RSS.

Which of a range's pages this process maps is read from ``/proc/self/pagemap``
(bit 63 of each page's entry: present), so nothing depends on the machine's
load or on what else the process holds:

* the KV pool takes no pages until a step writes K/V, then only those;
* a weight is the file's bytes where they lie or one copy of them (Q/K/V
  and gate/up joined; packed for int8 activations), never an fp32 copy of a
  quantized weight; the pages of a tensor used only as a copy leave the
  process once the model is built;
* serving a file imports no transformers, and its RoPE table is the one
  transformers computes.
"""

from __future__ import annotations

import mmap
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.gpu.gguf_files import write_gguf
from tserve.gpu.forward._gguf import load_gguf
from tserve.gpu.forward._llama import rope_table
from tserve.gpu.forward._quant import QuantizedEmbedding, QuantizedLinear, quant_kernels
from tserve.gpu.forward._runner import ModelRunner
from tserve.gpu.gguf._file import GgufConfig
from tserve.gpu.gguf._plan import rope_tables
from tserve.gpu.models._architectures import ARCHITECTURES
from tserve.gpu.scheduling._sequence import ScheduledChunk, Sequence
from tserve.protocol import SamplingParams

PAGE = mmap.PAGESIZE


def _present(address: int, nbytes: int) -> int:
    """How many of the whole pages inside ``[address, address + nbytes)`` this process maps."""
    first = -(-address // PAGE)
    last = (address + nbytes) // PAGE
    if last <= first:
        return 0
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = pagemap.read((last - first) * 8)
    return sum(entry >> 63 for (entry,) in struct.iter_unpack("<Q", entries))


def _whole_pages(address: int, nbytes: int) -> int:
    return max(0, (address + nbytes) // PAGE - -(-address // PAGE))


def _load(path: Path, tmp_path: Path, activations: Any = "fp32") -> Any:
    return load_gguf(
        path,
        kernels=quant_kernels(),
        cache_dir=tmp_path,
        progress=lambda _: None,
        activations=activations,
    )


def _step(runner: ModelRunner, blocks: list[int], prompt: list[int]) -> None:
    seq = Sequence("s", prompt, SamplingParams())
    seq.block_table = blocks
    runner.execute([ScheduledChunk(seq, 0, prompt, True)])


def test_the_kv_pool_takes_pages_only_where_a_step_writes(
    smollm2_tiny_dir: Path, tmp_path: Path
) -> None:
    path = write_gguf(smollm2_tiny_dir, tmp_path / "gguf" / "tiny.gguf", "Q4_1")
    # 2 layers x 2 KV heads x 16384 slots x 16 dims x 4 bytes: 4 MiB each of K and V.
    runner = ModelRunner(_load(path, tmp_path).model, num_blocks=1024, block_size=16)
    pool = runner.pool
    for cache in (pool.k, pool.v):
        assert cache.dtype == torch.float32 and cache.data_ptr() % PAGE == 0
        assert _present(cache.data_ptr(), cache.nbytes) == 0
    _step(runner, [1000, 3], list(range(1, 21)))  # 20 tokens in two blocks, far apart
    # Each (layer, head) plane is 256 pages; blocks 1000 and 3 lie in two of them.
    for cache in (pool.k, pool.v):
        planes = cache.shape[0] * cache.shape[1]
        assert _present(cache.data_ptr(), cache.nbytes) == 2 * planes
        assert torch.count_nonzero(cache[:, :, 16 * 1000 : 16 * 1001]) > 0
        assert torch.count_nonzero(cache[:, :, : 16 * 3]) == 0  # never written: zeros


def _mapping_start(address: int) -> int:
    """The start of the mapping of this process that holds ``address``."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        low, high = (int(x, 16) for x in line.split()[0].split("-"))
        if low <= address < high:
            return low
    raise LookupError(hex(address))


def _reachable_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor a module of ``model`` holds: parameters, buffers, attributes
    (a quantized weight's bytes, the RoPE table)."""
    found: list[torch.Tensor] = []
    for module in model.modules():
        for value in vars(module).values():
            values = value if isinstance(value, tuple | list) else [value]
            for item in values:
                if isinstance(item, torch.Tensor):
                    found.append(item)
                elif hasattr(item, "data") and isinstance(item.data, torch.Tensor):
                    found.append(item.data)  # a QuantizedWeight
        found += list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    return found


@pytest.mark.parametrize(("fmt", "activations"), [("Q4_1", "fp32"), ("Q8_0", "int8")])
def test_quantized_weights_have_no_fp32_copy_and_lie_in_the_file(
    smollm2_tiny_dir: Path, tmp_path: Path, fmt: str, activations: str
) -> None:
    path = write_gguf(smollm2_tiny_dir, tmp_path / "gguf" / f"tiny-{fmt}.gguf", fmt)
    model = _load(path, tmp_path, activations).model
    runner = ModelRunner(model, num_blocks=16, block_size=4)  # tunes every layer
    _step(runner, [0, 1], list(range(1, 8)))
    norm = model.layers[0].attn_norm  # F32: read where it lies
    mapping = _mapping_start(norm.data_ptr())
    size = path.stat().st_size
    in_file = {
        name
        for name, module in model.named_modules()
        if isinstance(module, QuantizedLinear | QuantizedEmbedding)
        and mapping <= module.weight_q.data.data_ptr() < mapping + size
    }
    layers = len(model.layers)
    kept = {"embed", "lm_head"} | {f"layers.{i}.{w}" for i in range(layers) for w in ("o", "down")}
    # fp32: the others are the joined qkv and gate_up; int8: every weight is packed.
    assert in_file == (kept if activations == "fp32" else set())
    fp32 = [t for t in _reachable_tensors(model) if t.dtype == torch.float32]
    # Norm vectors and the RoPE table; nothing of a weight's size.
    assert all(t.dim() == 1 or t.shape[-1] == model.head_dim // 2 for t in fp32)
    assert sum(t.numel() for t in fp32 if t.dim() == 2) == 2 * model.rope_cos.numel()


@pytest.mark.parametrize(("fmt", "activations"), [("F32", "fp32"), ("Q8_0", "int8")])
def test_the_pages_of_tensors_used_as_copies_leave_the_process(
    smollm2_tiny_dir: Path, tmp_path: Path, fmt: str, activations: str
) -> None:
    """Weights large enough to hold whole pages. F32: Q/K/V and gate/up are
    copied (joined), the rest are read where they lie; Q8_0 with int8
    activations: every weight is packed (the tied embedding too)."""
    from gguf import GGUFReader

    path = write_gguf(smollm2_tiny_dir, tmp_path / "gguf" / f"tiny-{fmt}.gguf", fmt)
    model = _load(path, tmp_path, activations).model
    mapping = _mapping_start(model.layers[0].attn_norm.data_ptr())
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    copies: tuple[str, ...] = ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")
    if activations == "int8":
        copies += ("attn_output", "ffn_down", "token_embd")
    copied = [n for n in tensors if n.split(".")[-2] in copies]
    assert len(copied) == (10 if activations == "fp32" else 15)
    spans = {n: (mapping + int(tensors[n].data_offset), int(tensors[n].n_bytes)) for n in copied}
    whole = {n: span for n, span in spans.items() if _whole_pages(*span) >= 1}
    assert len(whole) >= 8  # the smaller ones hold no page of their own
    for name, span in whole.items():
        assert _present(*span) == 0, name
    if activations == "fp32":
        runner = ModelRunner(model, num_blocks=16, block_size=4)
        _step(runner, [0, 1], list(range(1, 8)))
        down = tensors["blk.0.ffn_down.weight"]  # read where it lies, so mapped once used
        start, nbytes = mapping + int(down.data_offset), int(down.n_bytes)
        assert _present(start, nbytes) == _whole_pages(start, nbytes) > 0


@pytest.mark.parametrize("factor", [1.0, 4.0])
def test_the_rope_table_is_the_one_transformers_computes(factor: float) -> None:
    """The same fp32 angles up to their last places, their cosines and sines
    rounded from float64 (torch's fp32 pow, cos and sin are not correctly rounded)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": 100000.0}
    if factor != 1.0:
        rope_parameters = {**rope_parameters, "rope_type": "linear", "factor": factor}
    theirs = LlamaConfig(
        hidden_size=576,
        num_attention_heads=9,
        head_dim=64,
        max_position_embeddings=2048,
        rope_parameters=rope_parameters,
    )
    ours = GgufConfig(
        architecture=ARCHITECTURES["llama"],
        vocab_size=512,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=1,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        rope_linear_factor=factor,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    rotary = LlamaRotaryEmbedding(theirs)
    expected = rope_table(rotary, 2048, torch.device("cpu"), torch.float32)
    angles = np.arange(2048, dtype=np.float32)[:, None] * rotary.inv_freq.numpy()[None, :]
    # An angle is known to a few units in its last place (inv_freq's pow rounds
    # differently in torch's vector paths), which moves cos and sin by as much
    # in absolute terms; then each value's own rounding.
    bound = 4 * np.spacing(angles)
    for mine, reference in zip(rope_tables(ours), expected, strict=True):
        values = reference.numpy()
        error = np.abs(mine - values)
        assert bool((error <= bound + 2 * np.spacing(np.abs(values))).all())


def test_loading_a_gguf_file_imports_no_transformers(
    smollm2_tiny_dir: Path, tmp_path: Path
) -> None:
    path = write_gguf(smollm2_tiny_dir, tmp_path / "gguf" / "tiny.gguf", "Q4_1")
    script = (
        "import sys; from pathlib import Path\n"
        "from tserve.gpu.forward._gguf import load_gguf\n"
        "from tserve.gpu.forward._quant import quant_kernels\n"
        f"load_gguf(Path({str(path)!r}), kernels=quant_kernels(), "
        f"cache_dir=Path({str(tmp_path)!r}), progress=print)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "[]"
