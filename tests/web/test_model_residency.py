"""Which models stay loaded, over HTTP: ``--keep-alive`` and a request's ``keep_alive``,
``--models-memory`` and ``--model-fit-timeout``, through real servers of two tiny
models and the real clients.

Every wait is on a state the server reports (a model's ``state`` or
``expires_at`` on ``/v1/models``, polled under the hang guard), never on the
clock; a stream that must stay busy asks the echo engine for more tokens than
the test waits for.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.web.conftest import Server
from tests.web.test_several_models import (
    ECHO,
    _client,
    _model_metric,
    _sse_events,
    _states,
    _wait_for,
    second_model_dir,  # noqa: F401 (a fixture)
)

CHAT: Any = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def idle_unloads(
    tiny_model_dir: Path,
    second_model_dir: Path,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Server]:
    """``serve a b --keep-alive 0`` on the echo engine (quick to load; which models
    stay loaded does not depend on what they compute): a model is unloaded once
    idle unless a request says otherwise."""
    log = tmp_path_factory.mktemp("keep-alive") / "server.log"
    models = (f"a={tiny_model_dir}", f"b={second_model_dir}")
    server = Server(None, *models, "--engine-kind", "echo", "--keep-alive", "0", log=log)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def one_fits(
    tiny_model_dir: Path,
    second_model_dir: Path,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Server]:
    """``serve a b --models-memory 1M --model-fit-timeout 1`` on the echo engine:
    each engine is larger than the budget, so it loads alone (the registry's
    rule 4): one model fits at a time."""
    log = tmp_path_factory.mktemp("budget") / "server.log"
    server = Server(
        None,
        f"a={tiny_model_dir}",
        f"b={second_model_dir}",
        *ECHO,
        "--models-memory",
        "1M",
        "--model-fit-timeout",
        "1",
        log=log,
    )
    yield server
    server.stop()


def _card(server: Server, name: str) -> dict[str, Any]:
    card: dict[str, Any] = server.client.get(f"/v1/models/{name}").json()
    return card


def test_a_requests_keep_alive_pins_sets_a_duration_or_unloads(idle_unloads: Server) -> None:
    """``-1`` pins ``a`` while the server's 0 unloads ``b`` after its answer; a
    duration becomes ``b``'s keep-alive; then ``0`` through the Responses and
    Messages APIs unloads each once answered, the pin too (the latest request wins)."""
    server = idle_unloads
    client = _client(server)
    pinned = client.chat.completions.create(
        model="a", messages=CHAT, max_tokens=2, extra_body={"keep_alive": -1}
    )
    assert pinned.model == "a"
    card = _card(server, "a")
    assert (card["state"], card["keep_alive"], card["expires_at"]) == ("loaded", -1, None)
    assert card["resident_bytes"] > 0
    ready = server.client.get("/ready").json()
    assert ready["memory_budget"] > 0 and ready["resident_bytes"] >= card["resident_bytes"]

    client.completions.create(model="b", prompt="hi", max_tokens=2)  # the server's 0
    _wait_for(lambda: _states(server)["b"] == "unloaded", "b is unloaded once idle")
    assert _states(server)["a"] == "loaded"
    assert _model_metric(server, "tserve_model_unloads_total", "a") == 0

    asked = time.time()
    client.completions.create(model="b", prompt="hi", max_tokens=2, extra_body={"keep_alive": "1h"})
    card = _card(server, "b")
    read = time.time()
    assert (card["state"], card["keep_alive"]) == ("loaded", 3600)
    # An hour after its last use, which lies between the request and the read
    # (a bracket, not a bound on how long anything took; 1 s for clock rounding).
    assert asked + 3600 - 1 <= card["expires_at"] <= read + 3600 + 1
    assert _model_metric(server, "tserve_model_resident_bytes", "b") > 0

    client.responses.create(
        model="b", input="hi", max_output_tokens=16, extra_body={"keep_alive": 0}
    )
    _wait_for(lambda: _states(server)["b"] == "unloaded", "keep_alive 0 unloads b")
    assert _card(server, "b")["resident_bytes"] == 0

    messages = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    answer = messages.messages.create(
        model="a",
        max_tokens=2,
        messages=CHAT,
        extra_body={"keep_alive": "0s"},
    )
    assert answer.model == "a"
    _wait_for(lambda: _states(server)["a"] == "unloaded", "keep_alive 0 unloads the pinned a")
    assert _model_metric(server, "tserve_model_unloads_total", "a") == 1
    assert server.client.get("/ready").json()["resident_bytes"] == 0


@pytest.mark.parametrize("bad", ["5 min", "forever", "", True, [1], {"s": 1}])
def test_a_bad_keep_alive_is_a_400_naming_the_field_on_every_api(
    idle_unloads: Server, bad: object
) -> None:
    """In each API's error shape, before any model is looked up or loaded."""
    server = idle_unloads
    openai_routes: dict[str, dict[str, Any]] = {
        "/v1/completions": {"model": "a", "prompt": "hi"},
        "/v1/chat/completions": {"model": "a", "messages": CHAT},
        "/v1/embeddings": {"model": "a", "input": "hi"},
        "/v1/responses": {"model": "a", "input": "hi"},
    }
    for path, body in openai_routes.items():
        reply = server.client.post(path, json={**body, "keep_alive": bad})
        assert reply.status_code == 400, (path, reply.text)
        assert reply.json()["error"]["param"] == "keep_alive", (path, reply.text)
    anthropic_routes: dict[str, dict[str, Any]] = {
        "/v1/messages": {"model": "a", "max_tokens": 2, "messages": CHAT},
        "/v1/messages/count_tokens": {"model": "a", "messages": CHAT},
    }
    for path, body in anthropic_routes.items():
        reply = server.client.post(path, json={**body, "keep_alive": bad})
        assert reply.status_code == 400, (path, reply.text)
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error" and "keep_alive" in error["message"]


