"""Structured outputs in EngineCore with the tiny model: masks, matchers, compiles.

The tiny random model writes garbage, so every constrained output below is
valid only because of the grammar's mask. Greedy or seeded requests make
each run the same.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from tests.gpu.cores import small_core
from tests.gpu.test_engine_core import PEER, _collect, _drive, _Result, _Run
from tserve.gpu.engine._engine_core import EngineCore
from tserve.gpu.sampling._compiler import GrammarCompiler, constraint_key
from tserve.gpu.sampling._constraints import (
    MASK_FAULT_ENV,
    MASK_HOLD_ENV,
    MASK_MISSES,
    _unpack,
    mask_threads,
)
from tserve.protocol import (
    AddRequest,
    Choice,
    Constraint,
    FinishReason,
    JsonSchema,
    LarkGrammar,
    Regex,
    RequestOutput,
    SamplingParams,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
CHOICES = ("yes", "no", "maybe so")
PATTERN = r"[0-9]{2,4}-[a-z]{3}"


@pytest.fixture
def core(tiny_model_dir: Path) -> EngineCore:
    return small_core(tiny_model_dir)


def _request(
    request_id: str, constraint: Constraint | None, *, prompt: int = 0, **params: object
) -> AddRequest:
    settings: dict[str, object] = {"max_tokens": 150, "temperature": 0.0}
    settings.update(params)
    return AddRequest(
        request_id,
        [7 + prompt, 40 + prompt, 90, 200 + prompt],
        SamplingParams(constraint=constraint, **settings),  # type: ignore[arg-type]
    )


def _text(core: EngineCore, tokens: list[int]) -> str:
    """The text of ``tokens``, EOS (which a complete grammar may end with) left out."""
    kept = [t for t in tokens if t not in core.eos_token_ids]
    return core.constraints.compiler.tokenizer.decode_str(kept)


def _assert_valid(core: EngineCore, run: _Run, request_id: str, constraint: Constraint) -> str:
    result = run.results[request_id]
    assert (result.finish, result.error) == (FinishReason.STOP, None), request_id
    text = _text(core, result.tokens)
    if isinstance(constraint, Choice):
        assert text in constraint.choices
    elif isinstance(constraint, Regex):
        assert re.fullmatch(constraint.pattern, text), text
    elif isinstance(constraint, JsonSchema):
        jsonschema.validate(json.loads(text), constraint.schema or {"type": "object"})
    return text


def _idle(core: EngineCore) -> None:
    stats = core.stats()
    assert (stats.running, stats.waiting, stats.kv_tokens_used) == (0, 0, 0)
    assert not core.constraints._matchers and not core.constraints.num_waiting
    assert not core._held


def test_constrained_and_plain_rows_share_a_batch(tiny_model_dir: Path) -> None:
    """Constrained outputs match their grammars; the plain rows' tokens are the
    same as in a run without the constrained neighbours."""
    constraints: dict[str, Constraint] = {
        "choice": Choice(CHOICES),
        "regex": Regex(PATTERN),
        "json": JsonSchema(SCHEMA),
        "json-sampled": JsonSchema(SCHEMA),
        "lark": LarkGrammar('start: "x=" NUM ";"\nNUM: /[1-9][0-9]{0,2}/'),
    }
    plain = [
        _request("plain-greedy", None, prompt=1, max_tokens=24),
        _request("plain-seeded", None, prompt=2, max_tokens=24, temperature=0.9, seed=7),
    ]
    constrained = [
        _request(rid, c, prompt=i, temperature=0.9 if "sampled" in rid else 0.0, seed=i)
        for i, (rid, c) in enumerate(constraints.items())
    ]
    mixed_core = small_core(tiny_model_dir)
    mixed = _drive(mixed_core, {0: plain[:1] + constrained + plain[1:]})
    alone = _drive(small_core(tiny_model_dir), {0: plain})
    for rid, constraint in constraints.items():
        _assert_valid(mixed_core, mixed, rid, constraint)
    for request in plain:
        assert mixed.results[request.request_id].tokens == alone.results[request.request_id].tokens
        assert len(mixed.results[request.request_id].tokens) == 24
    _idle(mixed_core)


def test_each_of_n_choices_has_its_own_matcher(core: EngineCore) -> None:
    """n > 1 is n requests with the same grammar: compiled once, each valid."""
    requests = [
        _request(f"n-{i}", JsonSchema(SCHEMA), temperature=1.0, seed=100 + i) for i in range(4)
    ]
    run = _drive(core, {0: requests})
    texts = {_assert_valid(core, run, r.request_id, JsonSchema(SCHEMA)) for r in requests}
    assert len(texts) > 1  # different seeds, different valid outputs
    assert len(core.constraints.compiler._cache) == 1
    _idle(core)


def test_a_rejected_token_ends_only_that_request(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With its mask left off (test hook), +100 on a token the grammar forbids
    makes the matcher reject it: that request errors, its neighbours finish."""
    monkeypatch.setenv(MASK_FAULT_ENV, "^unmasked$")
    core = small_core(tiny_model_dir)
    forbidden = core.constraints.compiler.tokenizer.tokenize_str("z")[0]
    run = _drive(
        core,
        {
            0: [
                _request("unmasked", Choice(CHOICES), logit_bias=((forbidden, 100.0),)),
                _request("masked", Choice(CHOICES), prompt=1, logit_bias=((forbidden, 100.0),)),
                _request("plain", None, prompt=2, max_tokens=10),
            ]
        },
    )
    bad = run.results["unmasked"]
    assert bad.finish is FinishReason.ERROR
    assert bad.error is not None and f"rejected token {forbidden}" in bad.error
    _assert_valid(core, run, "masked", Choice(CHOICES))
    assert run.results["plain"].finish is FinishReason.LENGTH
    _idle(core)


