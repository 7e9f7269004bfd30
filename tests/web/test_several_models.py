"""``python -m tserve serve A B``: several models over HTTP, each loaded on its first
request, through real engine processes on two tiny models and the real clients.

Loads are held with the engine's load hold (``TSERVE_TEST_FAULT_LOAD_HOLD``), streams
with the echo engine and more tokens than a test waits for; every wait is on a
state the server reports (polled under the hang guard), never on the clock.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.guards import HANG_GUARD
from tests.processes import child_pids, process_gone
from tests.web.conftest import API_KEY, Server

ECHO = ("--engine-kind", "echo", "--echo-step-time", "0.2")  # 5 tokens a second
# A sampled request of the tiny model may end on its eos before max_tokens ("stop"):
# one whose finish_reason must be "length" ignores it.
TO_THE_END: Any = {"ignore_eos": True}


@pytest.fixture(scope="module")
def second_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second tiny model: other weights (another seed), same layout."""
    from tserve.gpu.models._directory import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-seed-1"), seed=1)


@pytest.fixture
def start_models(
    tiny_model_dir: Path, second_model_dir: Path, tmp_path: Path
) -> Iterator[Callable[..., Server]]:
    """``start_models(*args)``: ``serve a=TINY b=SECOND *args``; killed at teardown."""
    servers: list[Server] = []

    def start(*args: str, models: tuple[str, ...] | None = None) -> Server:
        if models is None:
            models = (f"a={tiny_model_dir}", f"b={second_model_dir}")
        log = tmp_path / f"server{len(servers)}.log"
        server = Server(None, *models, *args, log=log)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(signal.SIGKILL)


def _client(server: Server, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, **kwargs)


def _states(server: Server) -> dict[str, str]:
    cards = server.client.get("/v1/models").json()["data"]
    return {card["id"]: card["state"] for card in cards}


def _wait_for(predicate: Callable[[], bool], what: str) -> None:
    """Poll a state the server reports; a hang guard, not a timing check."""
    deadline = time.monotonic() + HANG_GUARD
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.02)


def _model_metric(server: Server, name: str, model: str) -> float:
    """The sum of ``name``'s samples labelled with ``model`` on one scrape."""
    label = f'model_name="{model}"'
    lines = server.client.get("/metrics").text.splitlines()
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith(name + "{") and label in line.split("}")[0]
    ]
    if not values:
        raise KeyError(f"{name}{{{label}}}")
    return sum(values)


def _sse_events(response: httpx.Response) -> Iterator[str]:
    """Each ``data:`` payload of an SSE response, as it arrives."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


def test_a_hundred_first_requests_cause_one_load(start_models: Callable[..., Server]) -> None:
    """100 concurrent first requests through the openai client for a model
    with no engine: one load, 100 answers; the other model stays unloaded."""
    server = start_models()
    assert _states(server) == {"a": "unloaded", "b": "unloaded"}
    ready = server.client.get("/ready").json()
    assert (ready["status"], ready["models"]) == ("ready", {"a": "unloaded", "b": "unloaded"})
    assert ready["resident_bytes"] == 0 and ready["memory_budget"] > 0

    async def ask_all() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        async with client:
            asks = [
                client.completions.create(model="b", prompt="hello", max_tokens=4, temperature=0)
                for _ in range(100)
            ]
            return await asyncio.gather(*asks)

    answers = asyncio.run(ask_all())
    assert len(answers) == 100 and {a.model for a in answers} == {"b"}
    assert len({a.choices[0].text for a in answers}) == 1  # greedy: one text
    assert _states(server) == {"a": "unloaded", "b": "loaded"}
    assert _model_metric(server, "tserve_model_loads_total", "b") == 1
    assert _model_metric(server, "tserve_model_loads_total", "a") == 0
    assert _model_metric(server, "vllm:request_success_total", "b") == 100
    assert _model_metric(server, "tserve_requests_live", "b") == 0  # every slot freed
    assert _model_metric(server, "tserve_model_resident_bytes", "b") > 0
    assert _model_metric(server, "tserve_model_state", "b") == 1  # one state at a time
    card = server.client.get("/v1/models/b").json()
    assert card["state"] == card["status"]["value"] == "loaded" and card["max_model_len"] > 0


def test_a_client_that_hangs_up_while_its_model_loads_leaves_nothing(
    start_models: Callable[..., Server], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The only request waiting for a held load hangs up: the load is cancelled,
    its engine process stopped, the model unloaded, nothing left in flight;
    /health answers meanwhile; once loads may finish, the next request loads it."""
    hold = tmp_path / "hold"
    hold.mkdir()
    monkeypatch.setenv("TSERVE_TEST_FAULT_LOAD_HOLD", str(hold))
    server = start_models()
    before = child_pids(server.process.pid)
    body = json.dumps({"model": "b", "messages": [{"role": "user", "content": "hi"}]}).encode()
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        _wait_for(lambda: any(hold.glob("held-*")), "the engine holds its load")
        engine = int(next(hold.glob("held-*")).name.removeprefix("held-"))
        assert _states(server)["b"] == "loading"
        assert server.client.get("/health").json() == {"status": "ok"}
    _wait_for(lambda: _states(server)["b"] == "unloaded", "the load is cancelled")
    _wait_for(lambda: process_gone(engine), "the engine exits")
    assert child_pids(server.process.pid) == before
    assert server.metric("tserve_http_generations_in_flight") == 0
    assert _model_metric(server, "tserve_model_loads_total", "b") == 0
    (hold / "release").touch()
    answer = _client(server).chat.completions.create(
        model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=3, extra_body=TO_THE_END
    )
    assert answer.model == "b" and answer.choices[0].finish_reason == "length"
    assert _model_metric(server, "tserve_model_loads_total", "b") == 1
    assert _model_metric(server, "tserve_requests_live", "b") == 0


