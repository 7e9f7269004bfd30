"""EchoCore in process: no model, no sockets, no torch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.torch_free import assert_runs_without_torch
from tserve.gpu.engine._core import FORWARD_FAULT_ENV, ForwardFault
from tserve.gpu.engine._echo_core import EchoCore
from tserve.protocol import (
    AddRequest,
    EngineConfig,
    FinishReason,
    JsonSchema,
    RequestOutput,
    SamplingParams,
)

A, B = b"api-a", b"api-b"


def _core(model_dir: Path, **config: Any) -> EchoCore:
    options: dict[str, Any] = {"engine_kind": "echo", "echo_step_time": 0.0, **config}
    return EchoCore(EngineConfig(model=str(model_dir), **options), progress=lambda _: None)


def _add(core: EchoCore, rid: str, prompt: list[int], peer: bytes = A, **params: Any) -> None:
    core.add(AddRequest(rid, prompt, SamplingParams(**params)), peer)


def _run(core: EchoCore) -> dict[str, list[RequestOutput]]:
    """Step until idle; every output by request id."""
    seen: dict[str, list[RequestOutput]] = {}
    while core.has_work:
        for _, output in core.step():
            seen.setdefault(output.request_id, []).append(output)
    return seen


def _tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for output in outputs for t in output.token_ids]


@pytest.fixture
def core(tiny_model_dir: Path) -> EchoCore:
    return _core(tiny_model_dir)


def test_exactly_max_tokens_echoing_the_prompt_without_eos(core: EchoCore) -> None:
    eos = sorted(core.eos_token_ids)[0]
    _add(core, "r", [5, eos, 6, 7], max_tokens=10)
    _add(core, "one", [9], max_tokens=1)
    seen = _run(core)
    assert _tokens(seen["r"]) == [5, 6, 7, 5, 6, 7, 5, 6, 7, 5]
    assert [len(o.token_ids) for o in seen["r"]] == [1] * 10  # one per step
    assert seen["r"][-1].finish_reason is FinishReason.LENGTH
    assert [o.finish_reason for o in seen["one"]] == [FinishReason.LENGTH]
    assert core.stats().steps == 10 and core.stats().running == 0


def test_constraints_and_logit_bias_are_ignored(core: EchoCore) -> None:
    """The echo is not masked: a constrained or biased request echoes its prompt."""
    _add(core, "json", [5, 6], max_tokens=3, constraint=JsonSchema({"type": "object"}))
    _add(core, "bias", [5, 6], max_tokens=3, logit_bias=((9, -100.0),))
    _add(core, "bad-bias", [5, 6], max_tokens=3, logit_bias=((9, 200.0),))
    seen = _run(core)
    assert _tokens(seen["json"]) == _tokens(seen["bias"]) == [5, 6, 5]
    assert [o.finish_reason for o in seen["bad-bias"]] == [FinishReason.ERROR]


def test_stop_token_ids_end_a_request(core: EchoCore) -> None:
    _add(core, "r", [5, 6, 7], max_tokens=10, stop_token_ids=(7,))
    seen = _run(core)
    assert _tokens(seen["r"]) == [5, 6, 7]
    assert seen["r"][-1].finish_reason is FinishReason.STOP


def test_at_most_max_num_seqs_run_and_the_rest_wait(tiny_model_dir: Path) -> None:
    core = _core(tiny_model_dir, max_num_seqs=2)
    for i in range(5):
        _add(core, str(i), [3], max_tokens=2)
    outputs = core.step()
    assert sorted(o.request_id for _, o in outputs) == ["0", "1"]
    stats = core.stats()
    assert (stats.running, stats.waiting) == (2, 3)
    assert {rid: len(_tokens(o)) for rid, o in _run(core).items()} == {
        "0": 1,
        "1": 1,
        "2": 2,
        "3": 2,
        "4": 2,
    }


def test_aborts_deadlines_and_vanished_peers(core: EchoCore) -> None:
    for rid in ("a1", "a2", "a3", "late"):
        _add(core, rid, [4], max_tokens=50)
    _add(core, "a1", [4], peer=B, max_tokens=50)  # the same id from another API process
    core.add(AddRequest("dead", [4], SamplingParams(max_tokens=50), deadline=1.0), A)
    first = {(peer, o.request_id): o for peer, o in core.step(now=10.0)}
    assert first[(A, "dead")].finish_reason is FinishReason.ABORT
    assert first[(A, "dead")].token_ids == []
    core.abort(["a1", "a1", "unknown"], A)
    core.abort_peer(B)
    ends = {(peer, o.request_id): o.finish_reason for peer, o in core.step(now=10.0)}
    assert ends[(A, "a1")] is FinishReason.ABORT and ends[(B, "a1")] is FinishReason.ABORT
    assert core.stats().aborts_received == 3
    core.abort_all()
    last = {o.request_id: o.finish_reason for _, o in core.step(now=10.0)}
    assert last == dict.fromkeys(("a2", "a3", "late"), FinishReason.ABORT)
    assert not core.has_work


def test_a_request_that_can_never_run_ends_alone_and_a_reused_id_is_dropped(
    core: EchoCore,
) -> None:
    _add(core, "empty", [], max_tokens=3)
    _add(core, "vocab", [core.vocab_size], max_tokens=3)
    _add(core, "long", [1], max_tokens=core.max_model_len)
    _add(core, "ok", [1], max_tokens=3)
    _add(core, "ok", [2], max_tokens=3)  # the same peer re-used a live id: dropped
    seen = _run(core)
    for rid in ("empty", "vocab", "long"):
        assert [o.finish_reason for o in seen[rid]] == [FinishReason.ERROR], rid
        assert seen[rid][0].error
    assert _tokens(seen["ok"]) == [1, 1, 1]


def test_logprobs_are_certain(core: EchoCore) -> None:
    _add(core, "r", [8], max_tokens=2, logprobs=1)
    outputs = _run(core)["r"]
    assert [lp.logprob for o in outputs for lp in o.logprobs or []] == [0.0, 0.0]


def test_the_forward_fault_hook_applies(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FORWARD_FAULT_ENV, "2")
    core = _core(tiny_model_dir)
    _add(core, "r", [1], max_tokens=5)
    core.step()
    with pytest.raises(ForwardFault, match="step 2"):
        core.step()


def test_no_weights_and_no_torch_are_needed(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"vocab_size": 10, "eos_token_id": 2, "max_position_embeddings": 64})
    )
    core = _core(tmp_path)
    ready = core.ready_info()
    assert (ready.vocab_size, ready.max_model_len, ready.eos_token_ids) == (10, 64, [2])
    assert ready.kv_tokens_total == 0


def test_the_echo_engine_process_never_imports_torch(tiny_model_dir: Path) -> None:
    assert_runs_without_torch(
        "from tserve.gpu.engine._process import _build_core\n"
        "from tserve.protocol import EngineConfig\n"
        f"_build_core(EngineConfig(model={str(tiny_model_dir)!r}, engine_kind='echo'))"
    )


def test_a_directory_without_a_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config\.json"):
        _core(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="vocab_size"):
        _core(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10}))
    with pytest.raises(ValueError, match="echo_step_time"):
        _core(tmp_path, echo_step_time=-1.0)