def test_abort_mid_grammar_frees_the_matcher(core: EngineCore) -> None:
    """Aborted once it has sampled under its grammar (a step count would race the
    compile and the mask threads: a row whose mask is late samples in a later step)."""
    core.add(_request("long", Regex("[a-z]{300}"), max_tokens=400), PEER)
    core.add(_request("other", Regex(PATTERN), prompt=1), PEER)
    results: dict[str, _Result] = {}
    for step in range(2000):  # a hang guard, not a pace
        _collect(results, core.step(), step)
        if "long" in results and results["long"].tokens:
            break
    core.abort(["long"])
    while core.has_work:
        step += 1
        assert step < 4000, "the engine did not finish (hang guard)"
        _collect(results, core.step(), step)
    assert results["long"].finish is FinishReason.ABORT
    assert 0 < len(results["long"].tokens) < 300
    _assert_valid(core, _Run(results, step, 0), "other", Regex(PATTERN))
    _idle(core)


def test_preemption_mid_grammar_keeps_the_matcher_in_step(tiny_model_dir: Path) -> None:
    """A KV budget too small for all of them forces recomputes mid-grammar;
    every output is still a sentence of its grammar."""
    core = small_core(tiny_model_dir, kv_cache_tokens=64, max_num_seqs=6)
    pattern = "([a-z];){25}"  # at least 25 tokens: more than 64 KV tokens for 5 at once
    requests = [_request(f"p{i}", Regex(pattern), prompt=i, max_tokens=60) for i in range(5)]
    run = _drive(core, {0: requests})
    assert core.scheduler.num_preemptions > 0
    for request in requests:
        _assert_valid(core, run, request.request_id, Regex(pattern))
    _idle(core)


def test_a_grammar_that_fails_to_compile_ends_its_request(core: EngineCore) -> None:
    run = _drive(
        core,
        {0: [_request("bad", Regex("a(b")), _request("plain", None, prompt=1, max_tokens=8)]},
    )
    bad = run.results["bad"]
    assert (bad.finish, bad.tokens) == (FinishReason.ERROR, [])
    assert bad.error is not None and "unclosed group" in bad.error
    assert run.results["plain"].finish is FinishReason.LENGTH
    _idle(core)


