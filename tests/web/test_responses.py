"""Response and chunk builders, the SSE encoder and the error mapping, sans-IO."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
from werkzeug.exceptions import MethodNotAllowed, NotFound, RequestEntityTooLarge

from tserve.nursery import (
    Delta,
    EngineDeadError,
    InvalidRequest,
    Overloaded,
    RequestFailed,
    RequestTimeout,
    ShuttingDown,
    Usage,
)
from tserve.protocol import TokenLogprob
from tserve.web import _sse
from tserve.web._errors import ModelNotFound, RequestAborted, Unauthorized, error_reply
from tserve.web._responses import (
    CHAT,
    COMPLETION,
    ChatChoice,
    CompletionChoice,
    Envelope,
    total_usage,
)

TEXTS = {1: "Hel", 2: "lo", 3: "!", 4: "\ufffd"}


def text_of(token_id: int) -> str:
    return TEXTS[token_id]


def lp(token_id: int, logprob: float, *top: tuple[int, float]) -> TokenLogprob:
    return TokenLogprob(token_id, logprob, list(top))


def test_completion_choice_text_finish_and_logprobs() -> None:
    choice = CompletionChoice(0, text_of, logprobs=True, prefix="Say: ")
    first = choice.push(Delta("Hello", [1, 2], [lp(1, -0.5, (1, -0.5)), lp(2, -1.0, (3, -0.2))]))
    assert first["text"] == "Say: Hello" and first["finish_reason"] is None
    assert first["logprobs"]["text_offset"] == [5, 8]
    last = choice.push(Delta("!", [3], [lp(3, float("-inf"))], "length", Usage(2, 3)))
    assert last["logprobs"] == {
        "tokens": ["!"],
        "token_logprobs": [-9999.0],
        "top_logprobs": [{}],
        "text_offset": [10],
    }
    final = choice.final()
    assert final["text"] == "Say: Hello!" and final["finish_reason"] == "length"
    assert final["logprobs"]["tokens"] == ["Hel", "lo", "!"]
    assert final["logprobs"]["top_logprobs"][1] == {"!": -0.2}
    assert choice.usage == Usage(2, 3)


def test_completion_choice_without_logprobs() -> None:
    choice = CompletionChoice(3, text_of, logprobs=False)
    assert choice.push(Delta("a", [1], None, "stop", Usage(1, 1)))["logprobs"] is None
    assert choice.final() == {"index": 3, "text": "a", "logprobs": None, "finish_reason": "stop"}


def test_chat_choice_role_first_then_content_and_logprobs() -> None:
    choice = ChatChoice(1, text_of, logprobs=True)
    first = choice.push(Delta("Hel", [1], [lp(1, -0.1, (4, -2.0))]))
    assert first["delta"] == {"role": "assistant", "content": "Hel"}
    entry = first["logprobs"]["content"][0]
    assert entry == {
        "token": "Hel",
        "logprob": -0.1,
        "bytes": list(b"Hel"),
        "top_logprobs": [{"token": "\ufffd", "logprob": -2.0, "bytes": [239, 191, 189]}],
    }
    second = choice.push(Delta("lo", [2], [lp(2, -0.2)], "stop", Usage(4, 2)))
    assert second["delta"] == {"content": "lo"} and second["finish_reason"] == "stop"
    final = choice.final()
    assert final["message"] == {"role": "assistant", "content": "Hello", "refusal": None}
    assert [e["token"] for e in final["logprobs"]["content"]] == ["Hel", "lo"]


def test_a_streamed_choice_sends_the_same_chunks_and_keeps_nothing_it_sent() -> None:
    """keep=False (streaming): each chunk as with keep=True, but no text or
    logprobs pile up across the stream; only the finish and usage stay."""
    top = [(t, -1.0) for t in (1, 2, 3, 4)] * 5  # 20 alternatives
    deltas = [Delta("ab", [1, 2], [lp(1, -0.5, *top), lp(2, -0.7, *top)]) for _ in range(50)]
    deltas.append(Delta("!", [3], [lp(3, -0.1, *top)], "length", Usage(2, 101)))
    pairs: list[tuple[CompletionChoice, CompletionChoice] | tuple[ChatChoice, ChatChoice]] = [
        (
            CompletionChoice(0, text_of, logprobs=True, prefix="P"),
            CompletionChoice(0, text_of, logprobs=True, prefix="P", keep=False),
        ),
        (ChatChoice(0, text_of, logprobs=True), ChatChoice(0, text_of, logprobs=True, keep=False)),
    ]
    for kept, streamed in pairs:
        for delta in deltas:
            assert streamed.push(delta) == kept.push(delta)
        assert (streamed.finish_reason, streamed.usage) == ("length", Usage(2, 101))
        assert streamed._parts == []
        assert getattr(streamed, "_content", []) == []
        lps = getattr(streamed, "_lp", {})
        assert all(values == [] for values in lps.values())


def test_whole_responses_and_usage_counts_each_prompt_once() -> None:
    choices = [CompletionChoice(i, text_of, logprobs=False) for i in range(4)]
    for i, c in enumerate(choices):  # 2 prompts (5 and 7 tokens) x n=2
        c.push(Delta("x", [1], None, "length", Usage(5 if i < 2 else 7, 1 + i)))
    usage = total_usage(choices, n=2)
    assert usage == Usage(12, 10)
    body = Envelope("cmpl-1", 9, "m", COMPLETION).response(choices, usage)
    assert body["object"] == "text_completion" and body["model"] == "m"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"] == {"prompt_tokens": 12, "completion_tokens": 10, "total_tokens": 22}
    chat = ChatChoice(0, text_of, logprobs=False)
    chat.push(Delta("hi", [1], None, "stop", Usage(3, 1)))
    body = Envelope("chatcmpl-1", 9, "m", CHAT).response([chat], Usage(3, 1))
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == "hi"


def test_chunks() -> None:
    choice = {"index": 0, "text": "a", "logprobs": None, "finish_reason": None}
    chunk = Envelope("id", 1, "m", COMPLETION).chunk(choice, include_usage=False)
    assert chunk["object"] == "text_completion" and "usage" not in chunk
    chat = Envelope("id", 1, "m", CHAT)
    chunk = chat.chunk(choice, include_usage=True)
    assert chunk["object"] == "chat.completion.chunk" and chunk["usage"] is None
    assert list(chunk) == [
        *("id", "object", "created", "model", "system_fingerprint", "choices", "usage")
    ]
    last = chat.usage_chunk(Usage(2, 3))
    assert last["object"] == "chat.completion.chunk"
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 5


def test_sse_encoding() -> None:
    assert _sse.event({"a": "é\n"}) == b'data: {"a":"\xc3\xa9\\n"}\n\n'
    assert _sse.DONE == b"data: [DONE]\n\n"
    event = _sse.event(error_reply(ShuttingDown("bye"), "r").body)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:])["error"]["code"] == "shutting_down"


@pytest.mark.parametrize(
    ("exc", "status", "type_", "code", "retry"),
    [
        (InvalidRequest("bad n", param="n"), 400, "invalid_request_error", None, False),
        (Unauthorized("no key"), 401, "invalid_request_error", "invalid_api_key", False),
        (
            ModelNotFound("no such", param="model"),
            404,
            "invalid_request_error",
            "model_not_found",
            False,
        ),
        (NotFound(), 404, "invalid_request_error", "not_found", False),
        (MethodNotAllowed(), 405, "invalid_request_error", "method_not_allowed", False),
        (RequestEntityTooLarge(), 413, "invalid_request_error", "payload_too_large", False),
        (RequestFailed("sampler broke"), 422, "invalid_request_error", "request_failed", False),
        (Overloaded("full", retry_after=2.5), 503, "server_error", "overloaded", True),
        (ShuttingDown("bye"), 503, "server_error", "shutting_down", True),
        (EngineDeadError("gone"), 503, "server_error", "engine_dead", True),
        (RequestAborted("aborted"), 503, "server_error", "request_aborted", True),
        (RequestTimeout("late"), 504, "server_error", "timeout", False),
    ],
)
def test_error_mapping(
    exc: Exception, status: int, type_: str, code: str | None, retry: bool
) -> None:
    reply = error_reply(exc, "req-1")
    assert reply.status == status
    error = reply.body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == (type_, code)
    assert ("Retry-After" in reply.headers) == retry
    if isinstance(exc, Overloaded):
        assert reply.headers["Retry-After"] == "3"


def test_error_mapping_names_the_param() -> None:
    assert error_reply(InvalidRequest("x", param="top_p"), "r").body["error"]["param"] == "top_p"


def test_a_bug_is_a_500_naming_the_request(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        reply = error_reply(ZeroDivisionError("oops"), "req-42")
    assert reply.status == 500 and "req-42" in reply.body["error"]["message"]
    assert "oops" not in reply.body["error"]["message"]
    assert any(r.exc_info for r in caplog.records)


def test_web_layer_does_not_import_torch_at_import_time() -> None:
    code = "import sys, tserve.web; print('torch' in sys.modules or 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
