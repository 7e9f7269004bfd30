"""EngineCore in process with the tiny model (fp32, CPU): the whole step loop, no sockets.

A small driver feeds requests in at chosen steps, steps the core until it is
idle, and checks the wire contract on every output (nothing after a request's
final output, exactly one final output each) and the scheduler's invariants
after every step.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gpu.cores import small_core
from tserve.gpu.engine._core import FORWARD_FAULT_ENV, ForwardFault
from tserve.gpu.engine._engine_core import EngineCore
from tserve.gpu.models._directory import load_model
from tserve.gpu.sampling._sampler import FAULT_ENV as SAMPLER_FAULT_ENV
from tserve.gpu.scheduling._budget import STEP_OVERHEAD_TOKENS
from tserve.gpu.scheduling._sequence import ScheduledChunk
from tserve.protocol import (
    AddRequest,
    FinishReason,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)

VOCAB = 512  # the tiny model's
PEER = b"api-1"


@pytest.fixture
def core(tiny_model_dir: Path) -> EngineCore:
    return small_core(tiny_model_dir)


@dataclasses.dataclass
class _Result:
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish: FinishReason | None = None
    error: str | None = None
    finished_at: int = -1  # the step whose outputs held the final output


@dataclasses.dataclass
class _Run:
    results: dict[str, _Result]
    steps: int
    added_while_decoding: int  # adds that arrived while some request was decoding


def _collect(
    results: dict[str, _Result], outputs: list[tuple[bytes, RequestOutput]], step: int
) -> None:
    ids = [out.request_id for _, out in outputs]
    assert len(ids) == len(set(ids)), "at most one output per request per step"
    for peer, out in outputs:
        result = results.setdefault(out.request_id, _Result())
        assert result.finish is None, f"{out.request_id}: output after its final one"
        assert peer == PEER
        result.tokens += out.token_ids
        if out.logprobs is not None:
            assert len(out.logprobs) == len(out.token_ids)
            result.logprobs = (result.logprobs or []) + out.logprobs
        result.finish, result.error = out.finish_reason, out.error
        if out.finish_reason is not None:
            result.finished_at = step
        else:
            assert out.error is None


def _drive(
    core: EngineCore,
    arrivals: Mapping[int, list[AddRequest]],
    aborts: Mapping[int, list[str]] | None = None,
    max_steps: int = 2000,
) -> _Run:
    """Add and abort at the given step numbers, then step until idle."""
    aborts = aborts or {}
    results: dict[str, _Result] = {}
    added_while_decoding = 0
    step = 0
    last = max([*arrivals, *aborts, 0])
    while step <= last or core.has_work:
        assert step < max_steps, "the engine did not finish (hang guard)"
        for request in arrivals.get(step, []):
            decoding = any(s.num_output_tokens > 0 for s in core.scheduler.running)
            added_while_decoding += decoding
            core.add(request, PEER)
        core.abort(aborts.get(step, []))
        _collect(results, core.step(), step)
        core.scheduler.check()
        step += 1
    ids = {r.request_id for rs in arrivals.values() for r in rs}
    assert ids == results.keys() and all(r.finish is not None for r in results.values())
    return _Run(results, step, added_while_decoding)


def _idle(core: EngineCore) -> None:
    stats = core.stats()
    assert (stats.running, stats.waiting, stats.kv_tokens_used) == (0, 0, 0)


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    lengths = [rng.choice([1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 120]) for _ in range(n)]
    return [[rng.randrange(VOCAB) for _ in range(k)] for k in lengths]


def _reference(model: Any, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens from ``generate`` on ``prompt`` alone.

    ``eos_token_id=None`` is generate's equivalent of ``ignore_eos``: EOS may be
    produced and generation goes on (``min_new_tokens`` would instead forbid
    EOS and change the argmax). The mask is explicit because generate would
    otherwise mask prompt tokens equal to the pad id.
    """
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
        )
    tokens = [int(t) for t in out[0, len(prompt) :]]
    assert len(tokens) == n
    return tokens


# -------------------------------------------------------------------------- correctness