def test_a_constraint_that_cannot_become_a_grammar_fails_alone_from_the_compile_thread(
    core: EngineCore,
) -> None:
    """A schema nested deeper than the grammar text can be made (its recursion
    limit) is keyed and queued by the step loop, then refused by the compile
    thread: its request ends with an error naming the constraint, twice the
    same way (the failure is cached), and the plain request beside it runs on."""
    schema: dict[str, object] = {"type": "string"}
    for _ in range(300):
        schema = {"type": "object", "properties": {"a": schema}}
    deep = JsonSchema(schema)
    core.add(_request("deep", deep), PEER)
    core.add(_request("plain", None, prompt=1, max_tokens=8), PEER)
    assert core.constraints.get_waiting("deep") is not None  # queued, not refused on the loop
    ends: dict[str, RequestOutput] = {}

    def step_until(request_id: str) -> None:
        while request_id not in ends:
            assert core.has_work
            ends.update((o.request_id, o) for _, o in core.step() if o.finish_reason is not None)

    step_until("deep")
    core.add(_request("again", deep), PEER)  # the failure is cached by now
    step_until("again")
    step_until("plain")
    for request_id in ("deep", "again"):
        out = ends[request_id]
        assert (out.finish_reason, out.error_param, out.token_ids) == (
            FinishReason.ERROR,
            "constraint",
            [],
        )
        assert out.error is not None and out.error.startswith("the constraint is invalid")
    assert ends["plain"].finish_reason is FinishReason.LENGTH
    assert len(core.constraints.compiler._cache) == 1  # compiled (and failed) once
    _idle(core)


def _hold_compiler(core: EngineCore) -> threading.Event:
    """Keep the compile thread busy until the returned event is set."""
    release = threading.Event()
    core.constraints.compiler._pool.submit(release.wait)
    return release


def test_a_request_waits_for_its_grammar_without_holding_back_others(core: EngineCore) -> None:
    release = _hold_compiler(core)
    try:
        core.add(_request("waits", Regex(PATTERN)), PEER)
        core.add(_request("plain", None, prompt=1, max_tokens=6), PEER)
        finished: dict[str, FinishReason] = {}
        tokens: dict[str, list[int]] = {"waits": [], "plain": []}
        while "plain" not in finished:
            for _, out in core.step():
                tokens[out.request_id] += out.token_ids
                if out.finish_reason is not None:
                    finished[out.request_id] = out.finish_reason
        assert finished == {"plain": FinishReason.LENGTH} and tokens["waits"] == []
        assert core.stats().waiting == 1 and core.has_work
    finally:
        release.set()
    while core.has_work:
        for _, out in core.step():
            tokens[out.request_id] += out.token_ids
            if out.finish_reason is not None:
                finished[out.request_id] = out.finish_reason
    assert finished["waits"] is FinishReason.STOP
    assert re.fullmatch(PATTERN, _text(core, tokens["waits"]))
    _idle(core)


def test_a_grammar_not_compiled_in_time_ends_its_request(tiny_model_dir: Path) -> None:
    core = small_core(tiny_model_dir, grammar_compile_timeout=5.0)
    release = _hold_compiler(core)
    try:
        core.add(_request("late", Regex(PATTERN)), PEER)
        core.add(_request("plain", None, prompt=1, max_tokens=30), PEER)
        first = {out.request_id: out for _, out in core.step()}
        assert first["plain"].token_ids and "late" not in first
        # Past the timeout (the clock deadlines use): the waiting request fails alone.
        outputs = {out.request_id: out for _, out in core.step(now=time.time() + 60)}
        late = outputs["late"]
        assert late.finish_reason is FinishReason.ERROR
        assert late.error == "the grammar did not compile within 5 s"
        assert (late.error_param, late.token_ids) == ("constraint", [])
        assert outputs["plain"].finish_reason is None and outputs["plain"].token_ids
    finally:
        release.set()
    while core.has_work:
        core.step()
    _idle(core)


def test_a_deadline_passing_while_the_grammar_compiles_aborts(core: EngineCore) -> None:
    release = _hold_compiler(core)
    try:
        request = _request("expires", Regex(PATTERN))
        core.add(
            AddRequest(request.request_id, request.prompt_token_ids, request.params, 1.0), PEER
        )
        [(_, out)] = core.step(now=2.0)
        assert (out.request_id, out.finish_reason) == ("expires", FinishReason.ABORT)
    finally:
        release.set()
    _idle(core)


def test_abort_while_the_grammar_compiles(core: EngineCore) -> None:
    release = _hold_compiler(core)
    try:
        core.add(_request("gone", Regex(PATTERN)), PEER)
        core.add(_request("gone", Regex(PATTERN)), b"api-2")  # same id, another peer
        core.abort(["gone"], PEER)
        outputs = core.step()
        assert [(p, o.finish_reason) for p, o in outputs] == [
            (b"api-2", FinishReason.ERROR),
            (PEER, FinishReason.ABORT),
        ]
        assert "already in use" in (outputs[0][1].error or "")
    finally:
        release.set()
    _idle(core)


