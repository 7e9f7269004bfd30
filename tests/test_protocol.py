"""Round trips and malformed frames for every wire message."""

from __future__ import annotations

import subprocess
import sys
from types import ModuleType

import msgspec
import pytest

from tserve import engine_config, sampling
from tserve import protocol as p

MESSAGES: list[p.Message] = [
    p.Hello(pid=123),
    p.Hello(pid=124, tokenizer=True),
    p.Hello(pid=125, grammars=True),
    p.EngineInput(),
    p.EngineInput(
        adds=[
            p.AddRequest("r1", [1, 2, 3], p.SamplingParams()),
            p.AddRequest(
                "r2",
                [],
                p.SamplingParams(
                    max_tokens=7,
                    temperature=0.0,
                    top_p=0.9,
                    top_k=40,
                    seed=2**40,
                    stop_token_ids=(5, 6),
                    ignore_eos=True,
                    logprobs=3,
                    presence_penalty=0.5,
                    frequency_penalty=-0.25,
                ),
                deadline=1.75e9,
            ),
        ],
        aborts=["r0", "r1"],
    ),
    p.Shutdown(),
    p.Shutdown(reason="SIGTERM"),
    p.EngineReady("tiny", "/models/tiny", 2048, 512, [0, 2], 64, 65536, "cpu", 42),
    p.EngineReady("minilm", "/models/minilm", 256, 30522, [], 64, 0, "cpu", 43, "embed", 384),
    p.EngineReady(
        "smollm2",
        "/models/smollm2",
        8192,
        49152,
        [2],
        64,
        16384,
        "cpu",
        44,
        kv_block_size=16,
        sampling_defaults=p.SamplingDefaults(0.2, 0.9, None, "SmolLM2-135M-Instruct's model card"),
    ),
    p.StepOutputs([], p.EngineStats()),
    p.StepOutputs(
        [
            p.RequestOutput("a", [9]),
            p.RequestOutput("b", [1, 2], p.FinishReason.LENGTH),
            p.RequestOutput(
                "c",
                [4],
                p.FinishReason.STOP,
                logprobs=[p.TokenLogprob(4, -0.125, [(4, -0.125), (8, -2.5)])],
            ),
            p.RequestOutput("d", [], p.FinishReason.ERROR, error="bad seed"),
            p.RequestOutput("e", [], p.FinishReason.ABORT),
            p.RequestOutput("f", [], p.FinishReason.STOP, embedding=b"\x00\x00\x80?" * 3),
        ],
        p.EngineStats(running=3, waiting=1, kv_tokens_used=100, kv_tokens_total=4096, steps=9),
    ),
    p.Heartbeat(p.EngineStats(aborts_received=4)),
    p.Heartbeat(p.EngineStats(steps=2, prefix_cache_queries=1500, prefix_cache_hits=1488)),
    p.EngineDead("CUDA error: device-side assert"),
    p.TokenizerBundle({}),
    p.TokenizerBundle(
        {"tokenizer.json": b'{"model": {}}', "additional_chat_templates/tool_use.jinja": b"{{ x }}"}
    ),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message: p.Message) -> None:
    frame = p.encode(message)
    assert frame[0] == p._KIND_OF[type(message)]
    decoded = p.decode(bytes(frame))
    assert decoded == message
    assert type(decoded) is type(message)


def test_every_kind_has_a_message() -> None:
    assert set(p._KIND_OF.values()) == set(p.Kind)
    assert {p._KIND_OF[type(m)] for m in MESSAGES} == set(p.Kind)


def test_finish_reason_names() -> None:
    assert [r.openai for r in p.FinishReason] == ["stop", "length", "abort", "error"]


@pytest.mark.parametrize(
    "frame",
    [b"", b"\x02", b"\xff\x90", bytes([p.Kind.INPUT]) + b"\xc1", bytes([p.Kind.HELLO]) + b"\x90"],
    ids=["empty", "kind-only", "unknown-kind", "bad-msgpack", "wrong-shape"],
)
def test_malformed_frames_raise_protocol_error(frame: bytes) -> None:
    with pytest.raises(p.ProtocolError):
        p.decode(frame)


def test_a_frame_of_one_kind_does_not_decode_as_another() -> None:
    frame = p.encode(p.Shutdown("x"))
    frame[0] = p.Kind.STEP
    with pytest.raises(p.ProtocolError):
        p.decode(frame)


