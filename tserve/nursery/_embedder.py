"""Embeddings through a second engine process: :class:`Embedder` and its inputs and results.

The embedding engine is an engine process like the generation one (``python
-m tserve.gpu`` with ``EngineConfig.task = "embed"``), with its own mux in
this process; everything else is shared design: one socket, batched frames,
per-request mailboxes, engine death as an error in every live request, and
the same reading of a final output (``_output.py``) and of a deadline
(``_deadline.py``). ``open_embedder`` and ``attach_embedder`` (``_open.py``)
make one.

One call of :meth:`Embedder.embed` is one engine request per input, all
submitted at once (so they travel in one frame and are embedded in the same
forward pass when they fit). Every way out of the call closes every mailbox
synchronously, which aborts in the engine whatever it has not answered yet:
a cancelled or timed-out call leaves nothing behind.
"""

from __future__ import annotations

import array
import dataclasses
import sys
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Final

import anyio

from tserve.mux import Mailbox, MuxClosedError
from tserve.nursery._client import ClientSettings, EngineClient
from tserve.nursery._deadline import Deadline
from tserve.nursery._errors import InvalidRequest, RequestFailed, RequestTimeout, ShuttingDown
from tserve.nursery._output import finish_error, mux_error
from tserve.nursery._session import EngineSession
from tserve.nursery._tokenizer import EncoderTokenizer
from tserve.protocol import AddRequest, EngineConfig, FinishReason, RequestOutput
from tserve.sampling import SamplingParams
from tserve.validity import embedding_problem

__all__ = [
    "Embedder",
    "EmbeddingInput",
    "EmbeddingResult",
    "embedding_config",
]

EmbeddingInput = str | Sequence[str] | Sequence[Sequence[int]]
"""A text, texts, or token ids per input (as the encoder's tokenizer makes them)."""

# The embedding engine's bounds of one forward pass: inputs, and tokens once
# padded to the longest input. 4096 is 16 inputs of MiniLM's full 256 tokens,
# or 64 of a typical sentence.
EMBED_MAX_NUM_SEQS: Final = 64
EMBED_MAX_NUM_BATCHED_TOKENS: Final = 4096
# Options an embedding engine takes over from the generation engine's.
_SHARED_OPTIONS: Final = ("threads", "device", "cpu_gemm", "heartbeat_interval")
_PARAMS: Final = SamplingParams(max_tokens=1)  # the engine ignores them
_TIMED_OUT: Final = "the embedding request passed its deadline"


@dataclasses.dataclass(frozen=True, slots=True)
class EmbeddingResult:
    """One vector per input, in input order.

    ``raw[i]`` is the unit-norm vector of input ``i`` as little-endian
    float32 bytes (exactly what OpenAI's ``encoding_format="base64"``
    carries); :meth:`vectors` gives them as Python floats.
    ``prompt_tokens`` counts the tokens of every input.
    """

    raw: list[bytes]
    prompt_tokens: int
    model: str

    def vectors(self) -> list[list[float]]:
        out = []
        for data in self.raw:
            values = array.array("f", data)
            if sys.byteorder == "big":
                values.byteswap()
            out.append(values.tolist())
        return out


def embedding_config(model: str, engine_options: Mapping[str, Any]) -> EngineConfig:
    """The embedding engine's config: ``threads``, ``device``, ``cpu_gemm`` and
    ``heartbeat_interval`` from the generation engine's options, batch bounds of its own."""
    shared = {k: engine_options[k] for k in _SHARED_OPTIONS if k in engine_options}
    return EngineConfig(
        model=model,
        task="embed",
        max_num_seqs=EMBED_MAX_NUM_SEQS,
        max_num_batched_tokens=EMBED_MAX_NUM_BATCHED_TOKENS,
        **shared,
    )


