"""Sliding-window layers in the paged KV cache: their blocks behind the window go
back to the pool, no kernel reads them, and nothing the model computes changes.

A tiny random Gemma 3 (five layers of window 8 to one global, as llama.cpp lays
Gemma 3 out; blocks of 4 positions, prompts of several windows) runs as a GGUF
file on the native runner (the C decoder) and as a directory on the torch
forward pass. Each serving path (a prompt whole or in chunks, a prefix-cache
hit, a preempted and recomputed sequence) must give transformers' own greedy
tokens; at the runner level, a run whose local groups hand back their blocks
(poisoned with NaN once handed back) gives bit for bit the logits of a run
that keeps every block.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.gpu.cores import small_core
from tests.gpu.gguf_files import write_gguf
from tserve.gpu.engine._engine_core import EngineCore
from tserve.gpu.forward._native import NativeModel, NativeRunner
from tserve.gpu.forward._runner import ModelRunner
from tserve.gpu.gguf._file import GgufFile
from tserve.gpu.models._directory import load_model
from tserve.gpu.scheduling._kv import NO_BLOCK, BlockManager
from tserve.gpu.scheduling._kv_groups import KVGroups
from tserve.gpu.scheduling._sequence import ScheduledChunk, Sequence
from tserve.protocol import AddRequest, EngineConfig, FinishReason, SamplingParams

WINDOW, BLOCK_SIZE = 8, 4
WINDOWS = (WINDOW,) * 5 + (0,)  # layer 5 global, as llama.cpp's Gemma 3 pattern has it
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Gemma 3 (six layers, window 8) with the tiny model's tokenizer."""
    import transformers

    vocab = json.loads((tiny_model_dir / "config.json").read_text())
    config_class: Any = transformers.Gemma3TextConfig
    model_class: Any = transformers.Gemma3ForCausalLM
    config = config_class(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=WINDOW,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=True,
        vocab_size=vocab["vocab_size"],
        eos_token_id=vocab["eos_token_id"],
        pad_token_id=vocab["pad_token_id"],
        attn_implementation="eager",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        model = model_class(config).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 1:  # norm weights: random too, so that each counts
                    p.add_(torch.randn_like(p) * 0.3)
    out = tmp_path_factory.mktemp("gemma3")
    model.save_pretrained(out)
    for name in _TOKENIZER_FILES:
        if (tiny_model_dir / name).is_file():
            shutil.copy(tiny_model_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def tiny_gemma3_gguf(tiny_gemma3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tiny_gemma3_dir, tmp_path_factory.mktemp("gguf") / "m.gguf", "F32")


def _prompt(length: int, salt: int = 0) -> list[int]:
    return [(i * 37 + 5 + salt) % 500 for i in range(length)]


def _greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy continuation (eager attention, fp32)."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None
        )
    return list(out[0, len(prompt) :].tolist())


def _core(path: Path, tmp_path: Path, **config: Any) -> EngineCore:
    settings: dict[str, Any] = {"cache_dir": str(tmp_path), "block_size": BLOCK_SIZE}
    return small_core(path, **{**settings, **config})


def _run(core: EngineCore, requests: list[AddRequest]) -> dict[str, list[int]]:
    """Every request's tokens, all added at once, stepped until idle with the
    scheduler's invariants checked after each step."""
    for request in requests:
        core.add(request, b"p")
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while core.has_work:
        for _, out in core.step():
            assert out.finish_reason in (None, FinishReason.LENGTH), out
            tokens[out.request_id] += out.token_ids
        core.scheduler.check()
    return tokens


def _request(request_id: str, prompt: list[int], n: int = 10) -> AddRequest:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return AddRequest(request_id, prompt, params)


@pytest.fixture(params=["gguf", "directory"])
def served(request: pytest.FixtureRequest, tiny_gemma3_gguf: Path, tiny_gemma3_dir: Path) -> Path:
    """The model as each runner serves it: the file natively, the directory on torch."""
    return tiny_gemma3_gguf if request.param == "gguf" else tiny_gemma3_dir


def test_the_engine_keeps_the_local_layers_in_groups_of_their_own(
    served: Path, tmp_path: Path
) -> None:
    lines: list[str] = []
    config = EngineConfig(
        model=str(served), device="cpu", dtype="float32", kv_cache_dtype="fp32",
        kv_cache_tokens=1024, block_size=BLOCK_SIZE, cache_dir=str(tmp_path),
    )  # fmt: skip
    core = EngineCore(config, progress=lines.append)
    assert core.blocks.windows == WINDOWS
    kind = NativeRunner if served.suffix == ".gguf" else ModelRunner
    assert isinstance(core.runner, kind)
    # The budget of 1024 tokens of every layer: six one-layer blocks each, the
    # memory of 1024 tokens; one sequence alone may grow past them (to the
    # model's 256) as five of its groups hold 3 blocks at most.
    assert core.blocks.num_blocks == 1024 // BLOCK_SIZE * 6
    assert core.blocks.max_positions == (1536 - 5 * 3) * BLOCK_SIZE
    assert core.max_model_len == 256
    ready = next(line for line in lines if line.startswith("engine ready"))
    assert "1024 KV tokens (fp32, 2 MiB; 6 KV groups of 1 layer (5 of window 8, 1 global)" in ready
    assert ready.endswith("one sequence may reach 6084 tokens)")


@pytest.mark.parametrize("batched", [64, 5], ids=["whole", "chunks-of-5"])
def test_a_prompt_whole_or_in_chunks_gives_transformers_greedy_tokens(
    served: Path, tiny_gemma3_dir: Path, tmp_path: Path, batched: int
) -> None:
    prompt = _prompt(41)  # five windows and a bit: ten full blocks
    core = _core(served, tmp_path, max_num_batched_tokens=batched, max_num_seqs=2)
    ours = _run(core, [_request("r", prompt, 12)])["r"]
    assert ours == _greedy(tiny_gemma3_dir, prompt, 12)
    assert (core.blocks.num_used_blocks, core.blocks.num_free_blocks) == (
        0,
        core.blocks.num_blocks,
    )


def test_a_prefix_cache_hit_gives_the_cold_run_s_tokens(
    served: Path, tiny_gemma3_dir: Path, tmp_path: Path
) -> None:
    """The second prompt shares the first's blocks: its local groups' from the
    window of its first computed position on, the global group's from 0."""
    first, second = _prompt(38), [*_prompt(37), 7, 8, 9, 10, 11]
    core = _core(served, tmp_path, max_num_batched_tokens=16)
    assert _run(core, [_request("a", first)])["a"] == _greedy(tiny_gemma3_dir, first, 10)
    hits = core.blocks.prefix_cache_hits
    ours = _run(core, [_request("b", second)])["b"]
    assert core.blocks.prefix_cache_hits - hits == 36  # nine of 4: 0..35
    assert ours == _greedy(tiny_gemma3_dir, second, 10)


def test_a_preempted_sequence_continues_as_an_uninterrupted_one(
    served: Path, tiny_gemma3_dir: Path, tmp_path: Path
) -> None:
    """A cache of 30 one-layer blocks: two long sequences cannot both hold their
    global blocks, so the younger is preempted and recomputed (its local
    groups' blocks shared again from the prefix cache where still there)."""
    a, b = _prompt(30, salt=1), _prompt(30, salt=2)
    core = _core(
        served,
        tmp_path,
        kv_cache_tokens=5 * BLOCK_SIZE,
        max_num_batched_tokens=8,
        max_num_seqs=2,
    )
    assert core.blocks.num_blocks == 30
    ours = _run(core, [_request("a", a, 14), _request("b", b, 14)])
    assert core.scheduler.num_preemptions > 0
    assert ours == {"a": _greedy(tiny_gemma3_dir, a, 14), "b": _greedy(tiny_gemma3_dir, b, 14)}


# -- the runners: reclaimed blocks are neither read nor missed -------------------------


def _chunks(prompt: list[int], chunk: int, decodes: int) -> list[tuple[int, int]]:
    """``(start, length)`` of prefill chunks of ``chunk`` then one-token decodes."""
    prefill = len(prompt) - decodes
    spans = [(s, min(chunk, prefill - s)) for s in range(0, prefill, chunk)]
    return spans + [(p, 1) for p in range(prefill, len(prompt))]


def _run_runner(
    runner: Any, bm: BlockManager, prompt: list[int], spans: list[tuple[int, int]]
) -> tuple[np.ndarray, list[int]]:
    """Logits after each span of ``prompt`` and the blocks it holds after each, a
    decoy sequence writing other tokens into the blocks handed back meanwhile,
    and every block handed back poisoned with NaN in each layer's K and V."""
    seq, decoy = Sequence("s", prompt, SamplingParams()), Sequence("d", prompt, SamplingParams())
    rows, held = [], []
    for start, n in spans:
        bm.allocate(seq, n)
        logits = runner.execute([ScheduledChunk(seq, start, prompt[start : start + n], True)])
        rows.append(np.asarray(logits))
        before = [list(t) for t in seq.block_tables]
        seq.num_computed_tokens += n
        bm.cache_full_blocks(seq)
        bm.reclaim(seq)
        held.append(sum(b != NO_BLOCK for table in seq.block_tables for b in table))
        gone = [
            b
            for was, now in zip(before, seq.block_tables, strict=True)
            for b, x in zip(was, now, strict=True)
            if b != x
        ]
        _poison(runner, gone)
        if gone and bm.can_allocate(decoy, 1):  # the decoy takes (some of) them back
            bm.allocate(decoy, 1)
            token = [(start * 7) % 500]
            runner.execute([ScheduledChunk(decoy, decoy.num_computed_tokens, token, True)])
            decoy.num_computed_tokens += 1
    bm.free(seq)
    bm.free(decoy)
    return np.concatenate(rows), held


def _blocks(num_blocks: int, windows: tuple[int, ...]) -> BlockManager:
    """Without the prefix cache, so a block handed back is the next one handed out."""
    return BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=False, windows=windows)


