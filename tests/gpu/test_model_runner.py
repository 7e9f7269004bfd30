"""The model runner batches for real and changes no token: fp32 CPU, tiny model.

Every test runs on tserve's own Llama forward pass and on the Hugging Face
modules, with the linear layers on each library.

A minimal in-test loop stands in for the scheduler: requests arrive staggered,
prompts are prefilled in chunks under a per-step token budget while others
decode, blocks are handed out in shuffled order and reused as soon as a
request finishes (so stale K/V sits in reused blocks).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tserve.gpu.forward._llama import PagedLlama
from tserve.gpu.forward._runner import ModelRunner, kv_bytes_per_token
from tserve.gpu.models._directory import load_model
from tserve.gpu.scheduling._sequence import ScheduledChunk, Sequence
from tserve.protocol import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 400
TOKEN_BUDGET = 48  # tokens per step, decodes first, then prefill chunks
PREFILL_CHUNK = 24  # longest prefill chunk of one request in one step
NEW_TOKENS = 12


def _runner(model_dir: Path, cpu_gemm: Any, model_impl: Any) -> ModelRunner:
    model, _ = load_model(model_dir, device="cpu", dtype=torch.float32)
    runner = ModelRunner(
        model,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        cpu_gemm=cpu_gemm,
        model_impl=model_impl,
    )
    assert isinstance(runner.model, PagedLlama) == (model_impl == "auto")
    return runner


@pytest.fixture(
    params=[(gemm, impl) for impl in ("auto", "hf") for gemm in ("auto", "blas", "onednn")],
    ids=lambda p: f"{p[1]}-{p[0]}",
)
def runner(tiny_model_dir: Path, request: pytest.FixtureRequest) -> ModelRunner:
    """A runner on tserve's own forward pass ("auto") or transformers' ("hf"), whose
    linear layers run on the library measured fastest, the BLAS, or oneDNN."""
    return _runner(tiny_model_dir, *request.param)


@dataclass
class _Blocks:
    """A trivial block allocator: shuffled free list, last freed reused first."""

    free: list[int]

    def cover(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.block_table) * BLOCK_SIZE < num_tokens:
            seq.block_table.append(self.free.pop())

    def release(self, seq: Sequence) -> None:
        self.free.extend(seq.block_table)
        seq.block_table = []


@dataclass
class _Run:
    """What the loop observed: per request, the logits of each sampled step."""

    logits: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    max_batch: int = 0
    mixed_steps: int = 0  # steps holding both a prefill chunk and a decode


def _plan_step(running: list[Sequence], blocks: _Blocks) -> list[ScheduledChunk]:
    chunks: list[ScheduledChunk] = []
    budget = TOKEN_BUDGET
    prefilling = [s for s in running if s.num_computed_tokens < s.num_tokens - 1]
    decoding = [s for s in running if s.num_computed_tokens == s.num_tokens - 1]
    for seq in decoding:
        chunks.append(ScheduledChunk(seq, seq.num_tokens - 1, seq.all_token_ids[-1:], True))
        budget -= 1
    for seq in prefilling:
        n = min(PREFILL_CHUNK, budget, seq.num_tokens - seq.num_computed_tokens)
        if n <= 0:
            break
        start = seq.num_computed_tokens
        done = start + n == seq.num_tokens
        chunks.append(ScheduledChunk(seq, start, seq.all_token_ids[start : start + n], done))
        budget -= n
    for chunk in chunks:
        blocks.cover(chunk.seq, chunk.start + len(chunk.token_ids))
    return chunks


def _drive(runner: ModelRunner, prompts: list[list[int]], arrivals: list[int]) -> dict[str, Any]:
    """Run every prompt to NEW_TOKENS greedy tokens; return outputs and a _Run."""
    rng = random.Random(1)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    blocks = _Blocks(free)
    seqs = [Sequence(f"r{i}", p, SamplingParams(temperature=0)) for i, p in enumerate(prompts)]
    run = _Run({s.request_id: [] for s in seqs})
    running: list[Sequence] = []
    step = 0
    while step <= max(arrivals) or running:
        running += [s for s, t in zip(seqs, arrivals, strict=True) if t == step]
        step += 1
        chunks = _plan_step(running, blocks)
        if not chunks:
            continue
        run.max_batch = max(run.max_batch, len(chunks))
        run.mixed_steps += any(c.sample and len(c.token_ids) == 1 for c in chunks) and any(
            len(c.token_ids) > 1 for c in chunks
        )
        logits = runner.execute(chunks)
        assert logits.shape == (sum(c.sample for c in chunks), runner.vocab_size)
        rows = iter(logits)
        for chunk in chunks:
            seq = chunk.seq
            seq.num_computed_tokens = chunk.start + len(chunk.token_ids)
            if chunk.sample:
                row = next(rows)
                run.logits[seq.request_id].append(row)
                seq.output_token_ids.append(int(row.argmax()))
                if len(seq.output_token_ids) == NEW_TOKENS:
                    running.remove(seq)
                    blocks.release(seq)
    assert len(blocks.free) == NUM_BLOCKS
    return {"outputs": [s.output_token_ids for s in seqs], "run": run}


def test_32_staggered_requests_match_generate(
    runner: ModelRunner, tiny_model: tuple[Any, Any]
) -> None:
    reference, _ = tiny_model
    _staggered_requests_match_generate(runner, reference, 32)


@pytest.mark.parametrize("model_impl", ["auto", "hf"])
def test_smollm2_layout_matches_generate(smollm2_tiny_dir: Path, model_impl: str) -> None:
    """A tied output head (one weight for the embedding and the head, on its own
    library each) and 3 query heads per KV head change no token either."""
    runner = _runner(smollm2_tiny_dir, "auto", model_impl)
    reference, _ = load_model(smollm2_tiny_dir, device="cpu", dtype=torch.float32)
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    if isinstance(runner.model, PagedLlama):
        assert runner.model.lm_head.weight is runner.model.embed.weight
    _staggered_requests_match_generate(runner, reference, 16)


def _staggered_requests_match_generate(runner: ModelRunner, reference: Any, n: int) -> None:
    rng = random.Random(0)
    lengths = [rng.choice([1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 120]) for _ in range(n)]
    prompts = [[rng.randrange(runner.vocab_size) for _ in range(k)] for k in lengths]
    arrivals = sorted(rng.randrange(40) for _ in range(n))
    result = _drive(runner, prompts, arrivals)
    run: _Run = result["run"]
    assert run.max_batch >= 8 and run.mixed_steps >= 5, "the loop did not really batch"

    worst = 0.0
    for i, (prompt, ours) in enumerate(zip(prompts, result["outputs"], strict=True)):
        expected = _generate(reference, prompt)
        # generate() stops at EOS; up to there the tokens must be identical.
        assert ours[: len(expected)] == expected, f"request {i} (prompt of {len(prompt)})"
        worst = max(worst, _logits_error(reference, prompt, ours, run.logits[f"r{i}"]))
    # Same tokens, and the logits (of magnitude ~10 here) agree with one
    # unbatched full forward to float32 rounding: matmuls of different shapes
    # sum in a different order. Measured ~1e-5 to 7e-5 on this machine.
    assert worst < 1e-3, worst


def _generate(model: Any, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    # An explicit mask: generate() would otherwise mask prompt tokens equal to pad.
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
        )
    return [int(t) for t in out[0, len(prompt) :]]


def _logits_error(
    model: Any, prompt: list[int], ours: list[int], rows: list[torch.Tensor]
) -> float:
    """Max |ours - reference| over every sampled step, reference = one full forward."""
    ids = torch.tensor([prompt + ours[:-1]])
    with torch.inference_mode():
        full = model(ids).logits[0, len(prompt) - 1 :]
    return float((torch.stack(rows) - full).abs().max())


def test_chunks_that_do_not_sample_return_no_rows(runner: ModelRunner) -> None:
    seq = Sequence("a", list(range(10)), SamplingParams())
    seq.block_table = [7, 3, 5]
    logits = runner.execute([ScheduledChunk(seq, 0, seq.prompt_token_ids[:6], False)])
    assert logits.shape == (0, runner.vocab_size)
    logits = runner.execute([ScheduledChunk(seq, 6, seq.prompt_token_ids[6:], True)])
    assert logits.shape == (1, runner.vocab_size)
    assert logits.dtype == torch.float32
    assert runner.execute([]).shape == (0, runner.vocab_size)


@pytest.mark.parametrize("blocks", ["reversed", "consecutive"])
def test_resumed_prefill_and_decodes_equal_one_shot(runner: ModelRunner, blocks: str) -> None:
    """Chunked prefill at odd offsets, then one-token decodes, read the K/V earlier
    steps left in the pool, whatever order its blocks have there."""
    prompt = [(i * 37) % 500 for i in range(60)]
    whole = Sequence("whole", prompt, SamplingParams())
    whole.block_table = list(range(0, 15))
    # Logits after positions 49, 50, ..., 59 from one prefill of the whole prompt.
    one_shot = [runner.execute([ScheduledChunk(whole, 0, prompt[:n], True)]) for n in range(50, 61)]
    pieces = Sequence("pieces", prompt, SamplingParams())
    table = list(range(100, 115))
    pieces.block_table = table[::-1] if blocks == "reversed" else table
    for start, end in ((0, 7), (7, 8), (8, 31)):
        runner.execute([ScheduledChunk(pieces, start, prompt[start:end], False)])
    resumed = [runner.execute([ScheduledChunk(pieces, 31, prompt[31:50], True)])]
    resumed += [
        runner.execute([ScheduledChunk(pieces, p, [prompt[p]], True)]) for p in range(50, 60)
    ]
    # Float rounding only: a prefill and a decode sum in different orders (~2e-5 seen).
    for ours, expected in zip(resumed, one_shot, strict=True):
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_kv_bytes_per_token(tiny_model: tuple[Any, Any]) -> None:
    model, _ = tiny_model
    # 2 (K and V) * 2 layers * 2 KV heads * head_dim 16 * 4 bytes
    assert kv_bytes_per_token(model.config, torch.float32) == 512
    assert kv_bytes_per_token(model.config, torch.bfloat16) == 256


def test_runner_refuses_empty_pool(tiny_model_dir: Path) -> None:
    model, _ = load_model(tiny_model_dir, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="num_blocks"):
        ModelRunner(model, num_blocks=0, block_size=16)
