"""What structured outputs cost a server: throughput under constraints, and stream
latency while a large schema compiles.

Run: ``python -m benchmarks.structured [--model default] [--base-url URL --name NAME]``

With no ``--base-url`` it starts ``python -m tserve serve MODEL`` (the default
model unless told) on a free port; with one, it measures that server (an
OpenAI-compatible peer such as vLLM, serving ``--name``). Both parts go
through the ``openai`` SDK, on /v1/chat/completions, at temperature 0.8:

(a) throughput: 32 requests with a JSON-schema ``response_format`` and 32
    plain ones, all sent at once; output tokens per second (all completion
    tokens ÷ the time until the last finishes). Then the same 64 requests
    with the constraint removed, each with ``max_tokens`` = the length its
    first run produced and ``ignore_eos``, so both runs produce the same
    tokens. Ratio = constrained ÷ unconstrained (target >= 0.95). The
    prompts are sent once before, so both runs find them in the prefix cache,
    and one constrained request, so the constrained run finds its schema
    compiled (a server's first constrained request also builds its grammar
    tokenizer: a cost once per server, not per token).
    ``--throughput-rounds`` pairs run back to back; the figure is the median
    of their ratios (one pair on a shared machine swings by ±10 %), and
    every pair is in the JSON.
(b) latency: one plain stream (``--stream-tokens`` tokens, ``ignore_eos``);
    inter-token gaps, p99, alone and while a request constrained by a
    128-tool schema (an ``anyOf`` of 128 call objects, new names each
    round, so no cache hit) starts after its 5th token. Rounds alternate
    alone / with, ``--rounds`` each; ratio = p99 with ÷ p99 alone (target <= 2).
    A third stream of each round has the same side request without its
    grammar: ``ratio_vs_plain_side`` = p99 with the grammar ÷ p99 beside
    that, what the grammar itself costs.
(c) hostile storm: the same plain stream's time to first token and ITL p99,
    alone and while 16 expensive grammars compile and mask, sent just before
    it: 8 new 128-tool schemas (compiles) and 8 regexes whose lexers blow up
    (``((a{100}){100}){100}``-like, each its own), which a server may refuse
    (tserve's check does, with a 400, after a tenth of a second of its grammar
    worker) or run until their masks exceed its budget.
    ``--storm-rounds`` of each, alternating; ratios = storm ÷ alone for the
    median TTFT and the pooled ITL p99 (target <= 2 for both). The storm's
    requests come from a second client process, as other users' would: this
    process's event loop reads the stream alone (parsing the storm's answers
    in it delayed the stream's chunks by milliseconds). How the storm's
    requests ended (status codes) is in the JSON. A third stream of each
    round runs beside the 8 schema requests' bodies without their grammars
    (the 8 regex requests are refused at their check, so they decode
    nothing): what the storm's extra decoding rows cost on their own.
    ``itl_ratio_vs_plain_storm`` = p99 in the storm ÷ p99 beside that, what
    the grammars themselves cost.

The prompts of (b)'s and (c)'s side requests are sent once before, as (a)'s
are, so those parts measure the grammars and not the first prefill of a new
prompt beside the stream (one step that costs up to ``--max-decode-slowdown``
decode steps, with or without a grammar).

Writes ``results/structured-<name>-<stamp>.json`` and ``.png``. The JSON's
``ratios`` holds the four headline figures, each with its target and whether
it is met, and ``load_average`` the machine's 1-minute load before and after
(the figures are only comparable between runs on an equally quiet machine).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import openai

from benchmarks._results import result_stem, write_json
from benchmarks._serve import serve

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "tier": {"enum": ["free", "pro", "team"]},
    },
    "required": ["name", "age", "member", "tier"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a customer of a small bakery.",
    "Invent a character for a story about the sea.",
    "Who is the oldest member of a chess club?",
    "Tell me about a new user of a music app.",
]
SIDE_PROMPT = "Call a tool."  # (b)'s side request
STORM_PROMPT = "Fill this in."  # (c)'s hostile requests


def person_format(i: int) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": f"person{i}", "schema": PERSON}}


def tools_schema(tag: str, count: int = 128) -> dict[str, Any]:
    """An ``anyOf`` of ``count`` tool-call objects, each with its own arguments."""
    calls = []
    for i in range(count):
        arguments = {
            "type": "object",
            "properties": {
                f"city_{i}": {"type": "string", "maxLength": 20},
                f"days_{i}": {"type": "integer", "minimum": 1, "maximum": 14},
                f"unit_{i}": {"enum": ["c", "f", "k"]},
                f"detail_{i}": {"type": "boolean"},
            },
            "required": [f"city_{i}", f"unit_{i}"],
            "additionalProperties": False,
        }
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": f"tool_{tag}_{i}"}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return {"anyOf": calls}


async def chat(
    client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int, **extra: Any
) -> tuple[int, str | None]:
    out = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0.8,
        **extra,
    )
    usage = out.usage
    assert usage is not None
    return usage.completion_tokens, out.choices[0].finish_reason


async def throughput_pair(
    client: openai.AsyncOpenAI, model: str, max_tokens: int, constrained: int = 32, plain: int = 32
) -> dict[str, Any]:
    """One pair of part (a): the two runs of the 64 requests and their tokens per second."""
    kinds = ["constrained"] * constrained + ["plain"] * plain
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(kinds))]

    async def first(i: int) -> tuple[int, str | None]:
        extra: dict[str, Any] = {}
        if kinds[i] == "constrained":
            extra["response_format"] = person_format(i)
        return await chat(client, model, prompts[i], max_tokens, **extra)

    # Both runs find the prompts in the prefix cache (the second would otherwise be
    # alone to), and the constrained one its grammar compiled (a server's first
    # constrained request also builds its grammar tokenizer: a one-time cost, not
    # a cost per token; (b) measures what a compile costs a stream).
    await asyncio.gather(
        *(chat(client, model, p, 1) for p in PROMPTS),
        chat(client, model, PROMPTS[0], 4, response_format=person_format(0)),
    )
    start = time.perf_counter()
    runs = await asyncio.gather(*(first(i) for i in range(len(kinds))))
    with_constraint = time.perf_counter() - start
    lengths = [max(1, n) for n, _ in runs]

    async def again(i: int) -> tuple[int, str | None]:
        return await chat(client, model, prompts[i], lengths[i], extra_body={"ignore_eos": True})

    start = time.perf_counter()
    repeats = await asyncio.gather(*(again(i) for i in range(len(kinds))))
    without = time.perf_counter() - start
    tokens = sum(n for n, _ in runs)
    tokens_again = sum(n for n, _ in repeats)
    finishes = [f for (_, f), kind in zip(runs, kinds, strict=True) if kind == "constrained"]
    return {
        "requests": len(kinds),
        "constrained_requests": constrained,
        "tokens": tokens,
        "tokens_unconstrained": tokens_again,
        "seconds_constrained": with_constraint,
        "seconds_unconstrained": without,
        "tok_s_constrained": tokens / with_constraint,
        "tok_s_unconstrained": tokens_again / without,
        "ratio": (tokens / with_constraint) / (tokens_again / without),
        "constrained_finishes": {f or "none": finishes.count(f) for f in set(finishes)},
    }


async def throughput(
    client: openai.AsyncOpenAI, model: str, max_tokens: int, rounds: int
) -> dict[str, Any]:
    """Part (a), ``rounds`` pairs; the pair with the median ratio is the headline."""
    pairs = [await throughput_pair(client, model, max_tokens) for _ in range(rounds)]
    ratios = [pair["ratio"] for pair in pairs]
    median = sorted(pairs, key=lambda pair: pair["ratio"])[(rounds - 1) // 2]
    return {**median, "ratios": ratios, "median_ratio": statistics.median(ratios), "pairs": pairs}


async def stream_gaps(
    client: openai.AsyncOpenAI, model: str, tokens: int, side: dict[str, Any] | None
) -> tuple[list[float], float | None]:
    """One plain stream's inter-chunk gaps; with ``side`` (the extra body of a
    side request: ``{}`` for none), a side request starts after its 5th chunk.
    Also the seconds that request took (None alone)."""
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Write a long story about a lighthouse."}],
        max_tokens=tokens,
        temperature=0.8,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    times: list[float] = []
    task: asyncio.Task[tuple[int, str | None]] | None = None
    side_start = 0.0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
        if side is not None and task is None and len(times) == 5:
            side_start = time.perf_counter()
            task = asyncio.create_task(chat(client, model, SIDE_PROMPT, 8, extra_body=side))
    side_seconds = None
    if task is not None:
        await task
        side_seconds = time.perf_counter() - side_start
    return [b - a for a, b in itertools.pairwise(times)], side_seconds


def storm_requests(tag: str) -> list[dict[str, Any]]:
    """The 16 hostile requests' extra bodies: 8 compiles, 8 slow masks (all new)."""
    return [{"structured_outputs": {"json": tools_schema(f"{tag}s{i}")}} for i in range(8)] + [
        {"structured_outputs": {"regex": f"(({chr(97 + i)}{{100}}){{100}}){{100}}{tag}"}}
        for i in range(8)
    ]