def _poison(runner: Any, blocks: list[int]) -> None:
    """NaN into every layer's K and V of ``blocks``: a read of one reaches the logits."""
    for block in blocks:
        span = slice(block * BLOCK_SIZE, (block + 1) * BLOCK_SIZE)
        if isinstance(runner, NativeRunner):
            runner.k_pool[:, :, span] = np.nan
            runner.v_pool[:, :, span] = np.nan
        else:
            with torch.inference_mode():
                runner.pool.k[:, :, span] = float("nan")
                runner.pool.v[:, :, span] = float("nan")


@pytest.mark.parametrize("chunk", [5, 12])
def test_the_native_runner_reads_no_block_it_handed_back(
    tiny_gemma3_gguf: Path, tmp_path: Path, chunk: int
) -> None:
    """Bit for bit the logits of a runner that keeps every block (one group,
    nothing handed back), with the handed-back blocks poisoned and reused."""
    prompt = _prompt(40)
    spans = _chunks(prompt, chunk, decodes=6)
    file = GgufFile(tiny_gemma3_gguf, has_kernels=True)
    model = NativeModel(file, cache_dir=tmp_path, progress=lambda _: None)
    groups = KVGroups.of(WINDOWS)
    grouped = NativeRunner(model, num_blocks=96, block_size=BLOCK_SIZE, kv_groups=groups)
    ours, held = _run_runner(grouped, _blocks(96, groups.windows), prompt, spans)
    whole = NativeRunner(model, num_blocks=16, block_size=BLOCK_SIZE)
    theirs, _ = _run_runner(whole, _blocks(16, (0,)), prompt, spans)
    assert np.array_equal(ours, theirs)
    # After the last step: 40 positions are 10 global blocks; each local group
    # holds the 2 blocks of positions 33..39, the window of the next position.
    assert held[-1] == 10 + 5 * 2
    assert not np.isnan(ours).any()