@pytest.mark.parametrize(
    ("kv_cache_tokens", "expect_preemption"), [(8192, False), (384, True)], ids=["roomy", "tight"]
)
@pytest.mark.parametrize("cpu_gemm", ["auto", "onednn"])
@pytest.mark.parametrize("model_impl", ["auto", "hf"])
def test_32_staggered_greedy_requests_match_generate_alone(
    tiny_model_dir: Path,
    tiny_model: tuple[Any, Any],
    kv_cache_tokens: int,
    expect_preemption: bool,
    cpu_gemm: str,
    model_impl: str,
) -> None:
    """Chunked prefills, decodes and admissions share steps; under a tight KV
    budget requests are also preempted and recomputed. Not one token changes,
    whether the linear layers run on the BLAS generate uses or on oneDNN, and
    whether the model runs on tserve's own forward pass or transformers'."""
    core = small_core(
        tiny_model_dir, kv_cache_tokens=kv_cache_tokens, cpu_gemm=cpu_gemm, model_impl=model_impl
    )
    reference, _ = tiny_model
    _staggered_requests_match_generate(core, reference, 32, expect_preemption)


@pytest.mark.parametrize("model_impl", ["auto", "hf"])
def test_smollm2_layout_requests_match_generate_alone(
    smollm2_tiny_dir: Path, model_impl: str
) -> None:
    """SmolLM2's layout (tied output head, 3:1 GQA) under a tight KV budget."""
    core = small_core(smollm2_tiny_dir, kv_cache_tokens=384, model_impl=model_impl)
    reference, _ = load_model(smollm2_tiny_dir, device="cpu", dtype=torch.float32)
    _staggered_requests_match_generate(core, reference, 32, expect_preemption=True)


def _staggered_requests_match_generate(
    core: EngineCore, reference: Any, count: int, expect_preemption: bool
) -> None:
    rng = random.Random(0)
    prompts = _prompts(rng, count)
    max_tokens = [rng.randint(4, 24) for _ in prompts]
    arrivals: dict[int, list[AddRequest]] = {}
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        arrivals.setdefault(rng.randrange(40), []).append(AddRequest(f"r{i}", prompt, params))

    run = _drive(core, arrivals)

    assert run.added_while_decoding >= 10, "arrivals did not overlap with decoding"
    assert (core.scheduler.num_preemptions > 0) == expect_preemption
    _idle(core)
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        result = run.results[f"r{i}"]
        assert result.finish is FinishReason.LENGTH
        assert result.tokens == _reference(reference, prompt, n), f"r{i}, prompt of {len(prompt)}"


