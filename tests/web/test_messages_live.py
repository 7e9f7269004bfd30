"""Anthropic's Messages API against a real server on the tiny model: the official
``anthropic`` SDK, raw HTTP for the event order and the error shape, and faults
(overload, hang-up, engine death) as docs/failures.md states them for chat."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.web.conftest import API_KEY, Server, named_events, served, tiny_model_copy
from tests.web.sdks import anthropic_client
from tests.web.test_faults import PACED, StartServer, stream_through_engine_kill
from tests.web.test_live import _until_aborted
from tests.web.test_tools_live import WEATHER_PARAMETERS

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("nothing_left_in_flight")]

WEATHER: Any = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": WEATHER_PARAMETERS,
}
HELLO: Any = [{"role": "user", "content": "Hello there"}]
GREEDY = {"temperature": 0}  # this SDK types no temperature (newer models take none)
# Claude Code 2.1.197's first request of `claude -p "say hi"`: with its 24 tools (long
# texts cut to fit the test model, 22 tools left out), and exactly as it sent it with
# `--tools "" --system-prompt "You are terse."`.
REPLAYS = [Path(__file__).parent / f"claude_code_request{s}.json" for s in ("", "_no_tools")]


def stream_events(server: Server, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    with server.client.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return named_events(r)


def check_order(names: list[str]) -> None:
    """Anthropic's order: start, ping, blocks (start, deltas, stop), message_delta, stop."""
    assert names[:2] == ["message_start", "ping"], names
    assert names[-2:] == ["message_delta", "message_stop"], names
    block_open = False
    for name in names[2:-2]:
        if name == "content_block_start":
            assert not block_open, names
            block_open = True
        elif name in ("content_block_delta", "content_block_stop"):
            assert block_open, names
            block_open = name == "content_block_delta"
        else:
            raise AssertionError(names)
    assert not block_open, names


# -- the official SDK ---------------------------------------------------------------


