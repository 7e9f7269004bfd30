"""The wire between API processes and the engine process.

This is a leaf module: it imports only the standard library, msgspec,
:mod:`tserve.engine_config` (how to start an engine) and
:mod:`tserve.sampling` (how a request samples), leaves too, whose names it
re-exports, so that the engine (torch) never imports trio or quart and the
web layer never imports torch.

Framing rules:

* Every ZMQ message is ONE frame (plus the ROUTER's identity frame on the
  engine side): one byte of :class:`Kind` followed by the msgpack body of the
  struct that kind names. There is exactly one struct type per kind and one
  typed decoder per kind; nothing is pickled and nothing is dispatched by name.
* API process -> engine: :class:`Hello` once (the ROUTER learns a peer only
  from a message it receives), then :class:`EngineInput` frames, each holding
  every add and abort the mux had pending, and finally :class:`Shutdown`.
* Engine -> API process: :class:`EngineReady` (and :class:`TokenizerBundle`)
  in answer to ``Hello``, then one :class:`StepOutputs` per engine step that
  produced anything for that peer, :class:`Heartbeat` while idle, and
  :class:`EngineDead` before it exits on a fatal error or a stop signal.
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
from typing import Final, TypeAlias

import msgspec

from tserve.engine_config import (
    CpuGemm,
    EngineConfig,
    GgufActivations,
    GgufRunner,
    KvCacheDtype,
    ModelImpl,
)
from tserve.sampling import (
    OPENAI_SAMPLING,
    Choice,
    Constraint,
    JsonSchema,
    LarkGrammar,
    Regex,
    Sampling,
    SamplingDefaults,
    SamplingParams,
)

__all__ = [
    "OPENAI_SAMPLING",
    "TOKENIZER_FILES",
    "AddRequest",
    "Choice",
    "Constraint",
    "CpuGemm",
    "EngineConfig",
    "EngineDead",
    "EngineInput",
    "EngineReady",
    "EngineStats",
    "FinishReason",
    "GgufActivations",
    "GgufRunner",
    "Heartbeat",
    "Hello",
    "JsonSchema",
    "Kind",
    "KvCacheDtype",
    "LarkGrammar",
    "Message",
    "ModelImpl",
    "OutputMerge",
    "ProtocolError",
    "Regex",
    "RequestOutput",
    "Sampling",
    "SamplingDefaults",
    "SamplingParams",
    "Shutdown",
    "StepOutputs",
    "TokenLogprob",
    "TokenizerBundle",
    "decode",
    "encode",
    "tokenizer_file_allowed",
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
    TOKENIZER = 20


class FinishReason(enum.IntEnum):
    """Why a request ended. Maps onto OpenAI's ``finish_reason`` strings."""

    STOP = 1  # a stop token (EOS by default) was sampled
    LENGTH = 2  # max_tokens reached, or the context is full
    ABORT = 3  # an Abort was received for it
    ERROR = 4  # this request alone failed; RequestOutput.error says why

    @property
    def openai(self) -> str:
        return _OPENAI_FINISH[self]


_OPENAI_FINISH: Final = {reason: reason.name.lower() for reason in FinishReason}


class AddRequest(msgspec.Struct, array_like=True, frozen=True):
    """Start generating for one request.

    ``deadline`` is a wall-clock time (``time.time()``) after which the engine
    ends the request with ``FinishReason.ABORT`` on its own; None = no limit.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    deadline: float | None = None


class Hello(msgspec.Struct, array_like=True, frozen=True):
    """The first message of an API process.

    The engine answers with EngineReady, and then with a
    :class:`TokenizerBundle` if ``tokenizer``. With ``grammars`` the engine
    first builds what structured outputs need (llguidance's view of the
    vocabulary, which holds its GIL for a fraction of a second to seconds),
    so that no constrained request stalls its steps later. Both trailing and
    defaulted, so older frames decode.
    """

    pid: int
    tokenizer: bool = False
    grammars: bool = False


class EngineInput(msgspec.Struct, array_like=True, frozen=True):
    """Everything the mux had pending, in one frame. Adds apply before aborts.

    Aborts are idempotent: an id that is unknown or already finished is ignored.
    """

    adds: list[AddRequest] = []
    aborts: list[str] = []


class Shutdown(msgspec.Struct, array_like=True, frozen=True):
    """Ask the engine to stop: it aborts everything and exits 0.

    A ``tserve engine``, which serves API processes it did not start, ignores it.
    """

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
    vector as little-endian float32 (4 bytes per dimension). ``error_param``
    names the part of the request an error is about (``"constraint"``: its
    grammar), or None. ``cached_tokens`` is set only on a request's first
    output with tokens: how many of its prompt tokens the prefix cache held
    when it was admitted. Trailing and defaulted, so frames from before them
    still decode.
    """

    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    embedding: bytes | None = None
    error_param: str | None = None
    cached_tokens: int | None = None


