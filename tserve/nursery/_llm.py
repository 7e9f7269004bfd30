"""The embeddable LLM: generation requests through one engine, with admission control.

:class:`LLM` admits requests (at most ``max_pending`` running; the rest wait
or are refused by its ``overload`` mode, see ``_admission.py``), builds each
one's :class:`~tserve.nursery.RequestStream`, and serves the tokenizer and
the embeddings of the engines ``open_llm`` started (``_open.py``).

The engine is not restarted when it dies (see :func:`tserve.open_llm` for
why): every live request fails with EngineDeadError, new requests are
refused with it, and the caller decides (the HTTP server exits non-zero so
that its supervisor restarts it whole).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from tserve.nursery._client import ClientSettings, EngineClient
from tserve.nursery._constraint import ConstraintCheck
from tserve.nursery._embedder import Embedder, EmbeddingInput, EmbeddingResult
from tserve.nursery._errors import InvalidRequest, ShuttingDown
from tserve.nursery._request import Prompt, RequestSeam, RequestStream, loop_caller
from tserve.nursery._results import Completion
from tserve.nursery._session import EngineSession
from tserve.nursery._tokenizer import ChatTokenizer, Message, TemplateKwargs, Tools
from tserve.protocol import EngineStats, TokenLogprob
from tserve.sampling import SamplingDefaults, SamplingParams
from tserve.validity import generation_problem

__all__ = ["LLM", "LLMStats"]


@dataclasses.dataclass(frozen=True, slots=True)
class LLMStats:
    """Live numbers for /metrics. ``engine`` is the engine's latest report."""

    live_requests: int  # admitted and not closed: running or waiting
    aborts_sent: int
    engine: EngineStats
    engine_alive: bool
    queued_requests: int = 0  # admitted, waiting for a slot
    queued_tokens: int = 0  # prompt tokens of the requests waiting for a slot