def test_create_is_the_chat_completion_of_the_same_conversation(server: Server) -> None:
    """Greedy, the Messages answer is chat's answer: one machinery, two shapes."""
    system = "You are terse."
    message = anthropic_client(server).messages.create(
        model="tiny", max_tokens=12, extra_body=GREEDY, system=system, messages=HELLO
    )
    chat = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY).chat.completions.create(
        model="tiny",
        max_tokens=12,
        extra_body=GREEDY,
        messages=[{"role": "system", "content": system}, *HELLO],
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == "tiny"
    text = "".join(b.text for b in message.content if b.type == "text")
    assert text == chat.choices[0].message.content
    expected = {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert message.stop_reason == expected and message.stop_sequence is None
    assert chat.usage is not None
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens


def test_sdk_stream_events_in_order_and_its_final_message(server: Server) -> None:
    client = anthropic_client(server)
    whole = client.messages.create(model="tiny", max_tokens=16, extra_body=GREEDY, messages=HELLO)
    with client.messages.stream(
        model="tiny", max_tokens=16, extra_body=GREEDY, messages=HELLO
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens
    # The raw stream: every event named, in Anthropic's order, text deltas making the text.
    events = stream_events(
        server, {"model": "tiny", "max_tokens": 16, "temperature": 0, "messages": HELLO}
    )
    check_order([name for name, _ in events])
    deltas = [d["delta"]["text"] for name, d in events if name == "content_block_delta"]
    assert "".join(deltas) == "".join(b.text for b in whole.content if b.type == "text")
    assert events[0][1]["message"]["usage"]["input_tokens"] == whole.usage.input_tokens
    assert events[-2][1]["usage"]["output_tokens"] == whole.usage.output_tokens


def test_a_stop_sequence_ends_the_message_and_is_named(server: Server) -> None:
    client = anthropic_client(server)
    whole = client.messages.create(
        model="tiny", max_tokens=24, extra_body=GREEDY, messages=HELLO
    ).content
    text = "".join(b.text for b in whole if b.type == "text")
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    cut = client.messages.create(
        model="tiny", max_tokens=24, extra_body=GREEDY, messages=HELLO, stop_sequences=[stop]
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert "".join(b.text for b in cut.content if b.type == "text") == text[: text.index(stop)]


@pytest.mark.parametrize(
    "choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}], ids=["any", "tool"]
)
def test_forced_tool_use_then_a_tool_result_round_trip(server: Server, choice: Any) -> None:
    """One forced call (``disable_parallel_tool_use``): its arguments are bounded by
    the schema, so the sampled tiny model ends with ``tool_use`` well within
    ``max_tokens``; with parallel calls allowed it may call again until
    ``max_tokens``, which a loaded full run once saw."""
    choice = {**choice, "disable_parallel_tool_use": True}
    client = anthropic_client(server)
    question: Any = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.messages.create(
        model="tiny", max_tokens=200, tools=[WEATHER], tool_choice=choice, messages=question
    )
    uses = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and uses, first
    for use in uses:
        assert use.name == "get_weather" and use.id.startswith("toolu_")
        jsonschema.validate(use.input, WEATHER["input_schema"])
    results: Any = [
        {"type": "tool_result", "tool_use_id": use.id, "content": "21 C, sunny"} for use in uses
    ]
    history: Any = [
        *question,
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": results},
    ]
    count = client.messages.count_tokens(model="tiny", tools=[WEATHER], messages=history)
    second = client.messages.create(
        model="tiny", max_tokens=8, tools=[WEATHER], tool_choice={"type": "none"}, messages=history
    )
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in second.content)
    # tool_choice none renders without the tools: fewer input tokens than counted with them
    assert second.usage.input_tokens < count.input_tokens


def test_streamed_tool_use_input_arrives_as_json_deltas(server: Server) -> None:
    """One forced call, as in the round trip above: with parallel calls allowed the
    sampled model may open a second call and end on ``max_tokens``."""
    choice: Any = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    body = {
        "model": "tiny",
        "max_tokens": 200,
        "tools": [WEATHER],
        "tool_choice": choice,
        "messages": [{"role": "user", "content": "Weather?"}],
    }
    events = stream_events(server, body)
    check_order([name for name, _ in events])
    starts = [d["content_block"] for name, d in events if name == "content_block_start"]
    assert starts and all(b["type"] == "tool_use" and b["input"] == {} for b in starts)
    partial = "".join(
        d["delta"]["partial_json"] for name, d in events if name == "content_block_delta"
    )
    jsonschema.validate(json.loads(partial), WEATHER["input_schema"])
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    with anthropic_client(server).messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    for block in final.content:
        assert block.type == "tool_use"
        jsonschema.validate(block.input, WEATHER["input_schema"])


def test_count_tokens_is_the_prompt_the_engine_sees(server: Server) -> None:
    client = anthropic_client(server)
    system: Any = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    for tools in ([], [WEATHER]):
        count = client.messages.count_tokens(
            model="tiny", system=system, tools=tools, messages=HELLO
        )
        message = client.messages.create(
            model="tiny", max_tokens=1, system=system, tools=tools, messages=HELLO
        )
        assert count.input_tokens == message.usage.input_tokens > 0


def labelled(server: Server, name: str, labels: str) -> float:
    """The value of ``name{labels}`` on one scrape (0 before its first count)."""
    prefix = f"{name}{{{labels}}} "
    lines = server.client.get("/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(prefix))


def test_metrics_count_messages_like_chat(server: Server) -> None:
    route = 'route="/v1/messages",status="200"'
    before = labelled(server, "tserve_http_requests_total", route)
    prompt, generated = (
        server.metric("vllm:prompt_tokens_total"),
        server.metric("vllm:generation_tokens_total"),
    )
    message = anthropic_client(server).messages.create(model="tiny", max_tokens=4, messages=HELLO)
    events = stream_events(server, {"model": "tiny", "max_tokens": 4, "messages": HELLO})
    server.wait_for_metric("tserve_http_generations_in_flight", 0)  # the body counted it
    assert labelled(server, "tserve_http_requests_total", route) == before + 2
    streamed = events[-2][1]["usage"]["output_tokens"]
    assert server.metric("vllm:prompt_tokens_total") == prompt + 2 * message.usage.input_tokens
    assert server.metric("vllm:generation_tokens_total") == (
        generated + message.usage.output_tokens + streamed
    )


def test_max_tokens_past_the_context_is_cut_to_what_is_left(server: Server) -> None:
    body = {"model": "tiny", "max_tokens": 64000, "messages": HELLO}
    message = server.client.post("/v1/messages", json=body).json()
    assert message["usage"]["input_tokens"] + message["usage"]["output_tokens"] <= 512


@pytest.fixture(scope="module")
def long_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny model with 2,048 positions (its rotary positions have no table to
    outgrow), for a request the size of Claude Code's smallest."""
    directory = tmp_path_factory.mktemp("long") / "model"
    tiny_model_copy(tiny_model_dir, directory, max_position_embeddings=2048)
    yield from served(directory, tmp_path_factory, folder="long-server")


@pytest.mark.parametrize("replay", REPLAYS, ids=lambda p: p.stem)
def test_claude_code_request_replays_as_a_well_formed_stream(
    long_server: Server, replay: Path
) -> None:
    """Every field and block shape as Claude Code sent them (see REPLAYS)."""
    body = json.loads(replay.read_text())
    body["model"] = "tiny"
    headers = {
        "x-api-key": API_KEY,
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
        "Authorization": "",
    }
    path = "/v1/messages?beta=true"
    with long_server.client.stream("POST", path, json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        events = named_events(r)
    check_order([name for name, _ in events])
    assert events[-2][1]["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    counted = long_server.client.post(
        "/v1/messages/count_tokens", json=body, headers=headers
    ).json()
    assert counted["input_tokens"] == events[0][1]["message"]["usage"]["input_tokens"]


# -- raw HTTP: errors in Anthropic's shape, naming the field ------------------------


def anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return str(body["error"]["message"])


BAD_BODIES: Any = [
    ({"model": "tiny", "messages": HELLO}, "max_tokens"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]},
     "messages[0].role"),
    ({"model": "tiny", "max_tokens": 4,
      "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].type"),
    ({"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": "and?"}]},
     "messages[1]"),
    ({"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "first"},
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}]},
     "messages[2].content[1]"),
    ({"model": "tiny", "max_tokens": 4, "messages": HELLO, "tools": [WEATHER],
      "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"model": "tiny", "max_tokens": 4, "messages": HELLO, "temperature": 1.5}, "temperature"),
    ({"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]},
     "messages[1].role"),
    ({"model": "tiny", "max_tokens": 4, "messages": HELLO,
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "field"), BAD_BODIES)
def test_bad_bodies_are_400_in_anthropic_shape_naming_the_field(
    server: Server, body: dict[str, Any], field: str
) -> None:
    for stream in (False, True):
        response = server.client.post("/v1/messages", json={**body, "stream": stream})
        assert f"'{field}" in anthropic_error(response, 400, "invalid_request_error")


def test_errors_of_model_auth_and_count_tokens_in_anthropic_shape(server: Server) -> None:
    url = f"{server.url}/v1/messages"
    body = {"model": "tiny", "max_tokens": 2, "messages": HELLO}
    assert "'model'" in anthropic_error(
        server.client.post("/v1/messages", json={**body, "model": "gpt-9"}), 404, "not_found_error"
    )
    anthropic_error(httpx.post(url, json=body), 401, "authentication_error")
    anthropic_error(httpx.post(url, json=body, headers={"x-api-key": "wrong"}), 401,
                    "authentication_error")  # fmt: skip
    keyed = httpx.post(url, json=body, headers={"x-api-key": API_KEY, "anthropic-version": "x"})
    assert keyed.status_code == 200 and keyed.json()["type"] == "message"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=2, messages=HELLO
        )
    count = server.client.post("/v1/messages/count_tokens", json={"model": "tiny"})
    assert "'messages'" in anthropic_error(count, 400, "invalid_request_error")
    too_long = {**body, "messages": [{"role": "user", "content": "word " * 2000}]}
    assert "'messages'" in anthropic_error(
        server.client.post("/v1/messages", json=too_long), 400, "invalid_request_error"
    )
    form = server.client.post("/v1/messages", content=b"x", headers={"Content-Type": "text/plain"})
    anthropic_error(form, 415, "invalid_request_error")
    huge = server.client.post("/v1/messages", json={**body, "system": "x" * (5 << 20)})
    anthropic_error(huge, 413, "request_too_large")


def test_hang_up_mid_stream_aborts_the_engine_request(server: Server) -> None:
    body = {"model": "tiny", "max_tokens": 480, "messages": HELLO, "stream": True}

    def hang_up() -> None:
        with server.client.stream("POST", "/v1/messages", json=body) as r:
            assert next(r.iter_lines()) == "event: message_start"

    _until_aborted(server, hang_up)
    server.wait_for_metric("tserve_requests_running", 0)


# -- faults on their own servers ------------------------------------------------------

LONG: Any = {"model": "tiny", "max_tokens": 480, "messages": HELLO}


def test_overload_is_529_overloaded_error(start_server: StartServer) -> None:
    """Two streams hold both slots while the engine is stopped (neither can finish):
    the next request is refused at once with 529, then both complete."""
    server = start_server("--max-pending", "2", "--max-queued", "0", "--max-num-seqs", "1")
    out: list[list[str]] = []

    def read() -> None:
        with (
            httpx.Client(base_url=server.url, timeout=120) as client,
            client.stream("POST", "/v1/messages", json={**LONG, "stream": True}) as r,
        ):
            out.append([line for line in r.iter_lines() if line.startswith("event: ")])

    with server.engine_stopped():
        threads = [threading.Thread(target=read) for _ in range(2)]
        for t in threads:
            t.start()
        server.wait_for_metric("tserve_requests_live", 2)
        refused = httpx.post(f"{server.url}/v1/messages", json=LONG, timeout=30)
        assert "overloaded" in anthropic_error(refused, 529, "overloaded_error")
        assert refused.headers["Retry-After"].isdigit()
        client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as info:
            client.messages.create(**LONG)
        assert info.value.status_code == 529
    for t in threads:
        t.join(120)
    assert [events[-1] for events in out] == ["event: message_stop"] * 2


def test_engine_death_mid_stream_ends_with_an_error_event(start_server: StartServer) -> None:
    """The echo engine at 10 steps a second needs 48 s for 480 tokens: at the kill
    (after its second token) the stream is mid-way, so it must end with an error event."""
    server = start_server("--max-num-seqs", "1", *PACED)
    events = stream_through_engine_kill(server, "/v1/messages", LONG, named_events)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and "message_stop" not in names
    name, error = events[-1]
    assert name == "error" and error["error"]["type"] == "overloaded_error", error
    assert "engine" in error["error"]["message"]
    assert server.process.wait(60) != 0