async def hostile(client: openai.AsyncOpenAI, model: str, extra: dict[str, Any]) -> str:
    """One storm request: how it ended (a finish reason or an error status)."""
    try:
        _, finish = await chat(client, model, STORM_PROMPT, 24, extra_body=extra)
    except openai.APIStatusError as exc:
        return str(exc.status_code)
    return finish or "none"


async def timed_stream(
    client: openai.AsyncOpenAI, model: str, tokens: int
) -> tuple[float, list[float]]:
    """One plain stream: seconds to its first token, and its inter-token gaps."""
    start = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Write a long story about a lighthouse."}],
        max_tokens=tokens,
        temperature=0.8,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    times: list[float] = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
    return times[0] - start, [b - a for a, b in itertools.pairwise(times)]


async def storm(
    client: openai.AsyncOpenAI, model: str, tokens: int, rounds: int, base_url: str
) -> dict[str, Any]:
    """Part (c): TTFT and ITL of a plain stream alone and beside 16 hostile grammars,
    those sent by a process of their own (``--send-storm``), as other clients'
    would be: this process's event loop reads the stream and nothing else."""
    ttft_alone: list[float] = []
    ttft_storm: list[float] = []
    alone: list[float] = []
    beside: list[float] = []
    plain: list[float] = []
    endings: list[str] = []
    stamp = str(int(time.time()))
    sender = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "benchmarks.structured",
        "--send-storm",
        "--base-url",
        base_url,
        "--served-model",
        model,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert sender.stdin is not None and sender.stdout is not None
    stdin, stdout = sender.stdin, sender.stdout
    assert json.loads(await stdout.readline()) == "ready"

    async def beside_requests(extras: list[dict[str, Any]]) -> tuple[float, list[float], list[str]]:
        stdin.write(json.dumps(extras).encode() + b"\n")
        await stdin.drain()
        await asyncio.sleep(0.2)  # the requests are in: their checks and compiles have begun
        first, gaps = await timed_stream(client, model, tokens)
        return first, gaps, json.loads(await stdout.readline())

    try:
        for r in range(rounds):
            first, gaps = await timed_stream(client, model, tokens)
            ttft_alone.append(first)
            alone += gaps
            first, gaps, ended = await beside_requests(storm_requests(f"{stamp}r{r}"))
            ttft_storm.append(first)
            beside += gaps
            endings += ended
            plain += (await beside_requests([{} for _ in range(8)]))[1]
    finally:
        stdin.close()
        await sender.wait()
    ttft_ratio = statistics.median(ttft_storm) / statistics.median(ttft_alone)
    return {
        "rounds": rounds,
        "stream_tokens": tokens,
        "ttft_alone_ms": [t * 1e3 for t in ttft_alone],
        "ttft_storm_ms": [t * 1e3 for t in ttft_storm],
        "ttft_ratio": ttft_ratio,
        "itl_p99_alone_ms": p99(alone) * 1e3,
        "itl_p99_storm_ms": p99(beside) * 1e3,
        "itl_ratio": p99(beside) / p99(alone),
        "itl_p99_plain_storm_ms": p99(plain) * 1e3,
        "itl_ratio_vs_plain_storm": p99(beside) / p99(plain),
        "storm_endings": {e: endings.count(e) for e in sorted(set(endings))},
        "storm_sender": "a process of its own",
    }


