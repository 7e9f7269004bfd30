"""Several models on one server: cold and warm first tokens, switches, mixed streams, memory.

    .venv/bin/python benchmarks/many_models.py [--gguf PATH] [--rounds 3]
        [--streams 16] [--max-tokens 16] [--llama-server PATH | --peer-cache DIR]
        [--no-llama]

Three model names (``smol-a``, ``smol-b``, ``smol-c``) for one GGUF file
(default: the default model's, SmolLM2-135M-Instruct Q4_1), hard links (or
copies) in one folder that both servers serve as ``--models-dir``. Each
phase starts its server fresh:

1. **cold / warm** (tserve without ``--models-memory``,
   ``llama-server --models-max 3``):
   for each model in ``--rounds`` rounds, the model is unloaded (``POST
   /models/unload``, then ``/v1/models`` polled until it says so), one
   request's time to first token (TTFT) is taken cold, load included, and
   a second one's warm. Then **mixed**: ``--streams`` streams to each of
   the three models at once (``--max-tokens`` each), counting errors: a
   status other than 200, an error event, or a stream without ``[DONE]``.
2. **switch** (tserve with ``--models-memory`` 1.5 x the most that its
   budget counted for one model in phase 1, read from the model's
   ``resident_bytes`` after its cold request, so one model fits and two do not;
   ``llama-server --models-max 1``): requests alternate between two models,
   ``2 x --rounds`` of them after the first; each one's TTFT includes
   unloading the other model and loading its own. Then the same mixed
   streams as in phase 1: with room for one model, each model's streams
   wait until the others' end and their model is unloaded.

Every request is a streamed ``/v1/completions`` of 16 random token ids
(fresh ones each time, so no prefix cache helps), greedy; TTFT is the time
from sending it to its first event with a choice, on the client. Through
every phase a thread sums the resident memory (``VmRSS``) of the server's
child processes (tserve's engines, llama-server's per-model servers) from
``/proc`` every 50 ms; the peak under the budget is checked against it.
Engines run one thread each (tserve's default; ``-t 1 -tb 1`` for llama).

Prints a table and writes ``results/many_models-TIME.json`` and ``.md``
(server logs in ``results/many_models-TIME/``). On a shared machine compare
the ratios within one run, not absolute times across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._long_prompts import _IDS, ttft  # noqa: E402
from benchmarks._memory import children, process_memory  # noqa: E402
from benchmarks._results import result_stem, write_json  # noqa: E402
from benchmarks._sidebyside import Peer, Server  # noqa: E402
from benchmarks.compare import OFFLINE  # noqa: E402

MODELS = ("smol-a", "smol-b", "smol-c")
PROMPT_TOKENS = 16
BUDGET_FACTOR = 1.5  # x what the budget counts for one model: one fits, two do not


def model_folder(gguf: Path, folder: Path) -> list[Path]:
    """``folder/NAME.gguf`` for each of :data:`MODELS`: hard links to ``gguf``
    where the file system allows, copies otherwise."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in MODELS:
        path = folder / f"{name}.gguf"
        path.unlink(missing_ok=True)
        try:
            os.link(gguf, path)
        except OSError:
            shutil.copyfile(gguf, path)
        paths.append(path)
    return paths


