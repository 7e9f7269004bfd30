"""The wire between API processes and the engine process.

This is a leaf module: it imports only the standard library and msgspec, so
that the engine (torch) never imports trio or quart and the web layer never
imports torch.

Framing rules:

* Every ZMQ message is ONE frame (plus the ROUTER's identity frame on the
  engine side): one byte of :class:`Kind` followed by the msgpack body of the
  struct that kind names. There is exactly one struct type per kind and one
  typed decoder per kind; nothing is pickled and nothing is dispatched by name.
* API process -> engine: :class:`Hello` once (the ROUTER learns a peer only
  from a message it receives), then :class:`EngineInput` frames, each holding
  every add and abort the mux had pending, and finally :class:`Shutdown`.
* Engine -> API process: :class:`EngineReady` in answer to ``Hello``, then one
  :class:`StepOutputs` per engine step that produced anything for that peer,
  :class:`Heartbeat` while idle, and :class:`EngineDead` before a fatal exit.
* Within one :class:`EngineInput`, adds are applied before aborts, so an abort
  for a request added in the same frame still takes effect.
* The structs that stream at high rates (outputs, stats, logprobs) are not
  tracked by the cyclic GC (``gc=False``): they hold only ints, floats,
  strings and lists of those, so they can never be part of a cycle.
* A request's outputs end with exactly one :class:`RequestOutput` whose
  ``finish_reason`` is set; nothing for that id follows it.
"""

from __future__ import annotations

import enum
from typing import Final, Literal, TypeAlias

import msgspec

__all__ = [
    "AddRequest",
    "EngineConfig",
    "EngineDead",
    "EngineInput",
    "EngineReady",
    "EngineStats",
    "FinishReason",
    "Heartbeat",
    "Hello",
    "Kind",
    "Message",
    "ProtocolError",
    "RequestOutput",
    "SamplingParams",
    "Shutdown",
    "StepOutputs",
    "TokenLogprob",
    "decode",
    "encode",
    "merge_outputs",
]


class ProtocolError(Exception):
    """A frame that is not a well-formed tserve message."""


class Kind(enum.IntEnum):
    """The first byte of every frame."""

    HELLO = 1
    INPUT = 2
    SHUTDOWN = 3
    READY = 16
    STEP = 17
    HEARTBEAT = 18
    DEAD = 19


class FinishReason(enum.IntEnum):
    """Why a request ended. Maps onto OpenAI's ``finish_reason`` strings."""

    STOP = 1  # a stop token (EOS by default) was sampled
    LENGTH = 2  # max_tokens reached, or the context is full
    ABORT = 3  # an Abort was received for it
    ERROR = 4  # this request alone failed; RequestOutput.error says why

    @property
    def openai(self) -> str:
        return _OPENAI_FINISH[self]


_OPENAI_FINISH: Final = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
}


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """How to pick each next token of one request.

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` disable
    those filters. ``seed`` makes sampling reproducible for this request
    whatever else is in the batch. ``logprobs`` is the number of top
    alternatives to report per token (0 = only the chosen token's logprob,
    None = no logprobs). EOS ends the request unless ``ignore_eos``.
    ``stop`` strings are matched on text by the API process, which strips
    them before sending; the engine never sees text.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()


class AddRequest(msgspec.Struct, array_like=True, frozen=True):
    """Start generating for one request.

    ``deadline`` is a wall-clock time (``time.time()``) after which the engine
    ends the request with ``FinishReason.ABORT`` on its own; None = no limit.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    deadline: float | None = None


CpuGemm: TypeAlias = Literal["auto", "blas", "onednn"]
"""The library behind linear layers on CPU: measured per layer, or forced."""