def test_the_torch_runner_with_groups_gives_the_ungrouped_logits(
    tiny_gemma3_dir: Path, tmp_path: Path
) -> None:
    """The torch forward pass over grouped blocks, handed-back ones poisoned:
    the logits of one group that keeps every block, within fp32 rounding."""
    prompt = _prompt(40)
    spans = _chunks(prompt, 7, decodes=6)
    groups = KVGroups.of(WINDOWS)

    def runner(num_blocks: int, kv_groups: KVGroups | None) -> ModelRunner:
        model, _ = load_model(tiny_gemma3_dir, device="cpu", dtype=torch.float32)
        return ModelRunner(
            model, num_blocks=num_blocks, block_size=BLOCK_SIZE, cpu_gemm="blas",
            kv_groups=kv_groups,
        )  # fmt: skip

    ours, held = _run_runner(runner(96, groups), _blocks(96, groups.windows), prompt, spans)
    theirs, _ = _run_runner(runner(16, None), _blocks(16, (0,)), prompt, spans)
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    assert held[-1] == 10 + 5 * 2


def test_a_reclaimed_entry_is_never_handed_to_a_kernel_as_a_block() -> None:
    """``NO_BLOCK`` stays out of the tables the kernels get (block 0 stands in)."""
    from tserve.gpu.scheduling._step_layout import token_tables

    seq = Sequence("s", _prompt(20), SamplingParams())
    seq.block_tables = [[NO_BLOCK, NO_BLOCK, 7, 8, 9], [1, 2, 3, 4, 5]]
    chunk = ScheduledChunk(seq, 16, [3, 4, 5, 6], True)
    tables, _ = token_tables([chunk], [0, 4], BLOCK_SIZE, 2)
    assert tables.tolist() == [[[0, 0, 7, 8, 9]], [[1, 2, 3, 4, 5]]]


