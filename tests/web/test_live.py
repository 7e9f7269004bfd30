"""A real server on loopback with the tiny model, driven by the official openai SDK and httpx."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable

import httpx
import openai
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.web.conftest import API_KEY, Server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("nothing_left_in_flight")]


def sync_client(server: Server, **kwargs: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, **kwargs)  # type: ignore[arg-type]


def sse_events(lines: list[str]) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


# -- the official SDK ---------------------------------------------------------------


def test_sdk_completion(server: Server) -> None:
    client = sync_client(server)
    out = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=7, extra_body={"ignore_eos": True}
    )
    assert out.object == "text_completion" and len(out.choices) == 1
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 7
    ids = server.client.post("/tokenize", json={"prompt": "Hello"}).json()["tokens"]
    assert out.usage.prompt_tokens == len(ids)
    detok = server.client.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert detok == "Hello"


def test_sdk_completion_stream_matches_greedy_whole(server: Server) -> None:
    client = sync_client(server)
    args = {"model": "tiny", "prompt": "abc", "max_tokens": 12, "temperature": 0.0}
    whole = client.completions.create(**args)  # type: ignore[call-overload]
    stream = client.completions.create(
        **args,
        stream=True,
        stream_options={"include_usage": True},  # type: ignore[call-overload]
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_sdk_chat_and_logprobs_and_n(server: Server) -> None:
    client = sync_client(server)
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        n=3,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    for choice in out.choices:
        assert choice.message.role == "assistant" and choice.finish_reason == "length"
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert len(choice.logprobs.content) == 5
        assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
    assert out.usage is not None and out.usage.completion_tokens == 15


@pytest.mark.trio
async def test_sdk_async_chat_stream(server: Server) -> None:
    """The client is closed in this test's loop even when a check fails: left to
    the collector, its finalizer would run on a later test's closed loop."""
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY) as client:
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
            max_completion_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        roles, finishes, usage = [], [], None
        async for chunk in stream:
            for c in chunk.choices:
                roles.append(c.delta.role)
                finishes.append(c.finish_reason)
            usage = chunk.usage or usage
    assert roles[0] == "assistant" and finishes[-1] == "length"
    assert usage is not None and usage.completion_tokens == 6


@pytest.mark.trio
async def test_sdk_async_completion(server: Server) -> None:
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY) as client:
        outs = []
        async with trio.open_nursery() as nursery:
            for seed in range(4):

                async def one(seed: int = seed) -> None:
                    outs.append(
                        await client.completions.create(
                            model="tiny", prompt=[1, 2, 3], max_tokens=4, seed=seed
                        )
                    )

                nursery.start_soon(one)
        assert len(outs) == 4 and all(o.usage and o.usage.prompt_tokens == 3 for o in outs)


def test_sdk_errors(server: Server) -> None:
    client = sync_client(server, max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="x", temperature=9)
    assert bad.value.param == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=100_000)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x")
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_prompt_tokens_total_counts_each_prompt_once_as_usage_does(server: Server) -> None:
    """With ``n`` choices per prompt the prompt is counted once, in the response's
    usage and in ``vllm:prompt_tokens_total`` alike, streamed or not."""
    client = sync_client(server)
    args = {"model": "tiny", "prompt": ["Hello there", "abc"], "n": 3, "max_tokens": 2}
    for stream in (False, True):
        before = server.metric("vllm:prompt_tokens_total")
        if stream:
            chunks = list(
                client.completions.create(  # type: ignore[call-overload]
                    **args, stream=True, stream_options={"include_usage": True}
                )
            )
            usage = chunks[-1].usage
        else:
            usage = client.completions.create(**args).usage  # type: ignore[call-overload]
        assert usage is not None
        server.wait_for_metric("tserve_http_generations_in_flight", 0)
        counted = server.metric("vllm:prompt_tokens_total") - before
        assert counted == usage.prompt_tokens > 0, stream


# -- HTTP details ----------------------------------------------------------------------