class RssSampler:
    """Sums ``VmRSS`` over ``pid``'s children every ``interval`` s on a thread,
    from :meth:`start` until :meth:`stop`; keeps the peak sum and each
    child's own peak (MiB)."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self.pid, self.interval = pid, interval
        self.peak_total = 0.0
        self.peak_by_pid: dict[int, float] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:  # at least one sample, however soon stop() comes
            total = 0.0
            for child in children(self.pid):
                try:
                    rss = process_memory(child)["VmRSS"]
                except (OSError, KeyError):  # gone meanwhile, or a zombie
                    continue
                total += rss
                self.peak_by_pid[child] = max(self.peak_by_pid.get(child, 0.0), rss)
            self.peak_total = max(self.peak_total, total)
            self.samples += 1
            if self._stop.wait(self.interval):
                return

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def checkpoint(self) -> dict[str, Any]:
        """What it found since the last checkpoint (or start); starts afresh.

        A sample under way meanwhile may count on either side."""
        found = {
            "peak_total_mib": self.peak_total,
            "peak_per_process_mib": sorted(self.peak_by_pid.values(), reverse=True),
            "samples": self.samples,
        }
        self.peak_total, self.peak_by_pid, self.samples = 0.0, {}, 0
        return found

    def stop(self) -> dict[str, Any]:
        """Stops the thread (blocks for at most one sample); :meth:`checkpoint`."""
        self._stop.set()
        self._thread.join()
        return self.checkpoint()


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(*_IDS) for _ in range(PROMPT_TOKENS)]


def states(url: str) -> dict[str, str]:
    """Each listed model's state, from ``/v1/models`` (llama.cpp's ``status.value``)."""
    listed = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    return {m["id"]: m.get("status", {}).get("value", "?") for m in listed}


def unload(url: str, model: str, timeout: float = 120.0) -> None:
    """``POST /models/unload``, then wait until ``/v1/models`` lists it unloaded
    (HTTPStatusError if the server refuses; RuntimeError after ``timeout`` s)."""
    if states(url).get(model) == "unloaded":
        return
    httpx.post(f"{url}/models/unload", json={"model": model}, timeout=timeout).raise_for_status()
    deadline = time.monotonic() + timeout
    while states(url).get(model) != "unloaded":
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: {model} did not unload in {timeout:.0f} s")
        time.sleep(0.1)


def cold_warm(url: str, rounds: int, rng: random.Random) -> dict[str, list[float]]:
    """Per round and model: unload, one cold TTFT (load included), one warm TTFT;
    and after the cold one, the bytes its card's ``resident_bytes`` counts
    (tserve's: what its memory budget counts for the model; none for llama)."""
    found: dict[str, list[float]] = {"cold": [], "warm": [], "resident_bytes": []}
    for _ in range(rounds):
        for model in MODELS:
            unload(url, model)
            found["cold"].append(ttft(url, model, _prompt(rng)))
            card = httpx.get(f"{url}/v1/models/{model}", timeout=30)
            if card.status_code == 200 and "resident_bytes" in card.json():
                found["resident_bytes"].append(card.json()["resident_bytes"])
            found["warm"].append(ttft(url, model, _prompt(rng)))
    return found


def switches(url: str, rounds: int, rng: random.Random) -> dict[str, Any]:
    """A first request to one model, then ``2 * rounds`` alternating between two:
    each one's TTFT and, after it, how many models ``/v1/models`` shows loaded.
    An HTTP error ends no run: it is counted by status."""
    pair = MODELS[:2]
    ttft(url, pair[0], _prompt(rng))
    found: dict[str, Any] = {"ttft": [], "loaded_after": [], "errors": {}}
    for i in range(2 * rounds):
        model = pair[(i + 1) % 2]
        try:
            found["ttft"].append(ttft(url, model, _prompt(rng)))
        except httpx.HTTPStatusError as exc:
            key = f"status {exc.response.status_code}"
            found["errors"][key] = found["errors"].get(key, 0) + 1
        found["loaded_after"].append(sum(s == "loaded" for s in states(url).values()))
    return found


async def _stream(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int
) -> tuple[float | None, str | None]:
    """One streamed completion: (TTFT, None) or (TTFT or None, what went wrong)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    start, first = time.perf_counter(), None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return None, f"status {response.status_code}"
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    return first, None
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return first, "error event"
                if first is None and event.get("choices"):
                    first = time.perf_counter() - start
    except httpx.TransportError as exc:
        return first, type(exc).__name__
    return first, "no [DONE]"


async def _mixed(url: str, streams: int, max_tokens: int, rng: random.Random) -> dict[str, Any]:
    jobs = [(m, _prompt(rng)) for _ in range(streams) for m in MODELS]
    limits = httpx.Limits(max_connections=len(jobs), max_keepalive_connections=len(jobs))
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        results = await asyncio.gather(
            *(_stream(client, url, model, prompt, max_tokens) for model, prompt in jobs)
        )
    errors: dict[str, int] = {}
    for _, error in results:
        if error is not None:
            errors[error] = errors.get(error, 0) + 1
    return {
        "requests": len(jobs),
        "errors": errors,
        "error_count": sum(errors.values()),
        "ttft": [t for t, error in results if t is not None and error is None],
        "wall_s": time.perf_counter() - start,
    }


def mixed(url: str, streams: int, max_tokens: int, rng: random.Random) -> dict[str, Any]:
    """``streams`` streams to each model at once; blocks until all end."""
    return asyncio.run(_mixed(url, streams, max_tokens, rng))


Work = Callable[[str, RssSampler], dict[str, Any]]


def phase(peer: Peer, log: Path, work: Work) -> dict[str, Any]:
    """Start ``peer``, run ``work(url, sampler)`` while ``sampler`` sums its
    children's memory, stop it. ``memory`` is what the sampler found after
    ``work``'s last checkpoint."""
    server = Server(peer, log)
    sampler = RssSampler(server.proc.pid).start()
    try:
        found = work(server.url, sampler)
    finally:
        memory = sampler.stop()
        server.stop()
    return {**found, "memory": memory, "start_s": server.start_s}


def tserve_peer(name: str, folder: Path, *extra: str) -> Peer:
    def command(port: int) -> list[str]:
        return [
            sys.executable, "-m", "tserve", "serve", "--models-dir", str(folder),
            "--port", str(port), *extra,
        ]  # fmt: skip

    return Peer(name, command, OFFLINE)


def llama_peer(name: str, exe: Path, folder: Path, models_max: int, streams: int) -> Peer:
    def command(port: int) -> list[str]:
        return [
            str(exe), "--models-dir", str(folder), "--models-max", str(models_max),
            "--host", "127.0.0.1", "--port", str(port), "-np", str(streams),
            "-c", str(streams * 256), "-t", "1", "-tb", "1",
        ]  # fmt: skip

    return Peer(name, command, {}, start_timeout=120.0)


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.1f}"


