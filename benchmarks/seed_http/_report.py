"""How a result is shown: a two-column text table, and a timeline PNG.

Both read the dict of :func:`._summary.summarize` (plus its ``server``
entry); the plot needs matplotlib and is skipped without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TextIO

__all__ = ["plot", "print_table"]


def print_table(result: dict[str, Any], out: TextIO) -> None:
    """One row per report field, names padded to one width."""
    rows: list[tuple[str, Any]] = [
        ("requests", result["requests"]),
        ("target rate (req/s)", f"{result['rate']:g} ({result['arrivals']})"),
        ("achieved rate (req/s), first to last start", (
            f"{result['achieved_rate']} ({result['arrival_span_s']} s, "
            f"{result['client_processes']} client processes)"
        )),
        ("send lag p99 / max (s)", f"{result['send_lag_p99_s']} / {result['send_lag_max_s']}"),
        ("ok (200, [DONE], usage)", result["ok"]),
        ("errors", result["errors"]),
        ("errors by kind", result["errors_by_kind"] or "-"),
        (f"wrong token counts (!= {result['max_tokens']})", result["wrong_token_counts"]),
        ("server: completions by status", result["server_completions_by_status"]),
        ("peak in flight (client, exact)", result["peak_in_flight_client"]),
        ("peak live requests (server gauge)", result["peak_live_server"]),
        ("peak HTTP generations (server)", result["peak_http_in_flight_server"]),
        ("peak queued for a slot: requests / tokens", (
            f"{result['peak_queued_server']} / {result['peak_queued_tokens_server']}"
        )),
        ("server bounds: max pending / queued / tokens", (
            f"{result['server_max_pending']} / {result['server_max_queued']} / "
            f"{result['server_max_queued_tokens']}"
        )),
        ("API RSS MB: before first request / peak / after", (
            f"{result['api_rss_before_mb']} / {result['api_rss_peak_mb']} / "
            f"{result['api_rss_after_mb']}"
        )),
        ("API RSS growth MB / queue bound MB (within)", (
            f"{result['api_rss_growth_mb']} / {result['queue_memory_bound_mb']} "
            f"({result['api_rss_within_bound']})"
        )),
        ("peak kernel accept queue (ss -l)", result["peak_accept_queue"]),
        ("kernel TCP counters (delta, netns-wide)", result["kernel_tcp_counters"]),
        ("failed requests: duration min / max (s)", (
            f"{result['failed_duration_min_s']} / {result['failed_duration_max_s']}"
        )),
        ("peak engine running / waiting", (
            f"{result['peak_engine_running']} / {result['peak_engine_waiting']}"
        )),
        ("server fds: baseline / peak / after", (
            f"{result['fds_baseline']} / {result['fds_peak']} / {result['fds_after']}"
        )),
        ("ZMQ sockets API->engine: min / max", (
            f"{result['zmq_sockets_to_engine_min']} / {result['zmq_sockets_to_engine_max']}"
        )),
        ("engine ipc connections: min / max", (
            f"{result['engine_ipc_connections_min']} / {result['engine_ipc_connections_max']}"
        )),
        ("wall time (s)", result["wall_s"]),
        ("throughput (req/s, tokens/s)", (
            f"{result['throughput_req_s']}, {result['throughput_tokens_s']}"
        )),
        ("latency p50 / p99 / max (s)", (
            f"{result['latency_p50_s']} / {result['latency_p99_s']} / {result['latency_max_s']}"
        )),
        ("first byte p50 / p99 (s)", (
            f"{result['first_byte_p50_s']} / {result['first_byte_p99_s']}"
        )),
        ("/metrics scrapes (errors, max latency s)", (
            f"{result['metrics_scrapes']} ({result['metrics_scrape_errors']}, "
            f"{result['metrics_latency_max_s']})"
        )),
        ("CPU cores used: API / engine / client", (
            f"{result['cpu_cores_api']} / {result['cpu_cores_engine']} / "
            f"{result['cpu_cores_client']} (of {result['cpus']}; load avg "
            f"{result['loadavg_1m_at_end']})"
        )),
        ("client CPU per request (us)", result["client_cpu_us_per_request"]),
        ("server exit code (SIGTERM)", result.get("server", {}).get("exit_code")),
    ]  # fmt: skip
    for census_key in ("fd_census_baseline", "fd_census_peak"):
        census = result[census_key]
        if census:
            rows.append((f"{census_key[3:]}", (
                f"total {census['total']}: tcp/other sockets {census['tcp_or_other_sockets']}, "
                f"unix {census['unix_sockets']}, {census['other']}"
            )))  # fmt: skip
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}", file=out)


def plot(result: dict[str, Any], path: Path) -> bool:
    """Write the timeline to ``path``; False (and nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    timeline = result["timeline"]
    fig, (top, bottom, memory) = plt.subplots(3, 1, sharex=True, figsize=(10, 9))
    client = timeline["client"]
    top.plot([r[0] for r in client], [r[1] for r in client], label="in flight (client)")
    metrics = timeline["metrics"]
    for key in ("live", "queued", "running", "waiting"):
        xs = [t for t, _, m in metrics if key in m]
        top.plot(xs, [m[key] for _, _, m in metrics if key in m], label=f"{key} (/metrics)")
    queue = timeline["accept_queue"]
    top.plot([r[0] for r in queue], [r[1] for r in queue], label="kernel accept queue")
    top.set_ylabel("requests")
    top.legend(loc="upper left")
    top.set_title(
        f"{result['requests']} streaming requests at {result['rate']:g}/s: "
        f"{result['errors']} errors"
    )
    fds = timeline["server_fds"]
    bottom.plot([r[0] for r in fds], [r[1] for r in fds], label="server fds")
    bottom.set_ylabel("fds")
    ipc_axis = bottom.twinx()
    ipc_axis.plot([r[0] for r in fds], [r[2] for r in fds], color="C3", label="engine ipc conns")
    ipc_axis.set_ylabel("ZMQ ipc connections")
    ipc_axis.set_ylim(0, max(4, *(r[2] + 1 for r in fds)))
    bottom.legend(loc="upper left")
    ipc_axis.legend(loc="upper right")
    rss = timeline.get("api_rss_mb", [])
    memory.plot([r[0] for r in rss], [r[1] for r in rss], label="API process RSS")
    if result.get("api_rss_before_mb") and result.get("queue_memory_bound_mb"):
        limit = result["api_rss_before_mb"] + result["queue_memory_bound_mb"]
        memory.axhline(limit, color="C3", linestyle="--", label="before + queue bound")
    memory.set_ylabel("MB")
    memory.set_xlabel("seconds since the load started")
    memory.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