async def send_storm(base_url: str, model: str) -> None:
    """``--send-storm``: the storm's sender. Prints "ready" (JSON) once warm, then
    for each line of stdin (a JSON list of extra bodies) sends those requests
    at once and prints how each ended (a JSON list), until stdin ends."""
    loop = asyncio.get_running_loop()
    async with openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=600
    ) as client:
        await asyncio.gather(*(chat(client, model, "Hello", 1) for _ in range(8)))  # 8 connections
        print(json.dumps("ready"), flush=True)
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            extras = json.loads(line)
            ended = await asyncio.gather(*(hostile(client, model, extra) for extra in extras))
            print(json.dumps(ended), flush=True)


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


async def latency(
    client: openai.AsyncOpenAI, model: str, tokens: int, rounds: int
) -> dict[str, Any]:
    """Part (b): gaps pooled over the rounds, alone, beside the side request
    without a grammar, and beside it with a new 128-tool schema."""
    alone: list[float] = []
    plain_side: list[float] = []
    beside: list[float] = []
    side_seconds: list[float] = []
    stamp = str(int(time.time()))
    for r in range(rounds):
        gaps, _ = await stream_gaps(client, model, tokens, None)
        alone += gaps
        gaps, _ = await stream_gaps(client, model, tokens, {})
        plain_side += gaps
        grammar = {"structured_outputs": {"json": tools_schema(f"{stamp}r{r}")}}
        gaps, seconds = await stream_gaps(client, model, tokens, grammar)
        beside += gaps
        assert seconds is not None
        side_seconds.append(seconds)
    return {
        "rounds": rounds,
        "stream_tokens": tokens,
        "itl_p99_alone_ms": p99(alone) * 1e3,
        "itl_p99_plain_side_ms": p99(plain_side) * 1e3,
        "itl_p99_compiling_ms": p99(beside) * 1e3,
        "itl_median_alone_ms": statistics.median(alone) * 1e3,
        "itl_median_compiling_ms": statistics.median(beside) * 1e3,
        "ratio": p99(beside) / p99(alone),
        "ratio_vs_plain_side": p99(beside) / p99(plain_side),
        "tool_request_seconds": side_seconds,
    }