def test_mixed_traffic_under_kv_pressure_gives_every_request_transformers_tokens(
    tiny_gemma3_gguf: Path, tiny_gemma3_dir: Path, tmp_path: Path
) -> None:
    """Twenty requests, six at a time, on prompts that share system prompts of
    one to four windows (some repeated whole), in steps of 12 tokens, with a
    cache of 60 one-layer blocks: prefix hits, reclaims, preemptions and
    recomputes interleave in batched steps, with the prefix cache on and off."""
    import random

    rng = random.Random(4)
    systems = [[rng.randrange(500) for _ in range(k)] for k in (9, 18, 33)]
    prompts: list[list[int]] = []
    for _ in range(20):
        if prompts and rng.random() < 0.2:
            prompts.append(list(rng.choice(prompts)))
            continue
        tail = [rng.randrange(500) for _ in range(rng.choice([1, 5, 13]))]
        prompts.append(rng.choice([[], *systems]) + tail)
    requests = [_request(f"m{i}", p, 8) for i, p in enumerate(prompts)]
    outputs = {}
    for caching in (True, False):
        core = _core(
            tiny_gemma3_gguf,
            tmp_path,
            enable_prefix_caching=caching,
            kv_cache_tokens=10 * BLOCK_SIZE,
            max_num_batched_tokens=12,
            max_num_seqs=6,
        )
        outputs[caching] = _run_concurrently(core, requests, 6)
        assert core.scheduler.num_preemptions > 0
        assert (core.blocks.num_used_blocks, core.blocks.num_free_blocks) == (0, 60)
        if caching:
            assert core.blocks.prefix_cache_hits > 0
    assert outputs[True] == outputs[False]
    for request in requests:
        rid, prompt = request.request_id, list(request.prompt_token_ids)
        assert outputs[True][rid] == _greedy(tiny_gemma3_dir, prompt, 8), rid


def _run_concurrently(
    core: EngineCore, requests: list[AddRequest], concurrency: int
) -> dict[str, list[int]]:
    """Every request's tokens, at most ``concurrency`` in flight (a new one joins
    as one ends), the scheduler's invariants checked after every step."""
    queue = list(reversed(requests))
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    in_flight = 0
    while queue or in_flight:
        while queue and in_flight < concurrency:
            core.add(queue.pop(), b"p")
            in_flight += 1
        for _, out in core.step():
            tokens[out.request_id] += out.token_ids
            in_flight -= out.finish_reason is not None
        core.scheduler.check()
    return tokens
