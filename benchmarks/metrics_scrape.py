"""How long a scrape takes while the server is saturated and scraped 20 times a second.

Starts ``python -m tserve serve --api-processes 2 --engine-kind echo`` (the
frontend is the bottleneck, so its event loops are as busy as they get),
keeps ``--streams`` streaming completions in flight with ``h2load`` (a C
client, so the load costs the Python processes under test nothing but their
own work), and scrapes on a fresh connection every 50 ms from this
process, which does nothing else. ``--target`` picks what is scraped:
``metrics-port`` (the default), the metrics process of ``--metrics-port``,
or ``serving-port``, ``/metrics`` on the port the API processes serve (with
SO_REUSEPORT, fresh connections land on each of them). Prints scrape
latency percentiles, the streams ``h2load`` completed, the completions the
server counted with status 200, and the 1-minute load average before and at
the end of the run.

The scraper, ``h2load`` and the server each run in a session of their own.
Where tasks sit in the root cgroup, Linux schedules by session
(``/proc/sys/kernel/sched_autogroup_enabled``): a scraper in the same
session as the process it scrapes is woken with it and measures latencies
that a scraper elsewhere (another pod) would not see.

``h2load`` counts every response of this server as failed (hypercorn's
status line has no reason phrase, which its parser does not report), so
the count of 200s comes from the server's own ``tserve_http_requests_total``.

Needs ``h2load`` (Debian/Ubuntu: ``apt-get install nghttp2-client``).
Run: ``python -m benchmarks.metrics_scrape [--seconds 30] [--target serving-port]``.
"""

from __future__ import annotations

import argparse
import http.client
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import msgspec

from benchmarks._serve import serve
from tserve.bench._metrics import percentile

_WARM_UP = 3.0  # s of load before the first timed scrape
_INTERVAL = 0.05  # s between scrape starts: 20 a second
_SETTLE = 2.5  # s after the load before the final count (the metrics process's MAX_AGE)
_DONE = re.compile(r"requests: \d+ total, \d+ started, (\d+) done")
_SERVED = re.compile(
    r'^tserve_http_requests_total\{route="/v1/completions",status="200"\} (\S+)$', re.M
)
_METRICS_URL = re.compile(r"metrics at (http://\S+)/metrics")


def _load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def _scrape(host: str, port: int) -> tuple[float, str]:
    """One GET /metrics on a fresh connection: (ms, text); raises unless 200 with the text."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("GET", "/metrics", headers={"Connection": "close"})
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    elapsed = (time.perf_counter() - t0) * 1000
    if response.status != 200 or b"vllm:num_requests_running" not in body:
        raise RuntimeError(f"/metrics answered {response.status}")
    return elapsed, body.decode()


def _h2load(url: str, body: Path, streams: int, seconds: float) -> subprocess.Popen[str]:
    """``h2load`` keeping ``streams`` streaming completions in flight for ``seconds``."""
    command = ["h2load", "--h1", "-c", str(streams), "-m", "1", "-D", str(int(seconds))]
    command += ["-d", str(body), "-H", "content-type: application/json"]
    command += [f"{url}/v1/completions"]
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _run(args: argparse.Namespace, tmp: Path) -> str:
    body = tmp / "body.json"
    request = {"prompt": "hello " * 16, "max_tokens": 64, "ignore_eos": True, "stream": True}
    body.write_bytes(msgspec.json.encode(request))
    options = ["--api-processes", str(args.api_processes), "--engine-kind", "echo"]
    options += ["--echo-step-time", "0.005", "--embedding-model", "none", "--no-request-log"]
    options += ["--metrics-port", "0"]
    said: list[str] = []
    process, url = serve(args.model, tmp / "server.log", *options, said=said, own_session=True)
    try:
        scraped = url
        if args.target == "metrics-port":
            found = _METRICS_URL.search("".join(said))
            if found is None:
                raise RuntimeError("the server printed no metrics URL")
            scraped = found.group(1)
        target = urlsplit(scraped)
        host, port = target.hostname or "127.0.0.1", target.port or 80
        load_before = _load_average()
        loader = _h2load(url, body, args.streams, _WARM_UP + args.seconds + 1)
        time.sleep(_WARM_UP)  # reach saturation
        latencies: list[float] = []
        end = time.monotonic() + args.seconds
        while (now := time.monotonic()) < end:
            latencies.append(_scrape(host, port)[0])
            time.sleep(max(0.0, now + _INTERVAL - time.monotonic()))
        load_during = _load_average()
        report, _ = loader.communicate(timeout=120)
        time.sleep(_SETTLE)
        served = _SERVED.search(_scrape(host, port)[1])
    finally:
        process.terminate()
        process.wait(60)
    done = _DONE.search(report)
    latencies.sort()
    return (
        f"{args.target}: {len(latencies)} scrapes  p50 {percentile(latencies, 50):.1f} ms  "
        f"p99 {percentile(latencies, 99):.1f} ms  max {latencies[-1]:.1f} ms  "
        f"streams completed {done.group(1) if done else '?'} "
        f"(status 200 in the server's count: {float(served.group(1)) if served else 0:.0f})  "
        f"load average {load_before:.2f} before, {load_during:.2f} at the end"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="default")
    parser.add_argument("--api-processes", type=int, default=2)
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument(
        "--target", choices=("metrics-port", "serving-port"), default="metrics-port"
    )
    args = parser.parse_args()
    if shutil.which("h2load") is None:
        raise SystemExit("needs h2load: apt-get install nghttp2-client")
    with tempfile.TemporaryDirectory() as tmp:
        print(_run(args, Path(tmp)))


if __name__ == "__main__":
    main()
