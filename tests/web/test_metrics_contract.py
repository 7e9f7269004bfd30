"""vLLM's model-server metrics on /metrics, without a server: names, labels, values."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tserve._metrics_dir import ENV, shared_metrics_dir
from tserve.nursery import Delta, LLMStats, Usage
from tserve.protocol import EngineStats
from tserve.web._metrics import FINISHED_REASONS, SHARED_DIR_ENV, Metrics, RequestRecord

# The contract endpoint pickers and vLLM dashboards read (docs/metrics.md).
VLLM_NAMES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
)

Samples = dict[str, list[tuple[dict[str, str], float]]]


def samples(text: str) -> Samples:
    """Every sample of a Prometheus text exposition, by sample name."""
    found: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found.setdefault(s.name, []).append((s.labels, s.value))
    return found


def metrics(engine: EngineStats, model_name: str = "smol") -> Metrics:
    stats = LLMStats(live_requests=2, aborts_sent=1, engine=engine, engine_alive=True)
    return Metrics(lambda: stats, lambda: 0, model_name, block_size=16, num_gpu_blocks=64)


def render(m: Metrics) -> Samples:
    return samples(m.render().decode())


def test_every_vllm_name_is_present_with_the_model_label_before_any_request() -> None:
    found = render(metrics(EngineStats()))
    for name in VLLM_NAMES:
        assert name in found, name
        assert all(labels.get("model_name") == "smol" for labels, _ in found[name]), name


def test_engine_gauges_come_from_the_engine_report() -> None:
    engine = EngineStats(running=3, waiting=2, kv_tokens_used=64, kv_tokens_total=256)
    found = render(metrics(engine))
    assert found["vllm:num_requests_running"] == [({"model_name": "smol"}, 3.0)]
    assert found["vllm:num_requests_waiting"] == [({"model_name": "smol"}, 2.0)]
    assert found["vllm:kv_cache_usage_perc"] == [({"model_name": "smol"}, 0.25)]
    info = {"model_name": "smol", "block_size": "16", "num_gpu_blocks": "64"}
    assert found["vllm:cache_config_info"] == [(info, 1.0)]
    assert found["tserve_requests_running"] == [({}, 3.0)]  # tserve's own name stays


def test_the_admission_queue_is_reported_by_this_process() -> None:
    stats = LLMStats(
        live_requests=1030,
        aborts_sent=0,
        engine=EngineStats(),
        engine_alive=True,
        queued_requests=6,
        queued_tokens=90,
    )
    m = Metrics(lambda: stats, lambda: 0, "smol", block_size=16, num_gpu_blocks=64)
    found = render(m)
    assert found["tserve_requests_queued"] == [({}, 6.0)]
    assert found["tserve_requests_queued_tokens"] == [({}, 90.0)]


def test_prefix_cache_counters_carry_the_engine_totals() -> None:
    found = render(metrics(EngineStats(prefix_cache_queries=1500, prefix_cache_hits=1488)))
    assert found["vllm:prefix_cache_queries_total"] == [({"model_name": "smol"}, 1500.0)]
    assert found["vllm:prefix_cache_hits_total"] == [({"model_name": "smol"}, 1488.0)]


def test_kv_usage_is_zero_without_a_kv_cache() -> None:
    found = render(metrics(EngineStats(kv_tokens_used=0, kv_tokens_total=0)))
    assert found["vllm:kv_cache_usage_perc"] == [({"model_name": "smol"}, 0.0)]


def _finished(reason: str, tokens: int) -> Delta:
    return Delta("x", [7], finish_reason=reason, usage=Usage(5, tokens))


def test_a_record_counts_tokens_successes_and_latencies_under_vllm_names() -> None:
    m = metrics(EngineStats())
    record = RequestRecord(m, "/v1/completions", "r1", log_line=False)
    record.delta(0, Delta("a", [1]))
    record.delta(0, Delta("b", [2, 3]))
    record.delta(0, _finished("length", 4))
    record.done(200)
    record.done(200)  # idempotent
    found = render(m)
    model = {"model_name": "smol"}
    assert found["vllm:prompt_tokens_total"] == [(model, 5.0)]
    assert found["vllm:generation_tokens_total"] == [(model, 4.0)]
    success = {labels["finished_reason"]: v for labels, v in found["vllm:request_success_total"]}
    assert success == {reason: (1.0 if reason == "length" else 0.0) for reason in FINISHED_REASONS}
    assert found["vllm:time_to_first_token_seconds_count"] == [(model, 1.0)]
    assert found["vllm:inter_token_latency_seconds_count"] == [(model, 2.0)]
    assert found["vllm:e2e_request_latency_seconds_count"] == [(model, 1.0)]
    requests = found["tserve_http_requests_total"]
    assert requests == [({"route": "/v1/completions", "status": "200"}, 1.0)]


def test_a_record_counts_each_prompt_once_whatever_its_choices() -> None:
    m = metrics(EngineStats())
    record = RequestRecord(m, "/v1/completions", "r1", log_line=False)
    record.choices_per_prompt = 3
    for index in range(6):  # two prompts, three choices each; every choice reports 5 + 4
        record.delta(index, _finished("length", 4))
    record.done(200)
    found = render(m)
    assert found["vllm:prompt_tokens_total"] == [({"model_name": "smol"}, 10.0)]
    assert found["vllm:generation_tokens_total"] == [({"model_name": "smol"}, 24.0)]


def test_a_request_that_never_finished_a_choice_has_no_e2e_latency() -> None:
    m = metrics(EngineStats())
    RequestRecord(m, "/v1/models", "r2", log_line=False).done(200)
    found = render(m)
    assert found["vllm:e2e_request_latency_seconds_count"] == [({"model_name": "smol"}, 0.0)]
    assert sum(v for _, v in found["vllm:request_success_total"]) == 0


def test_the_shared_directory_refuses_once_prometheus_client_is_imported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(RuntimeError, match="imported before"), shared_metrics_dir():
        pass


_WRITER = """
from tserve.nursery import Delta, LLMStats, Usage
from tserve.protocol import EngineStats
from tserve.web._metrics import Metrics, RequestRecord
stats = LLMStats(live_requests=0, aborts_sent=0, engine=EngineStats(), engine_alive=True)
m = Metrics(lambda: stats, lambda: 0, "smol")
r = RequestRecord(m, "/v1/completions", "r", log_line=False)
r.delta(0, Delta("x", [1], finish_reason="stop", usage=Usage(2, 1)))
r.done(200)
"""

_MAIN = """
import os, stat, subprocess, sys
from tserve._metrics_dir import shared_metrics_dir
with shared_metrics_dir() as path:
    print(path, oct(stat.S_IMODE(os.stat(path).st_mode)))
    for _ in range(3):
        subprocess.run([sys.executable, "-c", sys.argv[1]], check=True)
    from tserve.nursery import LLMStats
    from tserve.protocol import EngineStats
    from tserve.web._metrics import Metrics
    stats = LLMStats(live_requests=0, aborts_sent=0, engine=EngineStats(), engine_alive=True)
    sys.stdout.write(Metrics(lambda: stats, lambda: 0, "smol").render().decode())
"""


def test_processes_sharing_the_directory_are_summed_and_it_is_removed_at_exit() -> None:
    """Three processes each finish one request; a fourth renders all three."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    out = subprocess.run(
        [sys.executable, "-c", _MAIN, _WRITER], capture_output=True, text=True, check=True, env=env
    ).stdout
    first, rest = out.split("\n", 1)
    path, mode = first.split()
    assert mode == "0o700"
    assert not Path(path).exists()
    found = samples(rest)
    success = {labels["finished_reason"]: v for labels, v in found["vllm:request_success_total"]}
    assert success["stop"] == 3.0
    assert found["vllm:prompt_tokens_total"] == [({"model_name": "smol"}, 6.0)]
    assert found["tserve_http_requests_total"] == [
        ({"route": "/v1/completions", "status": "200"}, 3.0)
    ]


def test_the_web_layer_reads_the_variable_the_main_process_sets() -> None:
    assert SHARED_DIR_ENV == ENV