def _errors(run: dict[str, Any]) -> str:
    return "-" if not run else f"{run['error_count']} / {run['requests']}"


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def summarize(server: str, found: dict[str, Any]) -> dict[str, Any]:
    """One server's medians (s), error counts and memory peaks (MiB) from its phases."""
    first, second = found.get("cold_warm", {}), found.get("switch", {})
    row: dict[str, Any] = {"server": server}
    row["cold"] = _median(first.get("cold", []))
    row["warm"] = _median(first.get("warm", []))
    row["switch"] = _median(second.get("ttft", []))
    row["switch_errors"] = sum(second.get("errors", {}).values()) if "ttft" in second else None
    row["mixed"] = first.get("mixed", {})
    row["mixed_one_fits"] = second.get("mixed", {})
    for key in ("mixed", "mixed_one_fits"):
        row[key] = {k: v for k, v in row[key].items() if k != "ttft"}
    row["peak_mib"] = first.get("memory", {}).get("peak_total_mib")
    row["switch_peak_mib"] = second.get("before_mixed_memory", {}).get("peak_total_mib")
    row["mixed_one_fits_peak_mib"] = second.get("memory", {}).get("peak_total_mib")
    row["budget_mib"] = second.get("budget_mib")
    peaks = (row["switch_peak_mib"], row["mixed_one_fits_peak_mib"])
    if row["budget_mib"] is not None and None not in peaks:
        row["within_budget"] = max(peaks) <= row["budget_mib"]
    return row


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The figures as one Markdown table, a row per server."""
    head = (
        "| server | cold TTFT ms | warm TTFT ms | cold ÷ warm | switch TTFT ms | switch ÷ warm "
        "| mixed errors, 3 fit / 1 fits | mixed wall s, 3 fit / 1 fits "
        "| peak RSS MiB: mixed, 3 fit / switching / mixed, 1 fits | budget MiB |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        walls = [run.get("wall_s") for run in (r["mixed"], r["mixed_one_fits"])]
        cells = [
            r["server"], _ms(r["cold"]), _ms(r["warm"]), _ratio(r["cold"], r["warm"]),
            _ms(r["switch"]), _ratio(r["switch"], r["warm"]),
            f"{_errors(r['mixed'])}; {_errors(r['mixed_one_fits'])}",
            " / ".join("-" if w is None else f"{w:.1f}" for w in walls),
            " / ".join(
                _mib(r[k]) for k in ("peak_mib", "switch_peak_mib", "mixed_one_fits_peak_mib")
            ),
            _mib(r["budget_mib"]),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Settings:
    rounds: int
    streams: int
    max_tokens: int


def _phases(s: Settings, rng: random.Random) -> tuple[Work, Work]:
    """What phase 1 (cold/warm, then mixed) and phase 2 (switches, then mixed)
    do at a URL; the memory before the mixed streams is ``before_mixed_memory``."""

    def first(url: str, sampler: RssSampler) -> dict[str, Any]:
        found = cold_warm(url, s.rounds, rng)
        before = sampler.checkpoint()
        mixed_run = mixed(url, s.streams, s.max_tokens, rng)
        return {**found, "before_mixed_memory": before, "mixed": mixed_run}

    def second(url: str, sampler: RssSampler) -> dict[str, Any]:
        found = switches(url, s.rounds, rng)
        before = sampler.checkpoint()
        mixed_run = mixed(url, s.streams, s.max_tokens, rng)
        return {**found, "before_mixed_memory": before, "mixed": mixed_run}

    return first, second


def run_tserve(folder: Path, out: Path, s: Settings, rng: random.Random) -> dict[str, Any]:
    """tserve's two phases; the switch phase's failure (a server refusing the
    budget flags, say) is recorded under ``switch.failed`` and ends nothing else."""
    first, second = _phases(s, rng)
    peer = tserve_peer("tserve", folder)
    one = phase(peer, out / "tserve-cold-warm.log", first)
    found: dict[str, Any] = {"cold_warm": one}
    single = max(one[key]["peak_per_process_mib"][0] for key in ("before_mixed_memory", "memory"))
    counted = max(one["resident_bytes"], default=single * 2**20)
    budget = int(BUDGET_FACTOR * counted)
    flags = ("--models-memory", str(budget), "--model-fit-timeout", "60", "--keep-alive", "10m")
    print(
        f"tserve: largest engine RSS {single:.0f} MiB, {counted / 2**20:.0f} MiB counted "
        f"after its first answer; --models-memory {budget}",
        flush=True,
    )
    budgeted = tserve_peer("tserve " + " ".join(flags), folder, *flags)
    try:
        switch = phase(budgeted, out / "tserve-switch.log", second)
    except SystemExit as exc:  # the server exited at start: its log's tail
        said = str(exc).strip().splitlines()[-1]
        print(f"tserve refused {' '.join(flags)}, so no switch figures: {said}", flush=True)
        switch = {"failed": f"tserve refused {' '.join(flags)}: {said}"}
    found["switch"] = {**switch, "budget_mib": budget / 2**20, "single_engine_mib": single}
    return found


def run_llama(
    exe: Path, folder: Path, out: Path, s: Settings, rng: random.Random
) -> dict[str, Any]:
    """llama-server's router: ``--models-max 3`` for phase 1, 1 for phase 2."""
    first, second = _phases(s, rng)
    three = llama_peer("llama-server --models-max 3", exe, folder, 3, s.streams)
    one = phase(three, out / "llama-cold-warm.log", first)
    single = llama_peer("llama-server --models-max 1", exe, folder, 1, s.streams)
    switch = phase(single, out / "llama-switch.log", second)
    return {"cold_warm": one, "switch": switch}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, default=None, help="default: the default model's GGUF")
    p.add_argument("--rounds", type=int, default=3, help="cold/warm rounds; switches: 2 x this")
    p.add_argument("--streams", type=int, default=16, help="mixed streams per model")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of a mixed stream")
    p.add_argument("--llama-server", type=Path, default=None, help="use this, build nothing")
    p.add_argument(
        "--peer-cache",
        type=Path,
        default=Path.home() / ".cache" / "tserve" / "peers",
        help="where vs_llamacpp.py builds llama-server once",
    )
    p.add_argument("--no-llama", action="store_true", help="tserve only")
    p.add_argument("--seed", type=int, default=0, help="of the random prompts")
    args = p.parse_args()
    from benchmarks.vs_llamacpp import ensure_llama_server
    from tserve.gpu.models._directory import default_gguf

    gguf = (args.gguf or default_gguf()).resolve()
    exe = None if args.no_llama else args.llama_server or ensure_llama_server(args.peer_cache)
    s = Settings(args.rounds, args.streams, args.max_tokens)
    rng = random.Random(args.seed)
    stem = result_stem("many_models")
    out = stem.parent / stem.name
    out.mkdir()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=stem.parent) as tmp:
        folder = Path(tmp) / "models"
        model_folder(gguf, folder)
        found = {"tserve": run_tserve(folder, out, s, rng)}
        if exe is not None:
            found["llama-server"] = run_llama(exe, folder, out, s, rng)
    rows = [summarize(name, f) for name, f in found.items()]
    markdown = (
        f"{len(MODELS)} names for {gguf.name}; streamed /v1/completions of {PROMPT_TOKENS} "
        f"random token ids; cold/warm: {s.rounds} round(s) x {len(MODELS)} models, "
        f"max_tokens 1; switch: {2 * s.rounds} alternations between two models with "
        f"one that fits; mixed: {s.streams} streams x {len(MODELS)} models at once, "
        f"max_tokens {s.max_tokens}. TTFT medians.\n\n{table(rows)}\n"
    )
    for r in rows:
        if "within_budget" in r:
            verdict = "within" if r["within_budget"] else "OVER"
            markdown += f"\n{r['server']}: peak engine RSS {verdict} the budget.\n"
    failed = found["tserve"]["switch"].get("failed")
    if failed:
        markdown += f"\ntserve's switch phase did not run: {failed.splitlines()[0]}\n"
    print("\n" + markdown)
    doc = {
        "gguf": str(gguf),
        "models": list(MODELS),
        "settings": dataclasses.asdict(s),
        "llama_server": None if exe is None else str(exe),
        "wall_s": time.monotonic() - t0,
        "load_average": os.getloadavg(),
        "summary": rows,
        "raw": found,
        "table": markdown,
    }
    path = write_json(stem, doc, indent=1)
    stem.with_suffix(".md").write_text(markdown)
    print(f"wrote {path} and .md (logs in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
