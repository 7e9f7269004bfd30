"""OpenAI's Responses API against a real server on the tiny model: the official
``openai`` SDK, raw HTTP for the event order and the error shape, the store's
bounds, background runs, and faults (overload, hang-up, engine death) as
docs/failures.md states them for chat."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai.types.responses import Response

from tests.web.conftest import Server, named_events, served, tiny_model_copy
from tests.web.sdks import openai_client
from tests.web.test_api_processes import start
from tests.web.test_faults import PACED, StartServer, stream_through_engine_kill
from tests.web.test_live import _until_aborted
from tests.web.test_tools_live import WEATHER_PARAMETERS

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("nothing_left_in_flight")]

WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": WEATHER_PARAMETERS,
    "strict": True,
}
SYSTEM = "You are terse."
HELLO = "Hello there"


def events_of(response: httpx.Response) -> list[dict[str, Any]]:
    """The data of each SSE event, checking each ``event:`` name is its data's type."""
    return [data for _, data in named_events(response)]


def stream_events(server: Server, body: dict[str, Any]) -> list[dict[str, Any]]:
    with server.client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return events_of(r)


def check_order(events: list[dict[str, Any]]) -> None:
    """The documented order, sequence numbers 0, 1, 2, ..., and each item's events
    naming its output index and id."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    names = [e["type"] for e in events]
    assert names[:2] == ["response.created", "response.in_progress"], names
    assert names[-1] in ("response.completed", "response.incomplete"), names
    open_item: dict[str, Any] | None = None
    index = -1
    for event in events[2:-1]:
        kind = event["type"]
        if kind == "response.output_item.added":
            assert open_item is None, names
            index += 1
            open_item = event["item"]
            assert event["output_index"] == index
            continue
        assert open_item is not None, names
        assert event["output_index"] == index
        if kind == "response.output_item.done":
            assert event["item"]["id"] == open_item["id"]
            open_item = None
        else:
            assert event["item_id"] == open_item["id"], event
            expected = (
                (
                    "response.content_part.added",
                    "response.output_text.delta",
                    "response.output_text.done",
                    "response.content_part.done",
                )
                if open_item["type"] == "message"
                else (
                    "response.function_call_arguments.delta",
                    "response.function_call_arguments.done",
                )
            )
            assert kind in expected, (kind, open_item)
    assert open_item is None, names


def openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


# -- the official SDK ---------------------------------------------------------------


def test_create_is_the_chat_completion_of_the_same_conversation(server: Server) -> None:
    """Greedy, the response's text is chat's answer, token for token: one machinery."""
    client = openai_client(server)
    response = client.responses.create(
        model="tiny", instructions=SYSTEM, input=HELLO, max_output_tokens=12, temperature=0
    )
    chat = client.chat.completions.create(
        model="tiny",
        max_tokens=12,
        temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": HELLO}],
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.model == "tiny" and response.instructions == SYSTEM
    [item] = response.output
    assert item.type == "message" and item.role == "assistant"
    assert item.content[0].type == "output_text" and item.content[0].annotations == []
    assert response.output_text == chat.choices[0].message.content
    finish = chat.choices[0].finish_reason
    if finish == "length":
        assert response.status == "incomplete" and item.status == "incomplete"
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed" and response.incomplete_details is None
    assert chat.usage is not None and response.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    # The request's parameters come back.
    assert response.temperature == 0 and response.max_output_tokens == 12
    assert response.model_dump()["store"] is True and response.background is False
    assert response.tools == [] and response.tool_choice == "auto"


def test_the_same_prompt_again_reads_its_prefix_from_the_cache(server: Server) -> None:
    client = openai_client(server)
    prompt = "A prompt long enough to fill several blocks of the prefix cache. " * 4
    first = client.responses.create(model="tiny", input=prompt, max_output_tokens=2)
    second = client.responses.create(model="tiny", input=prompt, max_output_tokens=2)
    assert first.usage is not None and second.usage is not None
    cached = second.usage.input_tokens_details.cached_tokens
    assert 0 < cached <= second.usage.input_tokens == first.usage.input_tokens


def test_streamed_events_in_order_and_the_final_response_is_the_whole_one(
    server: Server,
) -> None:
    body: dict[str, Any] = {
        "model": "tiny",
        "input": HELLO,
        "max_output_tokens": 16,
        "temperature": 0,
    }
    whole = server.client.post("/v1/responses", json=body).json()
    events = stream_events(server, body)
    check_order(events)
    final, expected = without_ids(events[-1]["response"]), without_ids(whole)
    del final["usage"]["input_tokens_details"], expected["usage"]["input_tokens_details"]
    assert final == expected  # the same, but for ids, times and what the cache held
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == whole["output"][0]["content"][0]["text"]
    done = [e for e in events if e["type"] == "response.output_text.done"]
    assert [e["text"] for e in done] == [text]
    # The SDK parses every event of it.
    with openai_client(server).responses.stream(**body) as stream:
        kinds = [event.type for event in stream]
    assert squeezed(kinds) == squeezed([e["type"] for e in events])


def squeezed(kinds: Sequence[str]) -> list[str]:
    """Runs of one kind as one (how many text deltas a stream has is the batching's)."""
    return [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]


def without_ids(response: dict[str, Any]) -> dict[str, Any]:
    """A response object without what differs between two runs: ids and times."""
    out = {k: v for k, v in response.items() if k not in ("id", "created_at")}
    out["output"] = [{k: v for k, v in item.items() if k != "id"} for item in out["output"]]
    return out


def test_a_completed_stream_gives_the_sdk_its_final_response(server: Server) -> None:
    """A forced tool call ends with a stop (the grammar's end): "response.completed".
    One call is asked for: with parallel calls allowed the sampled tiny model
    may call again until max_output_tokens, an "incomplete" response."""
    body: dict[str, Any] = {
        "model": "tiny",
        "input": "Weather in Paris?",
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 200,
    }
    with openai_client(server).responses.stream(**body) as stream:
        final = stream.get_final_response()
    assert final.status == "completed"
    calls = [item for item in final.output if item.type == "function_call"]
    assert calls and all(call.status == "completed" for call in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "name": "get_weather"}], ids=["required", "named"]
)
def test_a_tool_call_then_its_output_round_trip_through_previous_response_id(
    server: Server, choice: Any
) -> None:
    client = openai_client(server)
    first = client.responses.create(
        model="tiny",
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice=choice,
        parallel_tool_calls=False,
        max_output_tokens=200,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1, first
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        assert call.id is not None and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    outputs: Any = [
        {"type": "function_call_output", "call_id": call.call_id, "output": "21 C, sunny"}
        for call in calls
    ]
    second = client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        input=outputs,
        tools=[WEATHER],
        max_output_tokens=8,
    )
    assert second.previous_response_id == first.id
    assert second.status in ("completed", "incomplete")
    assert first.usage is not None and second.usage is not None
    # The conversation grew by the calls and their outputs (the same tools rendered).
    assert second.usage.input_tokens > first.usage.input_tokens
    items = client.responses.input_items.list(second.id, order="asc")
    kinds = [item.type for item in items.data]
    assert kinds == ["message", *["function_call"] * len(calls), *kinds[-len(calls) :]]
    assert kinds[-len(calls) :] == ["function_call_output"] * len(calls)