@pytest.mark.parametrize(
    "module",
    [
        "tserve.protocol",
        "tserve.engine_config",
        "tserve.sampling",
        "tserve.validity",
        "tserve.grammar",
    ],
)
def test_protocol_is_a_leaf(module: str) -> None:
    """The wire and its validity rule pull in neither torch, zmq, trio, anyio nor quart."""
    code = (
        f"import sys, {module}; "
        "bad = {'torch', 'zmq', 'trio', 'anyio', 'quart', 'transformers', 'numpy'}"
        " & set(sys.modules); print(sorted(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("module", [engine_config, sampling], ids=lambda m: m.__name__)
def test_protocol_re_exports_its_leaves(module: ModuleType) -> None:
    """engine_config's and sampling's names stay importable from protocol, as the same objects."""
    names: list[str] = module.__all__
    assert set(names) <= set(p.__all__)
    assert all(getattr(p, name) is getattr(module, name) for name in names)


def test_frames_from_before_the_embedding_fields_still_decode() -> None:
    """RequestOutput.embedding and EngineReady.task/embedding_dim are trailing defaults."""
    old_output = msgspec.msgpack.encode(["a", [1], 1, None, None])
    frame = bytes([p.Kind.STEP]) + msgspec.msgpack.encode([[msgspec.Raw(old_output)], []])
    step = p.decode(frame)
    assert isinstance(step, p.StepOutputs)
    assert step.outputs == [p.RequestOutput("a", [1], p.FinishReason.STOP)]
    assert step.outputs[0].embedding is None
    ready = ["tiny", "/m", 2048, 512, [0], 64, 65536, "cpu", 42]
    decoded = p.decode(bytes([p.Kind.READY]) + msgspec.msgpack.encode(ready))
    assert isinstance(decoded, p.EngineReady)
    assert (decoded.task, decoded.embedding_dim) == ("generate", 0)
    stats = msgspec.msgpack.encode([1, 0, 16, 64, 5, 0])  # before the prefix-cache counters
    beat = p.decode(bytes([p.Kind.HEARTBEAT]) + msgspec.msgpack.encode([msgspec.Raw(stats)]))
    assert isinstance(beat, p.Heartbeat)
    assert beat.stats == p.EngineStats(1, 0, 16, 64, 5, 0, prefix_cache_queries=0)


def _merged(*outputs: p.RequestOutput) -> p.RequestOutput | None:
    merge = p.OutputMerge()
    for output in outputs:
        merge.add(output)
    merged = merge.take()
    assert merge.empty and merge.take() is None
    return merged


def test_merge_keeps_the_embedding() -> None:
    vector = b"\x00\x00\x80?"
    first = p.RequestOutput("a", [])
    then = p.RequestOutput("a", [], p.FinishReason.STOP, embedding=vector)
    assert _merged(first, then) == then
    assert _merged(then, p.RequestOutput("a", [])) == then


def test_merge_concatenates_in_order_and_keeps_the_latest_ending() -> None:
    lp = [p.TokenLogprob(i, -float(i)) for i in range(4)]
    one = p.RequestOutput("a", [0])
    assert _merged(one) is one, "a lone output is handed on as it is"
    assert _merged() is None
    merged = _merged(
        p.RequestOutput("a", [0, 1], logprobs=lp[:2]),
        p.RequestOutput("a", [2]),
        p.RequestOutput("a", [3], p.FinishReason.ERROR, logprobs=lp[3:], error="boom"),
    )
    want = p.RequestOutput("a", [0, 1, 2, 3], p.FinishReason.ERROR, lp[:2] + lp[3:], "boom")
    assert merged == want
    assert one.token_ids == [0], "the outputs merged are left as they were"


def test_engine_config_task_is_checked_on_decode() -> None:
    assert msgspec.json.decode(b'{"task": "embed"}', type=p.EngineConfig).task == "embed"
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"task": "rerank"}', type=p.EngineConfig)


def test_a_hello_from_before_the_tokenizer_flag_still_decodes() -> None:
    hello = p.decode(bytes([p.Kind.HELLO]) + msgspec.msgpack.encode([7]))
    assert hello == p.Hello(7, tokenizer=False, grammars=False)
    hello = p.decode(bytes([p.Kind.HELLO]) + msgspec.msgpack.encode([7, True]))
    assert hello == p.Hello(7, tokenizer=True, grammars=False)  # before the grammars flag


@pytest.mark.parametrize(
    ("name", "allowed"),
    [
        ("tokenizer.json", True),
        ("generation_config.json", True),
        ("additional_chat_templates/tool_use.jinja", True),
        ("model.safetensors", False),
        ("../tokenizer.json", False),
        ("/etc/passwd", False),
        ("additional_chat_templates/../../x.jinja", False),
        ("additional_chat_templates/.hidden.jinja", False),
        ("additional_chat_templates/a\\b.jinja", False),
        ("additional_chat_templates/notes.txt", False),
        ("additional_chat_templates/sub/x.jinja", False),
    ],
)
def test_a_tokenizer_bundle_names_only_tokenizer_files(name: str, allowed: bool) -> None:
    """The receiver writes a bundle's files into a directory: no other name may reach it."""
    assert p.tokenizer_file_allowed(name) is allowed