def headline(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The four ratios the targets are about, each with its target and whether it is met."""
    a, b, c = result["throughput"], result["latency"], result["storm"]
    figures = {
        "mixed_load_throughput": (a["median_ratio"], ">=", 0.95),
        "itl_p99_beside_one_compile": (b["ratio"], "<=", 2.0),
        "storm_itl_p99": (c["itl_ratio"], "<=", 2.0),
        "storm_ttft": (c["ttft_ratio"], "<=", 2.0),
    }
    return {
        name: {
            "ratio": value,
            "target": f"{op} {bound}",
            "met": value >= bound if op == ">=" else value <= bound,
        }
        for name, (value, op, bound) in figures.items()
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, b, c = result["throughput"], result["latency"], result["storm"]
    fig, (left, right, third) = plt.subplots(1, 3, figsize=(15, 4))
    rates = [a["tok_s_unconstrained"], a["tok_s_constrained"]]
    left.bar(["unconstrained", "32 constrained"], rates)
    left.set_ylabel("output tok/s (64 requests)")
    left.set_title(f"median throughput ratio {a['median_ratio']:.3f} (target >= 0.95)")
    right.bar(
        ["alone", "side request", "128-tool compile"],
        [b["itl_p99_alone_ms"], b["itl_p99_plain_side_ms"], b["itl_p99_compiling_ms"]],
    )
    right.set_ylabel("stream ITL p99 (ms)")
    right.set_title(f"p99 ratio {b['ratio']:.2f} (target <= 2)")
    third.bar(
        ["alone", "8 plain requests", "16 hostile grammars"],
        [c["itl_p99_alone_ms"], c["itl_p99_plain_storm_ms"], c["itl_p99_storm_ms"]],
    )
    third.set_ylabel("stream ITL p99 (ms)")
    third.set_title(f"storm: ITL {c['itl_ratio']:.2f}, TTFT {c['ttft_ratio']:.2f} (target <= 2)")
    fig.suptitle(f"structured outputs: {result['name']} ({result['model']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def measure(args: argparse.Namespace, base_url: str, model: str) -> dict[str, Any]:
    async with openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=600
    ) as client:
        await chat(client, model, "Hello", 4)  # warm-up
        load_before = os.getloadavg()[0]
        part_a = await throughput(client, model, args.max_tokens, args.throughput_rounds)
        # The side requests' prompts are in the prefix cache before (b) and (c).
        await asyncio.gather(*(chat(client, model, p, 1) for p in (SIDE_PROMPT, STORM_PROMPT)))
        part_b = await latency(client, model, args.stream_tokens, args.rounds)
        part_c = await storm(client, model, args.stream_tokens, args.storm_rounds, base_url)
        result = {
            "name": args.name,
            "model": model,
            "base_url": base_url,
            "max_tokens": args.max_tokens,
            "cpu_count": os.cpu_count(),
            "load_average": {"before": load_before, "after": os.getloadavg()[0]},
            "throughput": part_a,
            "latency": part_b,
            "storm": part_c,
        }
        return {**result, "ratios": headline(result)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default", help="what tserve serves (no --base-url)")
    parser.add_argument("--base-url", help="measure this server instead (no /v1)")
    parser.add_argument("--name", default="tserve", help="the label, and the served model name")
    parser.add_argument("--served-model", help="the model name to ask for (default: --name's)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--stream-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3, help="latency rounds")
    parser.add_argument("--throughput-rounds", type=int, default=5)
    parser.add_argument("--storm-rounds", type=int, default=3, help="hostile-storm rounds")
    parser.add_argument("--send-storm", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    process = None
    base_url = args.base_url
    model = args.served_model or args.name
    if args.send_storm:  # part (c)'s sender, started by part (c)
        asyncio.run(send_storm(base_url, model))
        return
    if base_url is None:
        stem = result_stem(f"structured-{args.name}")
        log = stem.with_suffix(".log")
        process, base_url = serve(args.model, log, "--served-model-name", model)
    try:
        result = asyncio.run(measure(args, base_url, model))
    finally:
        if process is not None:
            process.terminate()
            process.wait(60)
    stem = result_stem(f"structured-{args.name}")
    print(write_json(stem, result))
    plot(result, stem.with_suffix(".png"))
    a, b, c = result["throughput"], result["latency"], result["storm"]
    print(
        f"{args.name}: throughput {a['tok_s_constrained']:.1f} / {a['tok_s_unconstrained']:.1f} "
        f"tok/s = {a['ratio']:.3f} (median of {[round(r, 3) for r in a['ratios']]}); "
        f"ITL p99 {b['itl_p99_compiling_ms']:.1f} / {b['itl_p99_alone_ms']:.1f} ms "
        f"= {b['ratio']:.2f} (beside the side request without its grammar "
        f"{b['itl_p99_plain_side_ms']:.1f} ms, {b['ratio_vs_plain_side']:.2f}); "
        f"storm: TTFT ratio {c['ttft_ratio']:.2f}, "
        f"ITL p99 {c['itl_p99_storm_ms']:.1f} / {c['itl_p99_alone_ms']:.1f} ms "
        f"= {c['itl_ratio']:.2f} (beside its 8 schema requests without grammars "
        f"{c['itl_p99_plain_storm_ms']:.1f} ms, {c['itl_ratio_vs_plain_storm']:.2f}), "
        f"storm endings {c['storm_endings']}; load average "
        f"{result['load_average']['before']:.1f} -> {result['load_average']['after']:.1f}"
    )


if __name__ == "__main__":
    main()