class LLM(EngineClient):
    """Generate text with the engine behind one mux. Create with :func:`open_llm`.

    Admission: at most ``max_pending`` requests run (hold a slot) at once.
    With ``overload="wait"`` (the default) one more waits for a slot, in
    arrival order, holding only its own task; with ``overload="raise"`` it
    waits only while the queue has room (``max_queued`` requests,
    ``max_queued_tokens`` prompt tokens) and otherwise raises
    :class:`Overloaded` at once. Every method is meant to be called from the event loop
    thread that entered ``open_llm``, except the blocking tokenizer helpers
    (:meth:`encode`, :meth:`decode`, :meth:`apply_chat_template`), which
    are for worker threads.
    """

    _dead = "the engine is dead"
    _closed = "the LLM is closed"

    def __init__(
        self, session: EngineSession, settings: ClientSettings, tokens: ChatTokenizer
    ) -> None:
        super().__init__(session, settings, id_prefix=uuid.uuid4().hex[:8])
        self._tokens = tokens
        self.tokenizer = tokens.tokenizer
        self.draining = False
        # What every RequestStream of this LLM uses of it; the admission's
        # leave() runs once per admitted stream, by its close().
        self.constraints = ConstraintCheck(
            tokens.tokenizer.tokenizer.to_str, lambda: self.ready.vocab_size
        )
        self._seam = RequestSeam(
            self._mux,
            tokens.decode,
            self._check_prompt,
            self.constraints.check,
            self.admission,
            loop_caller(),
            self.before_engine,
        )
        # The embedding model's engine, when open_llm was given one.
        self.embedder: Embedder | None = None

    # -- state -------------------------------------------------------------------

    @property
    def engine_alive(self) -> bool:
        """False once an engine (generation, or embedding if loaded) is known to be
        dead, or the LLM closed; never True again."""
        alive = super().engine_alive
        return alive and (self.embedder is None or self.embedder.engine_alive)

    @property
    def engine_dead_reason(self) -> str | None:
        if self._mux.dead_reason is None and self.embedder is not None:
            reason = self.embedder.engine_dead_reason
            return None if reason is None else f"embedding engine: {reason}"
        return self._mux.dead_reason

    async def wait_engine_dead(self) -> str:
        """Wait until the engine is dead (or the LLM closed); return the reason.

        A checkpoint; cancellable.
        """
        await self._mux_done.wait()
        return self._mux.dead_reason or "the LLM was closed"

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        """What the engine gives a request that leaves temperature, top_p or top_k
        unset: its model's recommendation (``EngineConfig.generation_config``),
        empty for OpenAI's. ``resolve(params)`` says what a request samples with."""
        return self.ready.sampling_defaults

    @property
    def stats(self) -> LLMStats:
        return LLMStats(
            live_requests=self.admission.live,
            queued_requests=self.admission.queued,
            queued_tokens=self.admission.queued_tokens,
            aborts_sent=self._mux.stats.aborts_sent,
            engine=self._mux.engine_stats,
            engine_alive=self.engine_alive,
        )

    # -- requests ----------------------------------------------------------------

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> RequestStream:
        """Start a request; iterate the result for its deltas.

        Synchronous and immediate: raises Overloaded (``overload="raise"``
        and the queue full), ShuttingDown or EngineDeadError before anything
        is queued. ``prompt`` is text (tokenized on the first ``__anext__``,
        see :meth:`tokenize`) or token ids. Without a free slot, the first
        ``__anext__`` waits for one after tokenizing (cancellably; RAISE mode
        may refuse there with Overloaded when the queued prompt tokens are
        over budget). ``timeout`` (seconds, default ``request_timeout``),
        counted from this call and the wait included, ends the request with
        RequestTimeout and aborts it in the engine. Close the stream (``async
        with``, ``aclose``, or reading it to the end) to free its admission
        slot or place in the queue; a stream dropped unfinished is closed
        soon after.
        """
        if isinstance(prompt, str):
            text = prompt
            return self._admit(lambda: self.tokenize(text), params, request_id, timeout)
        return self._admit(list(prompt), params, request_id, timeout)

    def chat(
        self,
        messages: Sequence[Message],
        params: SamplingParams | None = None,
        *,
        tools: Tools = None,
        template_kwargs: TemplateKwargs = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> RequestStream:
        """Like :meth:`generate` with the model's chat template applied to ``messages``
        (``tools``: the template's ``tools`` variable, OpenAI's tool objects;
        ``template_kwargs``: more of its variables, such as ``enable_thinking``).

        Raises InvalidRequest at once when ``messages`` is not a list of
        mappings; the template runs as :meth:`tokenize_chat` says.
        """
        if isinstance(messages, str | bytes) or not all(isinstance(m, Mapping) for m in messages):
            raise InvalidRequest("messages must be a list of objects", param="messages")
        chat = [dict(m) for m in messages]
        return self._admit(
            lambda: self.tokenize_chat(chat, tools, template_kwargs), params, request_id, timeout
        )

    async def complete(
        self, prompt: Prompt, params: SamplingParams | None = None, **kwargs: Any
    ) -> Completion:
        """The whole result of :meth:`generate` at once."""
        return await _collect(self.generate(prompt, params, **kwargs))

    async def complete_chat(
        self, messages: Sequence[Message], params: SamplingParams | None = None, **kwargs: Any
    ) -> Completion:
        """The whole result of :meth:`chat` at once."""
        return await _collect(self.chat(messages, params, **kwargs))

    async def embed(self, inputs: EmbeddingInput) -> EmbeddingResult:
        """Embed ``inputs`` with the embedding model (see :meth:`Embedder.embed`).

        Raises InvalidRequest (``param`` "model") when ``open_llm`` was not
        given an ``embedding_model``, ShuttingDown while draining.
        """
        if self.embedder is None:
            raise InvalidRequest(
                "no embedding model is loaded (open_llm(embedding_model=...))", param="model"
            )
        if self.draining:
            raise ShuttingDown("the server is shutting down")
        return await self.embedder.embed(inputs)

    # -- the tokenizer (see _tokenizer.py) ------------------------------------------

    async def tokenize(self, text: str) -> list[int]:
        """Token ids of the text prompt ``text``, a BOS first where the model asks
        for one: on the event loop below ``INLINE_TOKENIZE_CHARS``, else in a
        worker thread (at most 4 at once; the rest wait for one).

        Not a checkpoint when short. In a thread it is not cancellable: a
        cancel takes effect once the thread returns (a few ms at most).
        """
        return await self._tokens.tokenize(text)

    async def tokenize_chat(
        self, messages: list[Message], tools: Tools = None, template_kwargs: TemplateKwargs = None
    ) -> list[int]:
        """Prompt ids for a chat (:meth:`apply_chat_template`), inline or in a
        thread by its messages' length, like :meth:`tokenize`."""
        return await self._tokens.tokenize_chat(messages, tools, template_kwargs)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as a prompt (the model's BOS first where it adds one,
        as :meth:`generate` tokenizes it). Blocking (tokenizer work): :meth:`tokenize`
        decides where."""
        return self._tokens.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids``, special tokens skipped. Fast (microseconds) for a few ids."""
        return self._tokens.decode(token_ids)

    def apply_chat_template(
        self, messages: list[Message], tools: Tools = None, template_kwargs: TemplateKwargs = None
    ) -> list[int]:
        """Prompt ids for a chat. Blocking; raises InvalidRequest for bad messages."""
        return self._tokens.apply_chat_template(messages, tools, template_kwargs)

    # -- admission -----------------------------------------------------------------

    def check_admission(self, count: int) -> None:
        """Raise what admitting ``count`` more requests now would raise. Not a checkpoint.

        EngineDeadError, ShuttingDown (closed or draining), InvalidRequest
        (``param`` "n") when ``count`` exceeds ``max_pending`` itself,
        Overloaded when ``overload="raise"`` and neither ``count`` slots
        nor room in the queue are free (never with ``overload="wait"``).
        """
        self._check_running()
        if self.draining:
            raise ShuttingDown("the server is shutting down")
        self._check_room(
            count,
            too_many=f"this request needs {count} generations; at most {self.max_pending} "
            "are admitted at once",
            param="n",
        )

    def _admit(
        self,
        prompt: Callable[[], Awaitable[list[int]]] | list[int],
        params: SamplingParams | None,
        request_id: str | None,
        timeout: float | None,
    ) -> RequestStream:
        self.check_admission(1)
        timeout = self.request_timeout if timeout is None else timeout
        rid = request_id or self._next_request_id()
        params = params or SamplingParams()
        held = self.admission.enter(1)  # after every check that can raise
        return RequestStream(self._seam, rid, prompt, params, timeout, holds_slot=held)

    def _check_prompt(self, prompt: list[int], params: SamplingParams) -> None:
        """Reject what the engine would reject, with the field it concerns."""
        problem = generation_problem(
            prompt,
            params,
            vocab_size=self.ready.vocab_size,
            max_model_len=self.ready.max_model_len,
        )
        if problem is not None:
            raise InvalidRequest(problem.message, param=problem.param)


async def _collect(stream: RequestStream) -> Completion:
    """Read ``stream`` to its end (closing it on every way out) into one Completion."""
    text: list[str] = []
    ids: list[int] = []
    logprobs: list[TokenLogprob] = []
    finish, usage = None, None
    async with stream:
        async for delta in stream:
            text.append(delta.text)
            ids.extend(delta.token_ids)
            if delta.logprobs is not None:
                logprobs.extend(delta.logprobs)
            finish, usage = delta.finish_reason, delta.usage
    assert finish is not None and usage is not None, "a stream always ends with a finish"
    return Completion(
        "".join(text),
        ids,
        finish,
        usage,
        logprobs if logprobs else None,
        stream.prompt_token_ids,
    )