def test_a_uniform_batch_matches_generate(core: EngineCore, tiny_model: tuple[Any, Any]) -> None:
    """Equal prompts lengths admitted together: the unpadded attention shortcuts
    (causal prefill without a mask, decodes without gather or mask) change nothing."""
    rng = random.Random(9)
    prompts = [[rng.randrange(VOCAB) for _ in range(20)] for _ in range(6)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    run = _drive(core, {0: [AddRequest(f"u{i}", p, params) for i, p in enumerate(prompts)]})
    reference, _ = tiny_model
    for i, prompt in enumerate(prompts):
        assert run.results[f"u{i}"].tokens == _reference(reference, prompt, 10), f"u{i}"


def test_eos_stops_a_request_unless_ignored(core: EngineCore, tiny_model: tuple[Any, Any]) -> None:
    """Find a prompt whose greedy continuation reaches EOS; without ignore_eos it stops there."""
    reference, _ = tiny_model
    eos = core.eos_token_ids[0]
    rng = random.Random(5)
    for _ in range(500):
        prompt = [rng.randrange(VOCAB) for _ in range(10)]
        expected = _reference(reference, prompt, 30)
        if eos in expected:
            break
    else:
        pytest.skip("no greedy continuation reaches EOS in 500 prompts")
    stop_at = expected.index(eos) + 1
    greedy = SamplingParams(max_tokens=30, temperature=0)
    arrivals = {
        0: [
            AddRequest("stops", prompt, greedy),
            AddRequest(
                "goes-on", prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
            ),
        ]
    }
    run = _drive(core, arrivals)
    assert run.results["stops"].tokens == expected[:stop_at]
    assert run.results["stops"].finish is FinishReason.STOP
    assert run.results["goes-on"].tokens == expected
    assert run.results["goes-on"].finish is FinishReason.LENGTH


# -------------------------------------------------------------------------- sampling


def _seeded_target(**extra: Any) -> AddRequest:
    params = SamplingParams(
        max_tokens=24, temperature=0.9, top_p=0.95, top_k=40, seed=1234, ignore_eos=True, **extra
    )
    return AddRequest("target", [5, 17, 99, 3, 250, 41], params)


def _noise(rng: random.Random, n: int, prefix: str) -> list[AddRequest]:
    out = []
    for i, prompt in enumerate(_prompts(rng, n)):
        seed = rng.choice([None, rng.randrange(1000)])
        temperature = rng.choice([0.0, 0.7, 1.3])
        params = SamplingParams(
            max_tokens=rng.randint(1, 30), temperature=temperature, seed=seed, ignore_eos=True
        )
        out.append(AddRequest(f"{prefix}{i}", prompt, params))
    return out


@pytest.mark.parametrize("penalties", [{}, {"presence_penalty": 0.8, "frequency_penalty": 0.5}])
def test_seeded_sampling_is_reproducible_whatever_the_batch(
    tiny_model_dir: Path, penalties: dict[str, float]
) -> None:
    alone = _drive(small_core(tiny_model_dir), {0: [_seeded_target(**penalties)]})
    tokens = alone.results["target"].tokens
    assert len(tokens) == 24 and len(set(tokens)) > 5

    rng = random.Random(3)
    for trial in range(3):
        noise = _noise(rng, 12, f"t{trial}-")
        arrivals: dict[int, list[AddRequest]] = {}
        for request in noise:
            arrivals.setdefault(rng.randrange(10), []).append(request)
        arrivals.setdefault(rng.randrange(10), []).append(_seeded_target(**penalties))
        # A small token budget and tight KV vary the batch the target sees.
        core = small_core(tiny_model_dir, max_num_batched_tokens=32, kv_cache_tokens=1024)
        crowded = _drive(core, arrivals)
        assert crowded.results["target"].tokens == tokens, f"trial {trial}"


def test_different_seeds_draw_different_tokens(core: EngineCore) -> None:
    prompt = [5, 17, 99, 3]
    arrivals = {
        0: [
            AddRequest(
                f"s{seed}", prompt, SamplingParams(max_tokens=16, seed=seed, ignore_eos=True)
            )
            for seed in range(4)
        ]
    }
    run = _drive(core, arrivals)
    assert len({tuple(r.tokens) for r in run.results.values()}) == 4


def test_logprobs_when_asked(core: EngineCore, tiny_model: tuple[Any, Any]) -> None:
    prompt = [7, 8, 9, 10, 11]
    greedy = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    arrivals = {
        0: [
            AddRequest("top3", prompt, SamplingParams(logprobs=3, **greedy)),  # type: ignore[arg-type]
            AddRequest("chosen", prompt, SamplingParams(logprobs=0, **greedy)),  # type: ignore[arg-type]
            AddRequest("none", prompt, SamplingParams(**greedy)),  # type: ignore[arg-type]
            AddRequest(
                "sampled",
                prompt,
                SamplingParams(max_tokens=8, seed=1, logprobs=2, ignore_eos=True),
            ),
        ]
    }
    run = _drive(core, arrivals)
    top3, chosen = run.results["top3"], run.results["chosen"]
    assert run.results["none"].logprobs is None
    assert top3.logprobs is not None and chosen.logprobs is not None
    assert [lp.token_id for lp in top3.logprobs] == top3.tokens
    assert all(lp.top == [] for lp in chosen.logprobs)
    # Raw logprobs of one unbatched forward over prompt + outputs.
    reference, _ = tiny_model
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt + top3.tokens])).logits[0].float()
    expected = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    for k, lp in enumerate(top3.logprobs):
        assert len(lp.top) == 3
        assert lp.top[0][0] == lp.token_id, "greedy picks the most likely token"
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True) and values[0] <= 0
        assert lp.logprob == pytest.approx(float(expected[k, lp.token_id]), abs=1e-4)
        assert chosen.logprobs[k].logprob == pytest.approx(lp.logprob, abs=1e-5)
    sampled = run.results["sampled"]
    assert sampled.logprobs is not None
    assert [lp.token_id for lp in sampled.logprobs] == sampled.tokens
    assert all(len(lp.top) == 2 for lp in sampled.logprobs)


# -------------------------------------------------------------------------- aborts, deadlines