def test_padding_rows_past_the_vocabulary_are_never_allowed() -> None:
    """Logits wider than the tokenizer (padding rows): the extra columns are False."""
    bitmask = np.array([[-1, 0b101]], dtype=np.int32)  # tokens 0-31, 32 and 34
    allowed = _unpack(bitmask, 70)
    assert allowed.shape == (1, 70)
    assert allowed[0, :32].all() and allowed[0, 32] and not allowed[0, 33] and allowed[0, 34]
    assert not allowed[0, 35:].any()
    assert _unpack(bitmask, 33).tolist() == [[True] * 33]


def test_the_compiled_grammar_cache_is_bounded(tiny_model_dir: Path) -> None:
    compiler = GrammarCompiler(
        (tiny_model_dir / "tokenizer.json").read_text(),
        vocab_size=512,
        eos_token_ids=[2],
        cache_size=2,
    )
    regexes = [Regex(p) for p in ("a+", "b+", "c+")]
    keys = [constraint_key(r) for r in regexes]
    for key, regex in zip(keys, regexes, strict=True):
        compiler.start(key, regex)
        while compiler.result(key, regex) is None:
            compiler.wait(1.0)
    assert list(compiler._cache) == keys[1:]  # the least recently used was dropped
    compiler.start(keys[0], regexes[0])  # compiled again on demand
    while (matcher := compiler.result(keys[0], regexes[0])) is None:
        compiler.wait(1.0)
    assert not isinstance(matcher, str) and matcher.consume_token(
        compiler.tokenizer.tokenize_str("a")[0]
    )
    assert list(compiler._cache) == [keys[2], keys[0]]
    compiler.close()


def test_prefix_cache_hits_and_chunked_prefill_keep_grammars_in_step(
    tiny_model_dir: Path,
) -> None:
    """A constrained request whose prompt is served from the prefix cache, or
    prefilled in chunks of a small budget, writes the same valid output as one
    prefilled whole with the cache off (greedy, same prompt)."""
    prompt = [(7 * i + 3) % 250 + 5 for i in range(70)]  # 4 full blocks of 16, then a tail
    constraint = JsonSchema(SCHEMA)

    def request(request_id: str) -> AddRequest:
        params = SamplingParams(constraint=constraint, max_tokens=150, temperature=0.0)
        return AddRequest(request_id, prompt, params)

    whole_core = small_core(tiny_model_dir, enable_prefix_caching=False, max_num_batched_tokens=256)
    whole = _drive(whole_core, {0: [request("whole")]})
    reference = _assert_valid(whole_core, whole, "whole", constraint)

    cached_core = small_core(tiny_model_dir, enable_prefix_caching=True, max_num_batched_tokens=16)
    run = _drive(cached_core, {0: [request("first")], 40: [request("second")]})
    assert cached_core.stats().prefix_cache_hits >= 64, "the second prompt was not cached"
    for request_id in ("first", "second"):
        assert _assert_valid(cached_core, run, request_id, constraint) == reference
    _idle(cached_core)


def test_grammars_are_prepared_before_any_constrained_request(core: EngineCore) -> None:
    """Hello(grammars=True): the engine builds llguidance's tokenizer before it is
    ready, so no constrained request later stalls every row while it builds."""
    compiler = core.constraints.compiler
    assert not compiler.tokenizer_built  # never built by an engine that serves no grammar
    core.prepare_grammars()
    assert compiler.tokenizer_built
    core.prepare_grammars()  # idempotent
    digits = Regex("[0-9]{3}")
    run = _drive(core, {0: [_request("prepared", digits)]})
    assert len(_assert_valid(core, run, "prepared", digits)) == 3
    _idle(core)


def test_close_stops_the_grammar_threads(core: EngineCore) -> None:
    """The engine calls close() on its way out; the compile and mask threads end."""
    before = set(threading.enumerate())  # other tests' cores keep theirs
    request = _request("c", Regex(PATTERN))
    _assert_valid(core, _drive(core, {0: [request]}), "c", Regex(PATTERN))
    ours = [
        t
        for t in set(threading.enumerate()) - before
        if t.name.startswith(("tserve-grammar", "tserve-masks"))
    ]
    assert ours, "the grammar threads were never started"
    core.close()
    for thread in ours:
        thread.join(timeout=60)
    assert not [t for t in ours if t.is_alive()]