def test_streamed_function_call_arguments_arrive_as_deltas(server: Server) -> None:
    body = {
        "model": "tiny",
        "input": "Weather?",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 200,
        "temperature": 0,
    }
    events = stream_events(server, body)
    check_order(events)
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert added and all(i["type"] == "function_call" and i["arguments"] == "" for i in added)
    for item in added:
        deltas = [
            e["delta"]
            for e in events
            if e["type"] == "response.function_call_arguments.delta" and e["item_id"] == item["id"]
        ]
        [done] = [
            e
            for e in events
            if e["type"] == "response.function_call_arguments.done" and e["item_id"] == item["id"]
        ]
        assert "".join(deltas) == done["arguments"]
        jsonschema.validate(json.loads(done["arguments"]), WEATHER["parameters"])
    assert events[-1]["type"] == "response.completed"


CITY: Any = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "size": {"type": "integer"}},
    "required": ["name", "size"],
    "additionalProperties": False,
}


def test_text_format_json_schema_output_validates(server: Server) -> None:
    response = openai_client(server).responses.create(
        model="tiny",
        input="A city as JSON",
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}},
        max_output_tokens=200,
    )
    assert response.status == "completed", response
    jsonschema.validate(json.loads(response.output_text), CITY)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    size: int


def test_parse_with_a_pydantic_model(server: Server) -> None:
    parsed = openai_client(server).responses.parse(
        model="tiny", input="A city", text_format=City, max_output_tokens=200
    )
    assert isinstance(parsed.output_parsed, City)


