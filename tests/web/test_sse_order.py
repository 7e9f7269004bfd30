"""The order of a stream's SSE events, for every way a stream ends. Sans-IO.

chunk* -> (error | usage)? -> [DONE]; anything else raises SSEOrderError.
"""

from __future__ import annotations

import json
from functools import partial

import pytest

from tserve.nursery import Delta, EngineDeadError, RequestFailed, ShuttingDown, Usage
from tserve.web._errors import RequestAborted
from tserve.web._responses import CHAT, COMPLETION, ChatChoice, CompletionChoice, Envelope
from tserve.web._sse import DONE, SSEEvents, SSEOrderError, StreamPhase

ENVELOPE = Envelope("cmpl-1", 7, "m", COMPLETION)


def text_of(token_id: int) -> str:
    return "x"


def events(choices: int = 1, *, usage: bool = False, n: int = 1) -> SSEEvents:
    return SSEEvents(
        [CompletionChoice(i, text_of, logprobs=False) for i in range(choices)],
        chunk=partial(ENVELOPE.chunk, include_usage=usage),
        usage_chunk=ENVELOPE.usage_chunk if usage else None,
        n=n,
        request_id="req-1",
    )


def running(text: str = "a") -> Delta:
    return Delta(text, [1])


def finished(prompt: int = 3, completion: int = 2) -> Delta:
    return Delta("z", [1], None, "stop", Usage(prompt, completion))


def kind(event: bytes) -> str:
    """A short name for one event: chunk<i>, chunk<i>!(its last), error:<code>, usage, DONE."""
    if event == DONE:
        return "DONE"
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    payload = json.loads(event[6:])
    if "error" in payload:
        return f"error:{payload['error']['code']}"
    if payload["choices"] == []:
        return "usage"
    choice = payload["choices"][0]
    return f"chunk{choice['index']}" + ("!" if choice["finish_reason"] else "")


def test_every_choice_finishes_without_usage() -> None:
    sse = events()
    out = [sse.chunk(0, running()), sse.chunk(0, finished())]
    out += sse.close()
    assert [kind(e) for e in out] == ["chunk0", "chunk0!", "DONE"]
    assert sse.phase is StreamPhase.DONE and sse.status == 200


def test_every_choice_finishes_with_usage_last_before_done() -> None:
    sse = events(usage=True)
    out = [sse.chunk(0, running()), sse.chunk(0, finished(3, 2))]
    assert json.loads(out[0][6:])["usage"] is None  # every chunk says usage comes last
    out += sse.close()
    assert [kind(e) for e in out] == ["chunk0", "chunk0!", "usage", "DONE"]
    assert json.loads(out[2][6:])["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
    }


def test_n_choices_interleave_and_usage_counts_each_prompt_once() -> None:
    sse = events(4, usage=True, n=2)  # two prompts (5 and 7 tokens) x n=2
    out = [
        sse.chunk(1, running()),
        sse.chunk(0, finished(5, 1)),
        sse.chunk(3, finished(7, 2)),
        sse.chunk(1, finished(5, 3)),
    ]
    assert sse.unfinished == 1
    out.append(sse.chunk(2, finished(7, 4)))
    out += sse.close()
    assert [kind(e) for e in out] == [
        *("chunk1", "chunk0!", "chunk3!", "chunk1!", "chunk2!", "usage", "DONE")
    ]
    assert json.loads(out[-2][6:])["usage"]["prompt_tokens"] == 12
    assert json.loads(out[-2][6:])["usage"]["completion_tokens"] == 10


@pytest.mark.parametrize("usage", [False, True])
def test_an_error_mid_stream_replaces_the_usage_chunk(usage: bool) -> None:
    sse = events(2, usage=usage)
    out = [sse.chunk(0, running()), sse.chunk(1, finished())]
    out += sse.close(RequestFailed("sampler broke"))
    assert [kind(e) for e in out] == ["chunk0", "chunk1!", "error:request_failed", "DONE"]
    assert sse.status == 422


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (EngineDeadError("gone"), 503, "engine_dead"),
        (RequestAborted("the engine aborted this request"), 503, "request_aborted"),
    ],
)
def test_an_error_before_any_chunk(error: Exception, status: int, code: str) -> None:
    sse = events(usage=True)
    assert [kind(e) for e in sse.close(error)] == [f"error:{code}", "DONE"]
    assert sse.status == status


def test_abort_by_the_drain_ends_running_choices_with_its_reason() -> None:
    sse = events(2, usage=True)
    out = [sse.chunk(0, finished()), sse.chunk(1, running())]
    out += sse.close(ShuttingDown("the server shut down before this request finished"))
    assert [kind(e) for e in out] == ["chunk0!", "chunk1", "error:shutting_down", "DONE"]
    assert "shut down" in json.loads(out[2][6:])["error"]["message"]
    assert sse.status == 503


def test_a_stream_cut_short_without_a_reason_never_ends_silently() -> None:
    sse = events()
    out = [sse.chunk(0, running())]
    out += sse.close()
    assert [kind(e) for e in out] == ["chunk0", "error:shutting_down", "DONE"]
    assert "cut short" in json.loads(out[1][6:])["error"]["message"]


def test_chat_chunks_name_their_object() -> None:
    chat = Envelope("chatcmpl-1", 7, "m", CHAT)
    sse = SSEEvents(
        [ChatChoice(0, text_of, logprobs=False)],
        chunk=partial(chat.chunk, include_usage=True),
        usage_chunk=chat.usage_chunk,
        n=1,
        request_id="r",
    )
    out = [sse.chunk(0, finished()), *sse.close()]
    assert [json.loads(e[6:])["object"] for e in out[:2]] == ["chat.completion.chunk"] * 2


def illegal(sse: SSEEvents, step: str) -> None:
    """Take ``step``; it must raise SSEOrderError and change nothing."""
    before = (sse.phase, sse.unfinished, sse.status)
    with pytest.raises(SSEOrderError):
        if step == "chunk0":
            sse.chunk(0, running())
        elif step == "error":
            sse.error(ShuttingDown("bye"))
        elif step == "usage":
            sse.usage()
        else:
            assert step == "done"
            sse.done()
    assert (sse.phase, sse.unfinished, sse.status) == before


def test_illegal_while_streaming() -> None:
    sse = events(2, usage=True)
    sse.chunk(0, finished())
    illegal(sse, "chunk0")  # choice 0 has finished
    illegal(sse, "usage")  # choice 1 has not
    illegal(sse, "done")  # choice 1 has not, and the usage chunk is owed
    sse.chunk(1, finished())
    illegal(sse, "done")  # the usage chunk is still owed
    without_usage = events()
    illegal(without_usage, "usage")  # not asked for


@pytest.mark.parametrize("ending", ["error", "usage"])
def test_after_the_error_event_or_the_usage_chunk_only_done(ending: str) -> None:
    sse = events(usage=True)
    sse.chunk(0, finished())
    if ending == "error":
        sse.error(RequestFailed("late"))
    else:
        sse.usage()
    assert sse.phase is StreamPhase.ENDING
    for step in ("chunk0", "error", "usage"):
        illegal(sse, step)
    assert sse.done() == DONE


def test_nothing_after_done() -> None:
    sse = events()
    sse.chunk(0, finished())
    sse.done()
    for step in ("chunk0", "error", "usage", "done"):
        illegal(sse, step)
    with pytest.raises(SSEOrderError):
        sse.close()