# -- grammars that cannot work, and slow ones --------------------------------------------

IMPOSSIBLE: dict[str, Constraint] = {
    "self-ref": JsonSchema({"$ref": "#"}),
    "cycle": JsonSchema(
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    ),
    "required-cycle": JsonSchema(
        {
            "type": "object",
            "properties": {"k": {"$ref": "#/$defs/a"}},
            "required": ["k"],
            "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
        }
    ),
    "empty-class": LarkGrammar('start: "a" x\nx: /[^\\x00-\\U0010FFFF]/'),
    "empty-string": Regex(""),
}


def _outputs_until_idle(core: EngineCore) -> dict[str, list[RequestOutput]]:
    out: dict[str, list[RequestOutput]] = {}
    for _ in range(2000):
        if not core.has_work:
            return out
        for _, output in core.step():
            out.setdefault(output.request_id, []).append(output)
    raise AssertionError("the engine did not finish (hang guard)")


def test_an_impossible_grammar_fails_before_its_first_token_and_is_cached(
    core: EngineCore,
) -> None:
    """A grammar that accepts no string, or only the empty one, ends its request
    with an error naming the constraint and no token; the failed compile is
    cached with its error, so the same grammar again fails the same way."""
    errors: dict[str, str] = {}
    for round_ in range(2):
        for name, constraint in IMPOSSIBLE.items():
            core.add(_request(f"{name}-{round_}", constraint), PEER)
        core.add(_request(f"plain-{round_}", None, prompt=1, max_tokens=4), PEER)
        outputs = _outputs_until_idle(core)
        for name in IMPOSSIBLE:
            [final] = outputs[f"{name}-{round_}"]
            assert (final.finish_reason, final.token_ids) == (FinishReason.ERROR, [])
            assert final.error_param == "constraint" and final.error is not None
            assert "accepts no string" in final.error or "only the empty string" in final.error
            assert errors.setdefault(name, final.error) == final.error
        assert outputs[f"plain-{round_}"][-1].finish_reason is FinishReason.LENGTH
    cached = core.constraints.compiler._cache
    assert sorted(v for v in cached.values() if isinstance(v, str)) == sorted(errors.values())
    _idle(core)