def _start(core: EngineCore, n: int, max_tokens: int = 50) -> list[str]:
    ids = [f"a{i}" for i in range(n)]
    for i, request_id in enumerate(ids):
        prompt = list(range(1, 20 + i))
        core.add(
            AddRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
            PEER,
        )
    return ids


def test_abort_frees_kv_in_the_same_step(core: EngineCore) -> None:
    ids = _start(core, 4)
    for _ in range(4):
        core.step()
    assert core.stats().running == 4
    victim = core.scheduler.get("a2")
    assert victim is not None
    held = len(victim.block_table) * core.blocks.block_size
    used = core.stats().kv_tokens_used

    core.abort(["a2"])

    assert core.stats().kv_tokens_used == used - held  # before any further step
    assert core.scheduler.get("a2") is None and core.stats().running == 3
    outputs = dict((out.request_id, out) for _, out in core.step())
    assert outputs["a2"].finish_reason is FinishReason.ABORT
    assert all(
        outputs[i].finish_reason is None and len(outputs[i].token_ids) == 1
        for i in ids
        if i != "a2"
    )
    core.scheduler.check()


def test_abort_is_idempotent_and_scoped_to_its_peer(core: EngineCore) -> None:
    ids = _start(core, 3, max_tokens=6)
    results: dict[str, _Result] = {}
    _collect(results, core.step(), 0)
    core.abort(["a0", "a0", "unknown"])
    core.abort(["a1"], peer=b"another-api-process")  # not its request: ignored
    step = 1
    while core.has_work:
        _collect(results, core.step(), step)
        step += 1
    core.abort(ids)  # all finished by now: nothing happens
    assert core.step() == []
    assert results["a0"].finish is FinishReason.ABORT
    assert results["a1"].finish is results["a2"].finish is FinishReason.LENGTH
    assert len(results["a1"].tokens) == 6
    assert core.stats().aborts_received == 7
    _idle(core)


def test_abort_of_a_waiting_request(tiny_model_dir: Path) -> None:
    core = small_core(tiny_model_dir, max_num_seqs=2)
    _start(core, 4)
    core.step()
    assert core.stats().waiting == 2
    core.abort(["a3"])
    assert core.stats().waiting == 1
    outputs = [out for _, out in core.step()]
    aborted = [out for out in outputs if out.request_id == "a3"]
    assert aborted == [RequestOutput("a3", [], FinishReason.ABORT)]


def test_deadlines_end_requests_with_abort(core: EngineCore) -> None:
    t0 = 1_000_000.0
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    core.add(AddRequest("past", [1, 2, 3], params, deadline=t0 - 1), PEER)
    core.add(AddRequest("soon", [1, 2, 3], params, deadline=t0 + 5), PEER)
    core.add(AddRequest("never", [1, 2, 3], params), PEER)
    results: dict[str, _Result] = {}
    for step in range(10):  # one simulated second per step
        _collect(results, core.step(now=t0 + step), step)
    assert results["past"] == _Result([], None, FinishReason.ABORT, None, finished_at=0)
    assert results["soon"].finish is FinishReason.ABORT and results["soon"].finished_at == 5
    assert len(results["soon"].tokens) == 5  # steps 0..4 each produced one token
    assert results["never"].finish is None and len(results["never"].tokens) == 10
    core.abort(["never"])
    core.step()
    _idle(core)


# -------------------------------------------------------------------------- per-request errors