ModelImpl: TypeAlias = Literal["auto", "hf"]
"""Whose forward pass runs the model: tserve's own where it covers the model, or transformers'."""


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to start an engine process; handed to it as JSON on its command line.

    ``model`` is a local model directory, or "default" for the bundled
    SmolLM2-135M-Instruct. ``kv_cache_tokens`` is the KV budget in tokens
    shared by all running requests; ``max_model_len`` None = the model's own
    context length (capped by the KV budget). ``threads`` is torch's CPU thread
    count. ``device``/``dtype`` "auto" = CUDA with bf16 when present, else CPU
    with fp32. ``cpu_gemm`` picks the library behind linear layers on CPU:
    "auto" measures, per layer shape and row count, whether the BLAS or
    prepacked oneDNN is faster; "blas" and "onednn" force one.
    ``enable_prefix_caching`` keeps the K/V of full blocks of tokens after
    their request ends and lets a request whose prompt starts with the same
    tokens share them instead of computing them again.
    ``max_decode_slowdown``: while requests decode, a step that also runs
    prompt tokens may cost at most this many times a decode-only step (in
    the scheduler's token cost model), so streams never stall behind a long
    prompt; 0 = no bound (``max_num_batched_tokens`` every step).
    ``model_impl`` "auto" runs Llama-family models (Llama, Mistral, Qwen2) on
    tserve's own forward pass and every other on its transformers modules;
    "hf" runs every model on its transformers modules.

    ``task`` "embed" makes an embedding engine instead (``tserve.gpu._embed_core``):
    ``model`` is then a local encoder directory, or "default" for the packaged
    all-MiniLM-L6-v2; ``max_model_len`` None = the encoder's own maximum (256
    for MiniLM); ``max_num_seqs`` and ``max_num_batched_tokens`` bound one
    forward pass (inputs, and padded tokens); the KV fields are unused, and
    ``dtype`` "auto" is fp32 on every device.

    ``engine_kind`` "echo" runs no model at all (``tserve.gpu._echo_core``), to
    measure the frontend alone: ``model`` is only where the API process's
    tokenizer comes from (no weights are loaded); each step, every one of up
    to ``max_num_seqs`` requests gets one token, echoing its prompt, and a
    step takes ``echo_step_time`` seconds. ``max_tokens``, stop token ids,
    deadlines and aborts are honoured as by the real engine; EOS is never
    echoed, so a request gets exactly ``max_tokens`` tokens unless a stop
    token id or the context length ends it first.
    """

    model: str = "default"
    max_num_seqs: int = 64
    kv_cache_tokens: int = 16384
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    block_size: int = 16
    threads: int = 1
    device: str = "auto"
    dtype: str = "auto"
    heartbeat_interval: float = 0.5
    cache_dir: str | None = None
    task: Literal["generate", "embed"] = "generate"
    cpu_gemm: CpuGemm = "auto"
    engine_kind: Literal["model", "echo"] = "model"
    echo_step_time: float = 0.01
    enable_prefix_caching: bool = True
    max_decode_slowdown: float = 2.5
    model_impl: ModelImpl = "auto"


class Hello(msgspec.Struct, array_like=True, frozen=True):
    """First message of an API process; the engine answers with EngineReady."""

    pid: int


class EngineInput(msgspec.Struct, array_like=True, frozen=True):
    """Everything the mux had pending, in one frame. Adds apply before aborts.

    Aborts are idempotent: an id that is unknown or already finished is ignored.
    """

    adds: list[AddRequest] = []
    aborts: list[str] = []


class Shutdown(msgspec.Struct, array_like=True, frozen=True):
    """Ask the engine to stop: it aborts everything and exits 0."""

    reason: str = ""


class TokenLogprob(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The chosen token's logprob and, when asked, the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


class RequestOutput(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """New tokens of one request since its previous output.

    ``logprobs`` is None unless the request asked for them; then it has one
    entry per token in ``token_ids``. ``error`` is set only with
    ``FinishReason.ERROR``. ``embedding`` is set only by an embedding engine,
    in its one output per request (``FinishReason.STOP``, no token ids): the
    vector as little-endian float32 (4 bytes per dimension). Trailing and
    defaulted, so frames from before it still decode.
    """

    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    embedding: bytes | None = None


def merge_outputs(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """One output equal to ``first`` followed by ``then`` (same request).

    Used wherever deltas wait for a slow reader, so waiting coalesces instead
    of queueing: token ids and logprobs are concatenated, and the finish
    reason and error of whichever carries one are kept.
    """
    if first.logprobs is None and then.logprobs is None:
        logprobs = None
    else:
        logprobs = (first.logprobs or []) + (then.logprobs or [])
    return RequestOutput(
        first.request_id,
        first.token_ids + then.token_ids,
        then.finish_reason if then.finish_reason is not None else first.finish_reason,
        logprobs,
        then.error if then.error is not None else first.error,
        then.embedding if then.embedding is not None else first.embedding,
    )


class EngineStats(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A snapshot of the engine's load, sent with every step and heartbeat.

    ``kv_tokens_used`` counts blocks held by requests, not the free ones that
    still hold a cached prefix. The prefix-cache counters are totals since
    start, in tokens: ``prefix_cache_queries`` every known token of each
    admitted request (its prompt, plus its outputs when it is recomputed after
    a preemption), ``prefix_cache_hits`` those found in the cache; both 0 with
    caching off. Trailing and defaulted, so frames from before them decode.
    """

    running: int = 0
    waiting: int = 0
    kv_tokens_used: int = 0
    kv_tokens_total: int = 0
    steps: int = 0
    aborts_received: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class StepOutputs(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One engine step's output for one API process: every request's delta."""

    outputs: list[RequestOutput]
    stats: EngineStats


class EngineReady(msgspec.Struct, array_like=True, frozen=True):
    """The model is loaded and the engine takes requests.

    ``model_path`` is the local directory the engine loaded, so the API
    process loads the same tokenizer. ``task`` is the engine's
    ``EngineConfig.task``; an embedding engine also says ``embedding_dim``
    (0 for a generation engine), and its ``max_model_len`` is the longest
    input it takes. ``kv_block_size`` is the tokens in one KV block (0 for
    an engine without a KV cache), so ``kv_tokens_total // kv_block_size``
    blocks make the cache. The last three fields are trailing and defaulted,
    so a frame from before them still decodes.
    """

    model: str
    model_path: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    max_num_seqs: int
    kv_tokens_total: int
    device: str
    pid: int
    task: str = "generate"
    embedding_dim: int = 0
    kv_block_size: int = 0


class Heartbeat(msgspec.Struct, array_like=True, frozen=True):
    """Sent while the engine is idle, so silence always means trouble."""

    stats: EngineStats


class EngineDead(msgspec.Struct, array_like=True, frozen=True):
    """The engine hit an unrecoverable error and is about to exit non-zero."""

    reason: str


Message: TypeAlias = (
    Hello | EngineInput | Shutdown | EngineReady | StepOutputs | Heartbeat | EngineDead
)

_KIND_OF: Final[dict[type[Message], Kind]] = {
    Hello: Kind.HELLO,
    EngineInput: Kind.INPUT,
    Shutdown: Kind.SHUTDOWN,
    EngineReady: Kind.READY,
    StepOutputs: Kind.STEP,
    Heartbeat: Kind.HEARTBEAT,
    EngineDead: Kind.DEAD,
}
_DECODERS: Final[dict[int, msgspec.msgpack.Decoder[Message]]] = {
    kind: msgspec.msgpack.Decoder(cls) for cls, kind in _KIND_OF.items()
}
_ENCODER: Final = msgspec.msgpack.Encoder()


def encode(message: Message) -> bytearray:
    """One frame: the kind byte, then the msgpack body (encoded in place)."""
    frame = bytearray((_KIND_OF[type(message)],))
    _ENCODER.encode_into(message, frame, 1)
    return frame


def decode(frame: bytes | bytearray | memoryview) -> Message:
    """Parse one frame. Raises ProtocolError on anything malformed."""
    if len(frame) < 2:
        raise ProtocolError(f"frame of {len(frame)} bytes is too short")
    decoder = _DECODERS.get(frame[0])
    if decoder is None:
        raise ProtocolError(f"unknown message kind {frame[0]}")
    try:
        return decoder.decode(memoryview(frame)[1:])
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"bad {Kind(frame[0]).name} frame: {exc}") from None