class Embedder(EngineClient):
    """Embed text with the embedding engine behind one mux. Create with :func:`open_embedder`.

    Admission: at most ``max_pending`` inputs run at once (each input is
    one engine request); a call that finds too few free waits for them, or
    raises :class:`Overloaded` (the ``overload`` mode, see ``_admission.py``),
    and one with more inputs than ``max_pending`` raises
    :class:`InvalidRequest`. Call it from the event loop thread that opened it.
    """

    _dead = "the embedding engine is dead"
    _closed = "the embedding model is closed"
    _noun = "embedding inputs"

    def __init__(
        self, session: EngineSession, settings: ClientSettings, tokens: EncoderTokenizer
    ) -> None:
        super().__init__(session, settings, id_prefix=f"emb-{uuid.uuid4().hex[:8]}")
        self._tokens = tokens
        self.tokenizer = tokens.tokenizer

    @property
    def live(self) -> int:
        """Inputs of calls in progress, running or waiting for a slot."""
        return self.admission.live

    @property
    def dimensions(self) -> int:
        return self.ready.embedding_dim

    @property
    def max_input_tokens(self) -> int:
        return self.ready.max_model_len

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, special tokens included, never truncated. Blocking."""
        return self._tokens.encode(texts)

    async def embed(self, inputs: EmbeddingInput) -> EmbeddingResult:
        """Embed every input; return the vectors in input order.

        A checkpoint. Raises at once (before any work) InvalidRequest for
        bad inputs (``param`` "input"), Overloaded (RAISE mode), ShuttingDown
        or EngineDeadError; otherwise waits, within the deadline, for a slot
        per input. Texts are tokenized in a worker thread; an input
        longer than :attr:`max_input_tokens` is refused (InvalidRequest),
        never truncated. ``request_timeout`` (if set) ends the call with
        RequestTimeout; for a shorter bound, cancel it (``anyio.fail_after``).
        Cancellation, a timeout or any error aborts in the engine what it
        has not answered.
        """
        items = _inputs(inputs)
        count = len(items)
        self._check_running()
        self._check_room(
            count,
            too_many=f"{count} inputs in one request; the server takes at most {self.max_pending}",
            param="input",
        )
        held = self.admission.enter(count)
        deadline = Deadline.after(self.request_timeout)
        try:
            with anyio.CancelScope(deadline=deadline.loop):
                if not held:
                    with self.before_engine():
                        await self.admission.wait(count)
                        held = True  # no checkpoint between the hand-off and this
                return await self._embed(items, deadline)
            raise RequestTimeout(f"{_TIMED_OUT} ({self.request_timeout:g} s)")
        finally:
            self.admission.leave(count, held=held)

    async def _embed(
        self, items: list[str] | list[list[int]], deadline: Deadline
    ) -> EmbeddingResult:
        if items and isinstance(items[0], str):
            with self.before_engine():
                ids = await self._tokens.tokenize([t for t in items if isinstance(t, str)])
        else:
            ids = [list(t) for t in items if not isinstance(t, str)]
        self._check(ids)
        mailboxes: list[Mailbox] = []
        try:
            try:
                for tokens in ids:
                    rid = self._next_request_id()
                    mailboxes.append(self._mux.open_mailbox(rid, 1))
                    self._mux.submit(AddRequest(rid, tokens, _PARAMS, deadline.engine))
                raw = [_vector(await mailbox.get(), deadline) for mailbox in mailboxes]
            except MuxClosedError as exc:
                raise mux_error(exc, "the embedding model was closed during the request") from None
        finally:
            for mailbox in mailboxes:
                mailbox.close()  # aborts in the engine what it has not answered
        return EmbeddingResult(raw, sum(len(t) for t in ids), self.model)

    def _check(self, ids: list[list[int]]) -> None:
        """Refuse what the engine would refuse, naming the input."""
        vocab = self.ready.vocab_size
        for i, tokens in enumerate(ids):
            problem = embedding_problem(
                tokens, vocab_size=vocab, max_len=self.max_input_tokens, label=f"input[{i}]"
            )
            if problem is not None:
                raise InvalidRequest(problem.message, param=problem.param)


def _inputs(inputs: EmbeddingInput) -> list[str] | list[list[int]]:
    """A list of texts or of token-id lists; raises InvalidRequest for anything else."""
    if isinstance(inputs, str):
        inputs = [inputs]
    items = list(inputs)
    if not items:
        raise InvalidRequest("input must not be empty", param="input")
    if all(isinstance(t, str) for t in items):
        texts = [t for t in items if isinstance(t, str)]
        empty = next((i for i, t in enumerate(texts) if not t), None)
        if empty is not None:
            raise InvalidRequest(f"input[{empty}] is an empty string", param="input")
        return texts
    lists: list[list[int]] = []
    for t in items:
        if isinstance(t, str) or not isinstance(t, Sequence):
            break
        ids = [x for x in t if type(x) is int]  # not bools
        if len(ids) != len(t):
            break
        lists.append(ids)
    else:
        return lists
    raise InvalidRequest(
        "input must be a string, a list of strings, or a list of token-id lists", param="input"
    )


def _vector(output: RequestOutput, deadline: Deadline) -> bytes:
    """The embedding of a final output, or the error it stands for (``_output.finish_error``;
    an ABORT without a deadline: the engine is stopping)."""
    if output.finish_reason is FinishReason.STOP and output.embedding is not None:
        return bytes(output.embedding)
    error = finish_error(
        output,
        has_deadline=deadline.is_set,
        failed="the engine failed this input",
        timed_out=_TIMED_OUT,
    )
    if error is not None:
        raise error
    if output.finish_reason is FinishReason.ABORT:
        raise ShuttingDown("the embedding engine is stopping")
    raise RequestFailed(f"unexpected output from the embedding engine: {output!r}")
