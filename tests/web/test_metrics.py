"""/metrics rendering, without a server: the engine's numbers as Prometheus text."""

from __future__ import annotations

from tserve.nursery import LLMStats
from tserve.protocol import EngineStats
from tserve.web._metrics import Metrics


def _render(engine: EngineStats, model_name: str = "smol") -> list[str]:
    stats = LLMStats(live_requests=2, aborts_sent=1, engine=engine, engine_alive=True)
    return Metrics(lambda: stats, lambda: 0, model_name).render().decode().splitlines()


def test_prefix_cache_counters_carry_vllms_names_and_the_model_label() -> None:
    lines = _render(EngineStats(prefix_cache_queries=1500, prefix_cache_hits=1488))
    assert 'vllm:prefix_cache_queries_total{model_name="smol"} 1500.0' in lines
    assert 'vllm:prefix_cache_hits_total{model_name="smol"} 1488.0' in lines
    assert "# TYPE vllm:prefix_cache_queries_total counter" in lines
    assert "# TYPE vllm:prefix_cache_hits_total counter" in lines


def test_engine_gauges_are_read_at_scrape_time() -> None:
    lines = _render(EngineStats(running=3, kv_tokens_used=64, kv_tokens_total=256, steps=7))
    assert "tserve_requests_running 3.0" in lines
    assert "tserve_kv_cache_usage_ratio 0.25" in lines
    assert "tserve_engine_steps_total 7.0" in lines
    assert 'vllm:prefix_cache_hits_total{model_name="smol"} 0.0' in lines