class OutputMerge:
    """The outputs of one request that wait for their reader, merged as they arrive.

    THE rule for merging deltas, used wherever they wait for a slow reader so
    that waiting coalesces instead of queueing (the engine's outbox, the API
    process's mailboxes): token ids and logprobs are concatenated in order;
    the finish reason, error (and its param) and embedding are those of the output with a
    finish reason (the last one: only it carries an error or an embedding);
    ``cached_tokens`` is the first output's (only a request's first carries it).
    O(1) per token: a lone output is kept as it is, and a second one starts
    lists that later ones extend in place. Synchronous; not shared between
    threads.
    """

    __slots__ = ("_first", "_last", "_logprobs", "_token_ids")

    def __init__(self) -> None:
        # Invariant: _first is None iff nothing waits; _token_ids is not None
        # iff two or more outputs wait, and then it and _logprobs hold their
        # merge, and _last is the output with a finish reason, if one came.
        self._first: RequestOutput | None = None
        self._token_ids: list[int] | None = None
        self._logprobs: list[TokenLogprob] | None = None
        self._last: RequestOutput | None = None

    @property
    def empty(self) -> bool:
        """True when nothing waits."""
        return self._first is None

    def add(self, output: RequestOutput) -> None:
        """Merge ``output`` (the same request's next) into what waits."""
        token_ids = self._token_ids
        if token_ids is not None:  # the usual case under load: a merge goes on
            token_ids += output.token_ids
            if output.logprobs is not None:
                if self._logprobs is None:
                    self._logprobs = []
                self._logprobs += output.logprobs
        else:
            first = self._first
            if first is None:
                self._first = output
                return
            self._token_ids = first.token_ids + output.token_ids  # the second: merge
            if first.logprobs is not None or output.logprobs is not None:
                self._logprobs = (first.logprobs or []) + (output.logprobs or [])
            if first.finish_reason is not None:
                self._last = first
        if output.finish_reason is not None:
            self._last = output

    def take(self) -> RequestOutput | None:
        """Everything added since the last take as one output (None if nothing); empties."""
        first = self._first
        token_ids = self._token_ids
        self._first = None
        if first is None or token_ids is None:
            return first
        last = self._last
        if last is None:
            merged = RequestOutput(
                first.request_id,
                token_ids,
                None,
                self._logprobs,
                cached_tokens=first.cached_tokens,
            )
        else:
            merged = RequestOutput(
                first.request_id,
                token_ids,
                last.finish_reason,
                self._logprobs,
                last.error,
                last.embedding,
                last.error_param,
                first.cached_tokens,
            )
        self._token_ids = self._logprobs = self._last = None
        return merged


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

    ``model_path``: the directory the engine loaded, where an API process on
    its host reads the same tokenizer. ``task``: ``EngineConfig.task``; an
    embedding engine says ``embedding_dim`` (else 0), and its
    ``max_model_len`` is its longest input. ``kv_block_size``: tokens in one
    KV block (0 without a KV cache). ``sampling_defaults``: what the engine
    gives a request that leaves temperature, top_p or top_k unset. The last
    four are trailing and defaulted, so older frames decode.
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
    sampling_defaults: SamplingDefaults = SamplingDefaults()


class Heartbeat(msgspec.Struct, array_like=True, frozen=True):
    """Sent while the engine is idle, so silence always means trouble."""

    stats: EngineStats


class EngineDead(msgspec.Struct, array_like=True, frozen=True):
    """The engine is about to exit: a fatal error, or a ``tserve engine`` stopped."""

    reason: str


TOKENIZER_FILES: Final = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
# The folder of a model directory that holds its extra chat templates, one
# <name>.jinja file each.
CHAT_TEMPLATES_DIR: Final = "additional_chat_templates"


def tokenizer_file_allowed(name: str) -> bool:
    """Whether a :class:`TokenizerBundle` may hold ``name``; its receiver writes no other.

    Allowed: one of TOKENIZER_FILES (what ``tserve.nursery._tokenizer_files``
    reads), or a plain ``*.jinja`` name in CHAT_TEMPLATES_DIR (no folders, not
    hidden).
    """
    folder, _, file = name.partition("/")
    if folder != CHAT_TEMPLATES_DIR:
        return name in TOKENIZER_FILES
    plain = not {"/", "\\"} & set(file) and not file.startswith(".")
    return plain and file.endswith(".jinja")


class TokenizerBundle(msgspec.Struct, array_like=True, frozen=True):
    """The answer to ``Hello(tokenizer=True)``: the model directory's tokenizer files.

    Relative path -> contents, allowed names only (:func:`tokenizer_file_allowed`);
    a few MB.
    """

    files: dict[str, bytes]


Message: TypeAlias = (
    Hello
    | EngineInput
    | Shutdown
    | EngineReady
    | StepOutputs
    | Heartbeat
    | EngineDead
    | TokenizerBundle
)

_KIND_OF: Final[dict[type[Message], Kind]] = {
    Hello: Kind.HELLO,
    EngineInput: Kind.INPUT,
    Shutdown: Kind.SHUTDOWN,
    EngineReady: Kind.READY,
    StepOutputs: Kind.STEP,
    Heartbeat: Kind.HEARTBEAT,
    EngineDead: Kind.DEAD,
    TokenizerBundle: Kind.TOKENIZER,
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