def test_an_eos_before_the_grammar_is_complete_is_an_error(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With its mask left off (test hook) and EOS forced by ``logit_bias``, the row
    reaches EOS mid-grammar: an error, never STOP with a partial output."""
    monkeypatch.setenv(MASK_FAULT_ENV, "^unmasked$")
    core = small_core(tiny_model_dir)
    [eos] = sorted(core.eos_token_ids)[:1]
    core.add(_request("unmasked", Regex(PATTERN), logit_bias=((eos, 100.0),)), PEER)
    core.add(_request("masked", Regex(PATTERN), prompt=1, logit_bias=((eos, 100.0),)), PEER)
    outputs = _outputs_until_idle(core)
    [final] = outputs["unmasked"]
    assert (final.finish_reason, final.token_ids) == (FinishReason.ERROR, [])
    assert final.error == "the output ended before its grammar was complete"
    assert final.error_param == "constraint"
    masked = [t for o in outputs["masked"] for t in o.token_ids]
    assert outputs["masked"][-1].finish_reason is FinishReason.STOP
    assert re.fullmatch(PATTERN, _text(core, masked))
    _idle(core)


def test_a_late_mask_holds_back_only_its_own_row(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hold hook keeps the slow row's mask computing until released: the
    plain row streams every token meanwhile, the slow row waits with its logits
    kept (no token, not scheduled), then writes what it writes unheld."""
    reference = _drive(small_core(tiny_model_dir), {0: [_request("slow", Regex(PATTERN))]})
    monkeypatch.setenv(MASK_HOLD_ENV, f"^slow$:{tmp_path}")
    core = small_core(tiny_model_dir)
    core.add(_request("slow", Regex(PATTERN)), PEER)
    for _ in range(10_000):  # its grammar compiles, its prefill runs, its first mask is held
        if (tmp_path / "held").exists() and "slow" in core._held:
            break
        assert core.step() == []
    else:
        raise AssertionError("the slow row was never held (hang guard)")
    core.add(_request("plain", None, prompt=1, max_tokens=12), PEER)
    tokens: dict[str, list[int]] = {"slow": [], "plain": []}
    finished: dict[str, FinishReason] = {}
    plain_steps = 0
    while "plain" not in finished:
        for _, out in core.step():
            tokens[out.request_id] += out.token_ids
            plain_steps += out.request_id == "plain" and bool(out.token_ids)
            if out.finish_reason is not None:
                finished[out.request_id] = out.finish_reason
    assert finished == {"plain": FinishReason.LENGTH} and len(tokens["plain"]) == 12
    assert plain_steps == 12  # one token every step: never waited for the slow mask
    assert tokens["slow"] == [] and "slow" in core._held  # its logits wait for the mask
    slow = core.scheduler.get("slow")
    assert slow is not None and slow.num_uncomputed_tokens == 0  # computed, not rescheduled
    (tmp_path / "release").touch()
    while core.has_work:
        for _, out in core.step():
            tokens[out.request_id] += out.token_ids
            if out.finish_reason is not None:
                finished[out.request_id] = out.finish_reason
    assert finished["slow"] is FinishReason.STOP
    assert tokens["slow"] == reference.results["slow"].tokens
    _idle(core)


def test_masks_over_their_budget_end_the_grammar(tiny_model_dir: Path) -> None:
    """A budget no mask can meet: the request ends with an error that names the
    budget and the constraint after MASK_MISSES - 1 tokens; its neighbour finishes."""
    core = small_core(tiny_model_dir, grammar_mask_budget=1e-9)
    core.add(_request("slow", Regex("[a-z]{300}"), max_tokens=400), PEER)
    core.add(_request("plain", None, prompt=1, max_tokens=20), PEER)
    outputs = _outputs_until_idle(core)
    final = outputs["slow"][-1]
    assert final.finish_reason is FinishReason.ERROR and final.error_param == "constraint"
    assert final.error is not None and "--grammar-mask-budget" in final.error
    assert len([t for o in outputs["slow"] for t in o.token_ids]) == MASK_MISSES - 1
    assert outputs["plain"][-1].finish_reason is FinishReason.LENGTH
    # Its first mask ran with everyone's; each after a miss, in the slow lane.
    assert core.constraints.masks_started == {"fast": 1, "slow": MASK_MISSES - 1}
    _idle(core)


def test_masks_run_on_the_cores_the_forward_pass_leaves(tiny_model_dir: Path) -> None:
    """One mask thread beside a one-thread forward pass on two cores, never
    none; the engine sizes its pool by the cores it may run on."""
    assert [mask_threads(1, 2), mask_threads(2, 2), mask_threads(4, 2)] == [1, 1, 1]
    assert [mask_threads(1, 16), mask_threads(8, 16)] == [15, 8]
    for threads in (1, 2):
        core = small_core(tiny_model_dir, threads=threads)
        cores = len(os.sched_getaffinity(0))
        assert core.constraints.mask_threads == mask_threads(threads, cores)
        core.add(_request("c", Regex(PATTERN)), PEER)
        outputs = _outputs_until_idle(core)
        assert outputs["c"][-1].finish_reason is FinishReason.STOP
        # Every mask of a grammar within its budget ran in the shared pool.
        started = core.constraints.masks_started
        assert started["fast"] >= 1 and started["fast"] + started["slow"] == len(
            [t for o in outputs["c"] for t in o.token_ids]
        )
        core.close()


def test_the_llguidance_tokenizer_is_built_for_the_first_constrained_request_only(
    tiny_model_dir: Path,
) -> None:
    """Building it holds the GIL: an engine serving plain requests never builds it."""
    compiler = GrammarCompiler(
        (tiny_model_dir / "tokenizer.json").read_text(),
        vocab_size=512,
        eos_token_ids=[2],
        cache_size=2,
    )
    assert compiler._tokenizer is None
    regex = Regex("a+")
    compiler.start(constraint_key(regex), regex)
    assert compiler._tokenizer is not None
    while (matcher := compiler.result(constraint_key(regex), regex)) is None:
        compiler.wait(1.0)
    assert not isinstance(matcher, str)
    assert matcher.consume_token(compiler.tokenizer.tokenize_str("a")[0])
    assert compiler.tokenizer.vocab_size == 512 and compiler.tokenizer.eos_token == 2
    compiler.close()
