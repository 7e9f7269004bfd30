"""How long ``/metrics`` takes while the server is saturated and scraped 20 times a second.

Starts ``python -m tserve serve --api-processes 2 --engine-kind echo`` (the
frontend is the bottleneck, so the event loops that answer scrapes are the
busiest they get), keeps ``--streams`` streaming completions in flight, and
scrapes ``/metrics`` on a fresh connection every 50 ms (so scrapes land on
both API processes). Prints scrape latency percentiles and the requests
served. Run: ``python -m benchmarks.metrics_scrape [--seconds 30]``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time

import httpx

from tserve.bench._metrics import percentile


def _start(model: str, processes: int) -> tuple[subprocess.Popen[bytes], str]:
    command = [sys.executable, "-m", "tserve", "serve", model, "--port", "0"]
    command += ["--api-processes", str(processes), "--engine-kind", "echo"]
    command += ["--echo-step-time", "0.005", "--embedding-model", "none", "--no-request-log"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE)
    assert process.stdout is not None
    for raw in process.stdout:
        line = raw.decode()
        if line.startswith("tserve: serving"):
            return process, line.rsplit(" at ", 1)[1].strip().removesuffix("/v1")
    raise RuntimeError("the server did not start")


def _stream_forever(url: str, stop: threading.Event, served: list[int]) -> None:
    body = {"prompt": "hello " * 16, "max_tokens": 64, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=120) as client:
        while not stop.is_set():
            with client.stream("POST", "/v1/completions", json=body) as r:
                for _ in r.iter_bytes():
                    pass
            served.append(r.status_code)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="default")
    parser.add_argument("--api-processes", type=int, default=2)
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    process, url = _start(args.model, args.api_processes)
    stop = threading.Event()
    served: list[int] = []
    loaders = [
        threading.Thread(target=_stream_forever, args=(url, stop, served))
        for _ in range(args.streams)
    ]
    try:
        for t in loaders:
            t.start()
        time.sleep(3.0)  # reach saturation
        latencies: list[float] = []
        end = time.monotonic() + args.seconds
        while (now := time.monotonic()) < end:
            t0 = time.perf_counter()
            assert httpx.get(f"{url}/metrics", timeout=30).status_code == 200
            latencies.append((time.perf_counter() - t0) * 1000)
            time.sleep(max(0.0, now + 0.05 - time.monotonic()))
        stop.set()
        for t in loaders:
            t.join()
    finally:
        process.terminate()
        process.wait(60)
    latencies.sort()
    print(
        f"scrapes {len(latencies)}  p50 {percentile(latencies, 50):.1f} ms  "
        f"p99 {percentile(latencies, 99):.1f} ms  max {latencies[-1]:.1f} ms  "
        f"requests served {len(served)} (non-200: {sum(s != 200 for s in served)})"
    )


if __name__ == "__main__":
    main()