def test_under_a_budget_for_one_model_a_switch_unloads_the_idle_one(one_fits: Server) -> None:
    """Requests alternating across the two models all answer: each load first
    unloads the other, idle, model."""
    server = one_fits
    client = _client(server)
    for name, other in [("a", "b"), ("b", "a"), ("a", "b"), ("b", "a")]:
        answer = client.completions.create(model=name, prompt="hi", max_tokens=2)
        assert answer.model == name and answer.choices[0].finish_reason == "length"
        assert _states(server) == {name: "loaded", other: "unloaded"}
    assert _model_metric(server, "tserve_model_loads_total", "a") == 2
    assert _model_metric(server, "tserve_model_loads_total", "b") == 2


def test_a_model_that_cannot_fit_past_a_busy_one_is_a_503_with_retry_after(
    one_fits: Server,
) -> None:
    """While a stream holds ``a`` (more tokens than the test reads), ``b`` has no
    room: after --model-fit-timeout, OpenAI's 503 ``overloaded`` with
    ``Retry-After`` and Anthropic's 529, naming both models; ``a`` is never
    unloaded under its stream. Once the stream ends, ``b`` loads in its place."""
    server = one_fits
    long = {"model": "a", "messages": CHAT, "max_tokens": 400, "stream": True}
    with server.client.stream("POST", "/v1/chat/completions", json=long) as stream:
        assert stream.status_code == 200
        events = _sse_events(stream)
        assert json.loads(next(events))["model"] == "a"
        with pytest.raises(openai.InternalServerError) as busy:
            _client(server).completions.create(model="b", prompt="hi", max_tokens=2)
        assert busy.value.status_code == 503
        assert int(busy.value.response.headers["Retry-After"]) >= 1
        error = busy.value.body
        assert isinstance(error, dict) and error["code"] == "overloaded"
        assert "'b'" in error["message"] and "'a'" in error["message"]
        messages = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as overloaded:
            messages.messages.create(model="b", max_tokens=2, messages=CHAT)
        assert overloaded.value.status_code == 529
        shape: Any = overloaded.value.body
        assert shape["error"]["type"] == "overloaded_error"
        assert overloaded.value.response.headers["Retry-After"]
        assert _states(server) == {"a": "loaded", "b": "unloaded"}
        assert "error" not in json.loads(next(events))  # the stream goes on
    _wait_for(lambda: _card(server, "a")["expires_at"] is not None, "the stream's hold ends")
    answer = _client(server).completions.create(model="b", prompt="hi", max_tokens=2)
    assert answer.model == "b"
    assert _states(server) == {"a": "unloaded", "b": "loaded"}