def test_rejected_requests_error_alone(tiny_model_dir: Path) -> None:
    rng = random.Random(11)
    good = [
        AddRequest(f"g{i}", p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        for i, p in enumerate(_prompts(rng, 8))
    ]
    ok = SamplingParams(max_tokens=4)
    bad = [
        AddRequest("empty", [], ok),
        AddRequest("oov-high", [1, 2, VOCAB], ok),
        AddRequest("oov-negative", [1, -1], ok),
        AddRequest("too-long", [1] * 500, SamplingParams(max_tokens=20)),
        AddRequest("bad-temperature", [1, 2], SamplingParams(temperature=-1.0)),
        AddRequest("bad-stop-id", [1, 2], SamplingParams(stop_token_ids=(VOCAB + 3,))),
    ]
    clean = _drive(small_core(tiny_model_dir), {0: good[:4], 3: good[4:]})
    mixed = _drive(small_core(tiny_model_dir), {0: good[:4] + bad[:3], 3: bad[3:] + good[4:]})

    for request in good:
        assert mixed.results[request.request_id].tokens == clean.results[request.request_id].tokens
        assert mixed.results[request.request_id].finish is FinishReason.LENGTH
    errors = {
        "empty": "empty",
        "oov-high": "vocabulary",
        "oov-negative": "vocabulary",
        "too-long": "context length",
        "bad-temperature": "temperature",
        "bad-stop-id": "stop_token_ids",
    }
    for request_id, words in errors.items():
        result = mixed.results[request_id]
        assert result.finish is FinishReason.ERROR and result.tokens == []
        assert result.error is not None and words in result.error, result.error
        assert result.finished_at in (0, 3), "answered in the step after it arrived"


def test_a_live_request_id_reused(core: EngineCore) -> None:
    """By another API process: rejected to that one. By the same one (a protocol
    violation): ignored, so the live request's stream stays well-formed."""
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    results: dict[str, _Result] = {}
    core.add(AddRequest("x", [1, 2, 3], params), PEER)
    _collect(results, core.step(), 0)
    core.add(AddRequest("x", [4, 5], params), b"api-2")
    core.add(AddRequest("x", [6, 7], params), PEER)
    outputs = core.step()
    rejected = RequestOutput("x", [], FinishReason.ERROR, error="request id 'x' is already in use")
    assert outputs[0] == (b"api-2", rejected)
    _collect(results, outputs[1:], 1)
    for step in range(2, 6):
        _collect(results, core.step(), step)
    assert results["x"].finish is FinishReason.LENGTH and len(results["x"].tokens) == 5
    _idle(core)


def test_a_sampler_fault_ends_that_request_alone(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SAMPLER_FAULT_ENV, "^boom$")
    core = small_core(tiny_model_dir)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    run = _drive(
        core, {0: [AddRequest("boom", [1, 2, 3], params), AddRequest("fine", [1, 2], params)]}
    )
    assert run.results["boom"].finish is FinishReason.ERROR
    assert run.results["boom"].error is not None and "injected" in run.results["boom"].error
    assert (
        run.results["fine"].finish is FinishReason.LENGTH and len(run.results["fine"].tokens) == 5
    )
    _idle(core)


def test_forward_fault_hook_raises_out_of_step(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FORWARD_FAULT_ENV, "3")
    core = small_core(tiny_model_dir)
    core.add(AddRequest("r", [1, 2, 3], SamplingParams(max_tokens=10)), PEER)
    core.step()
    core.step()
    with pytest.raises(ForwardFault, match="step 3"):
        core.step()


def test_ready_info_describes_the_model(core: EngineCore) -> None:
    info = core.ready_info()
    assert info.vocab_size == VOCAB and info.max_model_len == 512
    assert info.eos_token_ids == list(core.eos_token_ids) and info.kv_tokens_total == 8192


def test_a_prompt_arriving_beside_a_stream_is_prefilled_in_budgeted_chunks(
    core: EngineCore,
) -> None:
    """A side request's prompt beside one decoding stream runs in chunks of at most
    ``(max_decode_slowdown - 1) * (STEP_OVERHEAD_TOKENS + 1)`` tokens (13 at the
    defaults: a step about 2.5 decode steps' cost), the stream's decode in every step."""
    budget = int((core.config.max_decode_slowdown - 1) * (STEP_OVERHEAD_TOKENS + 1))
    assert core.scheduler.prefill_budget(1) == budget == 13
    steps: list[dict[str, int]] = []
    execute = core.runner.execute

    def recorded(chunks: list[ScheduledChunk]) -> Any:
        steps.append({c.seq.request_id: len(c.token_ids) for c in chunks})
        return execute(chunks)

    core.runner.execute = recorded  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    core.add(AddRequest("stream", [5, 6, 7], params), PEER)
    core.step()  # its prefill, alone: the whole step's budget
    core.add(AddRequest("side", list(range(10, 40)), SamplingParams(max_tokens=1)), PEER)
    while core.scheduler.get("side") is not None:
        core.step()
    side_steps = [step for step in steps[1:] if "side" in step]
    assert [step["side"] for step in side_steps] == [13, 13, 4]
    assert all(step["stream"] == 1 for step in side_steps)  # it decoded in every one
    while core.has_work:
        core.step()
    _idle(core)