def test_a_load_past_the_timeout_is_a_503_naming_the_model(
    start_models: Callable[..., Server], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load that cannot finish (held) outlasts --model-load-timeout: the request
    gets a 503 naming the model and the option; the load it alone waited for is
    cancelled and its engine gone."""
    hold = tmp_path / "hold"
    hold.mkdir()
    monkeypatch.setenv("TSERVE_TEST_FAULT_LOAD_HOLD", str(hold))
    server = start_models("--model-load-timeout", "1")
    with pytest.raises(openai.InternalServerError) as late:
        _client(server).completions.create(model="a", prompt="hi", max_tokens=2)
    assert late.value.status_code == 503
    error = late.value.body
    assert isinstance(error, dict) and error["code"] == "model_load_timeout"
    assert "'a'" in error["message"] and "--model-load-timeout" in error["message"]
    _wait_for(lambda: _states(server)["a"] == "unloaded", "the load is cancelled")
    assert not child_pids(server.process.pid)  # UNLOADED: its engine process is gone


def test_a_failed_load_names_the_model_and_the_next_request_retries(
    start_models: Callable[..., Server], tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A bad file: a 503 naming the model on the OpenAI and Anthropic routes, the
    model shown failed with its reason, /health still 200, the other model
    serving; once the file is good, the next request loads it."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a GGUF file")
    server = start_models(models=(f"a={tiny_model_dir}", str(bad)))
    client = _client(server)
    with pytest.raises(openai.InternalServerError) as failed:
        client.completions.create(model="bad", prompt="hi", max_tokens=2)
    error = failed.value.body
    assert isinstance(error, dict) and error["code"] == "model_load_failed"
    assert "the model 'bad' failed to load" in error["message"] and error["param"] == "model"
    card = server.client.get("/v1/models/bad").json()
    assert card["state"] == "failed" and card["reason"]
    assert server.client.get("/health").status_code == 200
    messages = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as overloaded:
        messages.messages.create(
            model="bad", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    assert "'bad'" in str(overloaded.value)
    answer = client.completions.create(model="a", prompt="hi", max_tokens=2, extra_body=TO_THE_END)
    assert answer.choices[0].finish_reason == "length"
    bad.unlink()
    bad.symlink_to(tiny_model_dir)
    fixed = client.completions.create(model="bad", prompt="hi", max_tokens=2, extra_body=TO_THE_END)
    assert fixed.model == "bad" and fixed.choices[0].finish_reason == "length"
    assert _states(server)["bad"] == "loaded"


def test_an_unknown_model_is_a_404_listing_the_names_on_every_api(
    start_models: Callable[..., Server],
) -> None:
    """Each route that takes a model, in its own API's error shape; a request that
    names no model is a 400 naming the field when several are served."""
    server = start_models()
    client = _client(server)
    chat = [{"role": "user", "content": "hi"}]
    calls: list[Callable[[], object]] = [
        lambda: client.completions.create(model="c", prompt="hi", max_tokens=2),
        lambda: client.chat.completions.create(model="c", messages=chat, max_tokens=2),  # type: ignore[arg-type]
        lambda: client.responses.create(model="c", input="hi", max_output_tokens=16),
        lambda: client.models.retrieve("c"),
    ]
    for call in calls:
        with pytest.raises(openai.NotFoundError) as missing:
            call()
        error = missing.value.body
        assert isinstance(error, dict) and error["code"] == "model_not_found", error
        assert "'c'" in error["message"] and "served: a, b" in error["message"]
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        reply = server.client.post(path, json={"model": "c", **body})
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
    messages = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    asks: list[Callable[[], object]] = [
        lambda: messages.messages.create(model="c", max_tokens=2, messages=chat),  # type: ignore[arg-type]
        lambda: messages.messages.count_tokens(model="c", messages=chat),  # type: ignore[arg-type]
    ]
    for ask in asks:
        with pytest.raises(anthropic.NotFoundError) as gone:
            ask()
        shape: Any = gone.value.body
        assert shape["error"]["type"] == "not_found_error"
        assert "served: a, b" in shape["error"]["message"]
    unnamed = server.client.post("/v1/chat/completions", json={"messages": chat})
    assert unnamed.status_code == 400 and unnamed.json()["error"]["param"] == "model"
    assert _states(server) == {"a": "unloaded", "b": "unloaded"}  # nothing loaded


def test_load_and_unload_admin_routes_need_the_api_key(
    start_models: Callable[..., Server],
) -> None:
    """llama.cpp's router routes: 401 without the key; with it, load returns once
    the model is loaded and unload once its engine is gone; /ready reports both."""
    server = start_models("--api-key", API_KEY)
    anon = httpx.Client(base_url=server.url, timeout=HANG_GUARD)
    assert anon.post("/models/load", json={"model": "a"}).status_code == 401
    assert anon.post("/models/unload", json={"model": "a"}).status_code == 401
    assert anon.get("/models").status_code == 401
    server.client.headers["Authorization"] = f"Bearer {API_KEY}"
    loaded = server.client.post("/models/load", json={"model": "a"})
    assert loaded.json() == {"success": True, "model": "a"}
    listing = server.client.get("/models").json()["data"]
    assert [(m["id"], m["status"]["value"]) for m in listing] == [
        ("a", "loaded"),
        ("b", "unloaded"),
    ]
    engines = child_pids(server.process.pid)
    assert len(engines) == 1
    ready = anon.get("/ready").json()
    assert ready["models"] == {"a": "loaded", "b": "unloaded"}
    assert server.client.post("/models/unload", json={"model": "a"}).json()["success"]
    assert _states(server)["a"] == "unloaded"
    assert all(process_gone(pid) for pid in engines)
    missing = server.client.post("/models/load", json={"model": "c"})
    assert missing.status_code == 404 and "served: a, b" in missing.json()["error"]["message"]
    no_name = server.client.post("/models/load", json={})
    assert no_name.status_code == 400 and no_name.json()["error"]["param"] == "model"
    assert _model_metric(server, "tserve_model_unloads_total", "a") == 1
    anon.close()


def test_one_engine_killed_ends_only_its_streams(start_models: Callable[..., Server]) -> None:
    """kill -9 of one model's engine under load (two streams of the echo engine
    that run longer than the test): its stream ends with an error event, the
    other model's stream goes on and a new request for it answers; the dead
    model is failed then unloaded, /health stays 200, and its next request
    loads it again. The admin load works without an API key when none is set."""
    server = start_models(*ECHO, "--preload", "a")
    (engine_a,) = child_pids(server.process.pid)
    assert server.client.post("/models/load", json={"model": "b"}).json()["success"]
    (engine_b,) = child_pids(server.process.pid) - {engine_a}
    long = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "stream": True}
    with (
        server.client.stream("POST", "/v1/chat/completions", json={**long, "model": "a"}) as a,
        server.client.stream("POST", "/v1/chat/completions", json={**long, "model": "b"}) as b,
    ):
        assert (a.status_code, b.status_code) == (200, 200), a.read() + b.read()
        events_a, events_b = _sse_events(a), _sse_events(b)
        assert json.loads(next(events_a))["model"] == "a"
        assert json.loads(next(events_b))["model"] == "b"
        os.kill(engine_a, signal.SIGKILL)
        rest_a = list(events_a)
        assert rest_a[-1] == "[DONE]" and "error" in json.loads(rest_a[-2])
        for _ in range(3):  # b's engine still steps
            chunk = json.loads(next(events_b))
            assert "error" not in chunk and chunk["model"] == "b"
    answer = _client(server).chat.completions.create(
        model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert answer.choices[0].finish_reason == "length"
    _wait_for(lambda: _states(server)["a"] == "unloaded", "a's dead engine is reaped")
    assert server.client.get("/health").json() == {"status": "ok"}
    assert not process_gone(engine_b)
    again = _client(server).completions.create(model="a", prompt="hi", max_tokens=2)
    assert again.choices[0].finish_reason == "length"
    assert _model_metric(server, "tserve_model_loads_total", "a") == 2
    assert _model_metric(server, "tserve_model_loads_total", "b") == 1


def test_sigterm_drains_every_models_requests_and_stops_every_engine(
    start_models: Callable[..., Server],
) -> None:
    """SIGTERM with a stream running on each model: both finish in full (the
    drain waits for them), the server exits 0 and no engine outlives it."""
    server = start_models(*ECHO, "--preload", "a", "--preload", "b")
    engines = child_pids(server.process.pid)
    assert len(engines) == 2
    short = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": True}
    with (
        server.client.stream("POST", "/v1/chat/completions", json={**short, "model": "a"}) as a,
        server.client.stream("POST", "/v1/chat/completions", json={**short, "model": "b"}) as b,
    ):
        streams = [_sse_events(a), _sse_events(b)]
        for events in streams:
            next(events)  # each request is running
        server.process.send_signal(signal.SIGTERM)
        for events in streams:
            rest = list(events)
            assert rest[-1] == "[DONE]"
            finishes = [json.loads(e)["choices"][0]["finish_reason"] for e in rest[:-1]]
            assert finishes[-1] == "length" and not any("error" in e for e in rest)
    assert server.process.wait(HANG_GUARD) == 0
    assert all(process_gone(pid) for pid in engines)


def test_a_models_dir_is_rescanned_when_listed(
    start_models: Callable[..., Server], tmp_path: Path, tiny_model_dir: Path
) -> None:
    """New folder entries appear at the next listing; removed ones disappear
    unless their model is loaded, which stays until it is unloaded."""
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "x").symlink_to(tiny_model_dir)
    server = start_models("--models-dir", str(folder), models=())
    assert _states(server) == {"x": "unloaded"}
    (folder / "y").symlink_to(tiny_model_dir)
    assert _states(server) == {"x": "unloaded", "y": "unloaded"}
    answer = _client(server).completions.create(model="x", prompt="hi", max_tokens=2)
    assert answer.model == "x"
    (folder / "x").unlink()
    (folder / "y").unlink()
    assert _states(server) == {"x": "loaded"}
    server.client.post("/models/unload", json={"model": "x"})
    assert _states(server) == {}


def test_one_model_stays_loaded_and_shows_its_state(server: Server) -> None:
    """One model, served as before: listed loaded, loaded by /models/load
    already, never unloaded (400 naming the field), whatever a request's
    keep_alive says (a bad one is still a 400); an unknown name lists it."""
    assert _states(server) == {"tiny": "loaded"}
    assert server.client.get("/ready").json() == {"status": "ready", "models": {"tiny": "loaded"}}
    assert server.client.post("/models/load", json={"model": "tiny"}).json()["success"]
    refused = server.client.post("/models/unload", json={"model": "tiny"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
    assert server.client.get("/v1/models/tiny").json()["state"] == "loaded"
    unknown = server.client.get("/v1/models/other").json()["error"]
    assert unknown["code"] == "model_not_found" and "served: tiny" in unknown["message"]
    assert server.client.get("/health").json() == {"status": "ok"}
    unload = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "keep_alive": 0}
    assert server.client.post("/v1/completions", json=unload).status_code == 200
    card = server.client.get("/v1/models/tiny").json()
    assert card["state"] == "loaded" and "keep_alive" not in card  # no keep-alive applies
    bad = server.client.post("/v1/completions", json={**unload, "keep_alive": "soon"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "keep_alive"