def test_retrieve_list_input_items_and_delete(server: Server) -> None:
    client = openai_client(server)
    created = client.responses.create(
        model="tiny",
        input=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Again?"},
        ],
        max_output_tokens=4,
        metadata={"purpose": "test"},
    )
    got = client.responses.retrieve(created.id)
    assert got.model_dump() == created.model_dump()
    assert got.metadata == {"purpose": "test"}
    items = client.responses.input_items.list(created.id)  # newest first
    assert [i.role for i in items.data if i.type == "message"] == [
        "user",
        "assistant",
        "user",
        "developer",
    ]
    path = f"/v1/responses/{created.id}/input_items"
    listed = server.client.get(path).json()
    assert listed["object"] == "list" and not listed["has_more"]
    assert [i["id"] for i in listed["data"]] == [i.id for i in items.data]
    assert listed["first_id"] == items.data[0].id and listed["last_id"] == items.data[-1].id
    page = server.client.get(f"{path}?order=asc&limit=2").json()
    assert page["has_more"] and [i["id"] for i in page["data"]] == [
        i.id for i in items.data[::-1][:2]
    ]
    rest = server.client.get(f"{path}?order=asc&after={page['last_id']}").json()
    assert not rest["has_more"] and len(rest["data"]) == 2
    deleted = server.client.delete(f"/v1/responses/{created.id}")
    assert deleted.json() == {"id": created.id, "object": "response", "deleted": True}
    for path in (f"/v1/responses/{created.id}", f"/v1/responses/{created.id}/input_items"):
        error = openai_error(server.client.get(path), 404)
        assert error["param"] == "response_id" and created.id in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)


def test_unknown_ids_are_404_naming_the_field(server: Server) -> None:
    for path in ("/v1/responses/resp_nope", "/v1/responses/" + "resp_" + "0" * 32):
        assert openai_error(server.client.get(path), 404)["param"] == "response_id"
        assert openai_error(server.client.delete(path), 404)["param"] == "response_id"
    body = {"model": "tiny", "input": "Hi", "previous_response_id": "resp_" + "1" * 32}
    error = openai_error(server.client.post("/v1/responses", json=body), 404)
    assert error["param"] == "previous_response_id"


def test_store_false_is_not_stored(server: Server) -> None:
    created = openai_client(server).responses.create(
        model="tiny", input="Hi", max_output_tokens=2, store=False
    )
    assert created.model_dump()["store"] is False
    openai_error(server.client.get(f"/v1/responses/{created.id}"), 404)


def test_a_continuation_past_the_context_is_a_400_naming_previous_response_id(
    server: Server,
) -> None:
    client = openai_client(server)
    first = client.responses.create(model="tiny", input="word " * 60, max_output_tokens=2)
    previous = first.id
    for _ in range(8):  # each turn repeats the conversation so far: it must overflow
        body = {"model": "tiny", "input": "word " * 60, "previous_response_id": previous}
        response = server.client.post("/v1/responses", json={**body, "max_output_tokens": 2})
        if response.status_code == 400:
            error = openai_error(response, 400)
            assert error["param"] == "previous_response_id"
            assert "context" in error["message"]
            return
        assert response.status_code == 200, response.text
        previous = response.json()["id"]
    raise AssertionError("the conversation never outgrew the context")


def test_hang_up_mid_stream_aborts_the_engine_request(server: Server) -> None:
    body = {"model": "tiny", "input": HELLO, "max_output_tokens": 480, "stream": True}

    def hang_up() -> None:
        with server.client.stream("POST", "/v1/responses", json=body) as r:
            assert next(r.iter_lines()) == "event: response.created"

    _until_aborted(server, hang_up)
    server.wait_for_metric("tserve_requests_running", 0)


# -- raw HTTP: errors in OpenAI's shape, naming the field ---------------------------