def test_request_id_probes_and_auth(server: Server) -> None:
    anon = httpx.Client(base_url=server.url)
    for path in ("/health", "/ready", "/metrics", "/version"):
        assert anon.get(path).status_code == 200, path
    r = anon.get("/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = server.client.get("/v1/models", headers={"X-Request-Id": "abc-123"})
    assert r.headers["X-Request-Id"] == "abc-123"
    r = server.client.get("/v1/models", headers={"X-Request-Id": "bad id!" * 30})
    assert len(r.headers["X-Request-Id"]) == 32
    r = server.client.get("/nowhere")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert "X-Request-Id" in r.headers
    assert server.client.delete("/v1/completions").status_code == 405
    json_type = {"Content-Type": "application/json"}
    big = server.client.post("/v1/completions", content=b"x" * (5 << 20), headers=json_type)
    assert big.status_code == 413 and big.json()["error"]["code"] == "payload_too_large"
    chunked = server.client.post(
        "/v1/completions", content=iter([b"x" * (1 << 20)] * 5), headers=json_type
    )
    assert chunked.status_code == 413
    anon.close()


def test_prompt_past_the_context_is_400_streaming_or_not(server: Server) -> None:
    for stream in (False, True):
        r = server.client.post(
            "/v1/completions", json={"prompt": [5] * 600, "max_tokens": 1, "stream": stream}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = server.client.post(
            "/v1/completions", json={"prompt": [600], "max_tokens": 1, "stream": stream}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_stop_strings_and_echo(server: Server) -> None:
    base = {"prompt": "hello", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    full = server.client.post("/v1/completions", json=base).json()["choices"][0]["text"]
    assert len(full) > 4
    stop = full[2:4]
    cut = server.client.post("/v1/completions", json={**base, "stop": stop}).json()
    assert cut["choices"][0]["text"] == full[: full.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    echo = server.client.post("/v1/completions", json={**base, "echo": True}).json()
    assert echo["choices"][0]["text"] == "hello" + full


# -- disconnects free the engine ---------------------------------------------------


def test_disconnect_mid_stream_aborts(server: Server) -> None:
    check_disconnect_mid_stream_aborts(server)


def test_disconnect_during_non_streaming_aborts(server: Server) -> None:
    check_disconnect_during_non_streaming_aborts(server)


ATTEMPTS = 5  # hang-ups tried before a check gives up; one that came too late proves nothing


def check_disconnect_mid_stream_aborts(server: Server) -> None:
    """A client that hangs up mid-stream: its request is aborted and its KV freed."""
    body = {"prompt": "x", "max_tokens": 480, "ignore_eos": True, "stream": True}

    def hang_up() -> None:
        with server.client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")

    _until_aborted(server, hang_up)
    server.wait_for_metric("tserve_requests_running", 0)


def check_disconnect_during_non_streaming_aborts(server: Server) -> None:
    """A client that gives up on a non-streamed n=8: all 8 aborted, the KV freed."""
    body = {"prompt": "x", "max_tokens": 480, "ignore_eos": True, "n": 8}

    def give_up() -> None:
        with contextlib.suppress(httpx.ReadTimeout):
            server.client.post("/v1/completions", json=body, timeout=0.3)

    _until_aborted(server, give_up)


def _until_aborted(server: Server, hang_up: Callable[[], None]) -> None:
    """Run ``hang_up`` until one of its hang-ups is aborted; each time the engine
    is left with nothing (no live request, no KV held).

    The tiny model may finish a request before its client's hang-up reaches
    the server (it generates fast; a loaded machine delays the client): that
    try sends no abort and proves nothing, so the next one runs. A server that
    never aborts fails every try.
    """
    for _ in range(ATTEMPTS):
        aborts = server.metric("tserve_aborts_sent_total")
        hang_up()
        server.wait_for_metric("tserve_requests_live", 0)
        server.wait_for_metric("tserve_kv_cache_used_tokens", 0)
        if server.metric("tserve_aborts_sent_total") > aborts:
            return
    raise AssertionError(f"none of {ATTEMPTS} hang-ups was aborted")


# -- the seed, over HTTP, from another process ------------------------------------------

SEED_CLIENT = textwrap.dedent(
    """
    import json, sys, httpx, trio

    URL, COUNT, TOKENS, KEY = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

    async def one(client, i, results):
        body = {"model": "tiny", "prompt": f"seed {i}", "max_tokens": TOKENS,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            usage, done, errors = None, False, []
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        errors.append(event["error"])
                    elif event.get("usage"):
                        usage = event["usage"]["completion_tokens"]
            results.append((r.status_code, usage, done, errors))

    async def main():
        limits = httpx.Limits(max_connections=COUNT)
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=URL, limits=limits, timeout=120,
                                     headers=headers) as client:
            results = []
            async with trio.open_nursery() as nursery:
                for i in range(COUNT):
                    nursery.start_soon(one, client, i, results)
        print(json.dumps(results))

    trio.run(main)
    """
)


def test_hundreds_of_concurrent_streams_from_another_process(server: Server) -> None:
    count, tokens = 300, 24
    out = subprocess.run(
        [sys.executable, "-c", SEED_CLIENT, server.url, str(count), str(tokens), API_KEY],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout)
    assert len(results) == count
    bad = [r for r in results if r != [200, tokens, True, []]]
    assert not bad, bad[:5]
    server.wait_for_metric("tserve_requests_live", 0)


# -- fuzz: generated bodies never get a 5xx and never wedge the server -------------------

_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**65), max_value=2**65),
    st.integers(min_value=-2, max_value=40),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.lists(st.integers(min_value=-5, max_value=600), max_size=6),
    st.lists(st.text(max_size=4), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "bot", 5]), "content": _values}
)
_fields = {
    "model": st.sampled_from(["tiny", "other", 3]),
    "prompt": st.one_of(_values, st.text(max_size=30)),
    "messages": st.one_of(st.lists(_message, max_size=3), _values),
    "max_tokens": st.one_of(st.integers(min_value=-1, max_value=12), _values),
    "max_completion_tokens": st.integers(min_value=-1, max_value=12),
    "temperature": st.one_of(st.floats(min_value=-1, max_value=3), _values),
    "top_p": st.floats(min_value=-0.5, max_value=1.5),
    "top_k": st.integers(min_value=-3, max_value=600),
    "seed": st.one_of(st.integers(min_value=-(2**64), max_value=2**64), _values),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=20)),
    "n": st.integers(min_value=-1, max_value=4),
    "logprobs": st.one_of(st.booleans(), st.integers(min_value=-1, max_value=22)),
    "top_logprobs": st.integers(min_value=-1, max_value=22),
    "presence_penalty": st.floats(min_value=-3, max_value=3),
    "frequency_penalty": _values,
    "echo": _values,
    "stream": st.booleans(),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), _values),
    "ignore_eos": st.booleans(),
    "stop_token_ids": _values,
    "best_of": _values,
    "logit_bias": _values,
    "tools": _values,
    "response_format": _values,
    "user": _values,
}
_bodies = st.fixed_dictionaries({}, optional=_fields)


@settings(
    max_examples=1500,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=_bodies, chat=st.booleans(), raw=st.one_of(st.none(), st.binary(max_size=40)))
def test_fuzz_never_5xx(
    server: Server, body: dict[str, object], chat: bool, raw: bytes | None
) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    content = raw if raw is not None else json.dumps(body).encode()
    json_type = {"Content-Type": "application/json"}
    with server.client.stream("POST", path, content=content, headers=json_type, timeout=30) as r:
        text = r.read().decode(errors="replace")
    assert r.status_code < 500, (r.status_code, text, body)
    if r.status_code != 200:
        error = json.loads(text)["error"]
        assert set(error) == {"message", "type", "param", "code"}
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert text.endswith("data: [DONE]\n\n")
        assert '"error"' not in text, text