BAD_BODIES: Any = [
    ({"model": "tiny"}, "input"),
    ({"model": "tiny", "input": []}, "input"),
    ({"model": "tiny", "input": 3}, "input"),
    ({"model": "tiny", "input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"model": "tiny", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x"}]}]}, "input[0].content[0].type"),
    ({"model": "tiny", "input": [{"type": "web_search_call", "id": "x"}]}, "input[0].type"),
    ({"model": "tiny", "input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
     "input[0].call_id"),
    ({"model": "tiny", "input": [{"type": "function_call", "call_id": "c", "name": "f",
                                   "arguments": "[1]"}]}, "input[0].arguments"),
    ({"model": "tiny", "input": "hi", "temperature": 3}, "temperature"),
    ({"model": "tiny", "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "tiny", "input": "hi", "tools": [{"type": "namespace", "name": "n", "tools": [
        {"type": "web_search"}]}]}, "tools[0].tools[0].type"),
    ({"model": "tiny", "input": "hi", "tools": [WEATHER, {"type": "namespace", "name": "n",
                                                  "tools": [WEATHER]}]}, "tools[1].tools[0].name"),
    ({"model": "tiny", "input": "hi", "tools": [WEATHER, WEATHER]}, "tools[1].name"),
    ({"model": "tiny", "input": "hi", "tools": [WEATHER],
      "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"model": "tiny", "input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"model": "tiny", "input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
     "text.format.schema"),
    ({"model": "tiny", "input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"model": "tiny", "input": "hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format"),
    ({"model": "tiny", "input": "hi", "background": True, "store": False}, "background"),
    ({"model": "tiny", "input": "hi", "metadata": {"k": 1}}, "metadata[...]"),
    ({"model": "nope", "input": "hi"}, "model"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "field"), BAD_BODIES)
def test_bad_bodies_are_400_naming_the_field(
    server: Server, body: dict[str, Any], field: str
) -> None:
    for stream in (False, True):
        response = server.client.post("/v1/responses", json={**body, "stream": stream})
        status = 404 if field == "model" else 400
        assert openai_error(response, status)["param"] == field, response.text


def test_input_items_paging_errors_name_the_field(server: Server) -> None:
    created = openai_client(server).responses.create(model="tiny", input="Hi", max_output_tokens=2)
    path = f"/v1/responses/{created.id}/input_items"
    for query, field in (("limit=0", "limit"), ("order=up", "order"), ("after=msg_x", "after")):
        assert openai_error(server.client.get(f"{path}?{query}"), 400)["param"] == field


def test_the_store_keeps_its_budget_by_evicting_the_oldest(start_server: StartServer) -> None:
    """Fill a 64 KiB store with ~1 KiB responses: it never holds much more than the
    budget (what is written between two sweeps, and while one runs), the newest are
    found and the oldest are gone (404)."""
    budget = 64 * 1024
    server = start_server("--responses-store-bytes", str(budget))
    ids = []
    for i in range(150):
        pad = {"pad": "x" * 500, "more": "y" * 500}  # ~1 KiB of metadata, no tokens
        body = {"model": "tiny", "input": str(i), "max_output_tokens": 2, "metadata": pad}
        response = server.client.post("/v1/responses", json=body)
        assert response.status_code == 200, response.text
        ids.append(response.json()["id"])
    sizes = [len(server.client.get(f"/v1/responses/{i}").content) for i in ids[-5:]]
    assert all(server.client.get(f"/v1/responses/{i}").status_code == 200 for i in ids[-10:])
    assert openai_error(server.client.get(f"/v1/responses/{ids[0]}"), 404)["param"] == (
        "response_id"
    )
    found = [i for i in ids if server.client.get(f"/v1/responses/{i}").status_code == 200]
    # What is left is the newest, in order, and fits the budget with the sweeps' slack.
    assert found == ids[-len(found) :]
    assert len(found) * min(sizes) <= budget + 2 * (budget // 16)


# -- background, and faults on their own servers --------------------------------------

LONG: Any = {"model": "tiny", "input": HELLO, "max_output_tokens": 480}


def test_background_then_cancel_aborts_the_engine_request(start_server: StartServer) -> None:
    """The echo engine at 10 steps a second needs 48 s for 480 tokens: the cancel
    comes long before it could finish on its own."""
    server = start_server("--max-num-seqs", "1", *PACED)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    queued = client.responses.create(**LONG, background=True)
    assert queued.status in ("queued", "in_progress") and queued.background is True
    server.wait_for_metric("tserve_requests_live", 1)
    assert client.responses.retrieve(queued.id).status == "in_progress"
    aborts = server.metric("tserve_aborts_sent_total")
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and cancelled.id == queued.id
    assert server.metric("tserve_aborts_sent_total") == aborts + 1
    server.wait_for_metric("tserve_requests_live", 0)
    assert client.responses.retrieve(queued.id).status == "cancelled"
    again = client.responses.cancel(queued.id)  # a finished response stays as it is
    assert again.status == "cancelled"


def _settled(server: Server, client: openai.OpenAI, response_id: str) -> Response:
    """The background response once it has left queued and in_progress: polled each
    time the server has no request running, at most 600 times (a hang guard)."""
    done = client.responses.retrieve(response_id)
    polls = 600
    while done.status in ("queued", "in_progress") and polls:
        server.wait_for_metric("tserve_requests_live", 0)
        done = client.responses.retrieve(response_id)
        polls -= 1
    return done


def test_background_runs_to_completion_and_is_polled(server: Server) -> None:
    client = openai_client(server)
    queued = client.responses.create(
        model="tiny", input=HELLO, max_output_tokens=4, background=True, temperature=0
    )
    assert queued.status in ("queued", "in_progress")
    whole = client.responses.create(model="tiny", input=HELLO, max_output_tokens=4, temperature=0)
    server.wait_for_metric("tserve_requests_live", 0)
    done = _settled(server, client, queued.id)
    assert done.status == whole.status and done.output_text == whole.output_text
    body = {"model": "tiny", "input": "x", "background": True, "stream": True}
    assert openai_error(server.client.post("/v1/responses", json=body), 400)["param"] == "stream"


def test_cancel_of_a_foreground_response_is_a_400(server: Server) -> None:
    created = openai_client(server).responses.create(model="tiny", input="Hi", max_output_tokens=2)
    response = server.client.post(f"/v1/responses/{created.id}/cancel", json={})
    assert openai_error(response, 400)["param"] == "response_id"


def test_overload_is_503_with_retry_after(start_server: StartServer) -> None:
    """Two streams hold both slots while the engine is stopped (neither can finish):
    the next request is refused at once with 503, then both complete."""
    server = start_server("--max-pending", "2", "--max-queued", "0", "--max-num-seqs", "1")
    out: list[list[dict[str, Any]]] = []

    def read() -> None:
        with (
            httpx.Client(base_url=server.url, timeout=120) as client,
            client.stream("POST", "/v1/responses", json={**LONG, "stream": True}) as r,
        ):
            out.append(events_of(r))

    with server.engine_stopped():
        threads = [threading.Thread(target=read) for _ in range(2)]
        for t in threads:
            t.start()
        server.wait_for_metric("tserve_requests_live", 2)
        refused = httpx.post(f"{server.url}/v1/responses", json=LONG, timeout=30)
        assert openai_error(refused, 503)["code"] == "overloaded"
        assert refused.headers["Retry-After"].isdigit()
    for t in threads:
        t.join(120)
    assert len(out) == 2
    for events in out:  # the model may stop before its 480 tokens
        assert events[-1]["type"] in ("response.completed", "response.incomplete")


def test_engine_death_mid_stream_ends_with_response_failed(start_server: StartServer) -> None:
    server = start_server("--max-num-seqs", "1", *PACED)
    events = stream_through_engine_kill(server, "/v1/responses", LONG, events_of)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    failed = events[-1]
    assert failed["type"] == "response.failed", failed
    assert failed["response"]["status"] == "failed"
    assert "engine" in failed["response"]["error"]["message"]
    assert server.process.wait(60) != 0


# -- several API processes share the store ---------------------------------------------


def served_by(server: Server, request_id: str) -> int:
    """The pid of the API process whose access log line names ``request_id``."""
    for line in server.log.read_text().splitlines():
        words = line.split()
        if " tserve.access " in line and request_id in words:
            return int(words[2])
    raise AssertionError(f"no access log line for {request_id}")


def metric_of(client: httpx.Client, name: str) -> float:
    """``name`` as the process behind ``client``'s connection reports it."""
    lines = client.get("/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + " "))


def test_a_continuation_get_and_cancel_land_on_another_api_process(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Each connection stays with one process (keep-alive); a request on each learns
    which, so the continuation, the GET and the cancel go to the process that did not
    create the response."""
    server, worker, _ = start(tiny_model_dir, tmp_path, "--max-num-seqs", "1", *PACED)
    clients = [httpx.Client(base_url=server.url, timeout=120) for _ in range(16)]
    try:
        where: dict[int, httpx.Client] = {}
        for i, client in enumerate(clients):
            assert client.get("/v1/models", headers={"X-Request-Id": f"probe-{i}"}).is_success
            where.setdefault(served_by(server, f"probe-{i}"), client)
        assert set(where) == {server.process.pid, worker}, "every connection on one process"
        creator, other = where[server.process.pid], where[worker]
        body = {"model": "tiny", "input": "Hi", "max_output_tokens": 2}
        first = creator.post("/v1/responses", json=body).json()
        got = other.get(f"/v1/responses/{first['id']}")
        assert got.status_code == 200 and got.json() == first
        turn = {**body, "previous_response_id": first["id"], "input": "More"}
        second = other.post("/v1/responses", json=turn)
        assert second.status_code == 200, second.text
        path = "/v1/responses/{}/input_items?order=asc"
        before = [i["id"] for i in creator.get(path.format(first["id"])).json()["data"]]
        after = [i["id"] for i in creator.get(path.format(second.json()["id"])).json()["data"]]
        assert after[:-1] == [*before, *(item["id"] for item in first["output"])]
        # A background response of the main process, cancelled through the worker.
        queued = creator.post("/v1/responses", json={**LONG, "background": True}).json()
        live = 0.0  # the creator's gauge: the engine has its request (a hang guard bounds it)
        for _ in range(6000):
            live = metric_of(creator, "tserve_requests_live")
            if live == 1:
                break
            time.sleep(0.05)
        assert live == 1
        cancelled = other.post(f"/v1/responses/{queued['id']}/cancel", json={})
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        assert creator.get(f"/v1/responses/{queued['id']}").json()["status"] == "cancelled"
        assert metric_of(creator, "tserve_requests_live") == 0
    finally:
        for client in clients:
            client.close()
        server.stop()


# -- a real agent's request ---------------------------------------------------------------

# Codex CLI 0.171.0's first request of `codex exec "say hi"` (a custom provider with
# wire_api "responses"), exactly as it sent it but cut to fit the test model: message
# texts cut to 300 characters, and of its tools one function tool, the namespace tool
# with one of its functions, and the hosted web_search tool (10 function tools left out).
CODEX_REQUEST = Path(__file__).parent / "codex_request.json"


@pytest.fixture(scope="module")
def long_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny model with 8,192 positions (its rotary positions have no table to
    outgrow), for a request the size of Codex's, cut."""
    directory = tmp_path_factory.mktemp("long") / "model"
    tiny_model_copy(tiny_model_dir, directory, max_position_embeddings=8192)
    yield from served(directory, tmp_path_factory, folder="long-server")


def test_the_codex_request_replays_as_a_well_formed_stream(long_server: Server) -> None:
    body = json.loads(CODEX_REQUEST.read_text())
    assert body["stream"] is True and body["store"] is False
    headers = {"accept": "text/event-stream", "originator": "codex_exec"}
    body["max_output_tokens"] = 64  # Codex sends none: the rest of the context
    with long_server.client.stream("POST", "/v1/responses", json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        events = events_of(r)
    check_order(events)
    final = events[-1]["response"]
    assert final["store"] is False and final["tool_choice"] == "auto"
    assert [t["type"] for t in final["tools"]] == ["function", "namespace", "web_search"]
    for item in final["output"]:
        if item["type"] == "function_call":
            assert item["name"] in ("exec_command", "close_agent")
            assert ("namespace" in item) == (item["name"] == "close_agent")
    openai_error(long_server.client.get(f"/v1/responses/{final['id']}"), 404)  # store: false


def test_a_background_response_the_engine_refuses_is_failed_with_the_reason(
    server: Server,
) -> None:
    """A refusal found only when the request is run (an input past the context) fails
    the background response with that 400's message; it is not an internal error,
    and nothing is logged as one."""
    client = openai_client(server)
    log_before = server.log.read_text(errors="replace")
    queued = client.responses.create(
        model="tiny", input="hello " * 20_000, max_output_tokens=4, background=True
    )
    done = _settled(server, client, queued.id)
    assert done.status == "failed"
    assert done.error is not None and "context length" in done.error.message
    added = server.log.read_text(errors="replace")[len(log_before) :]
    assert "internal error" not in added and "Traceback" not in added, added
