"""``POST /v1/completions`` and ``POST /v1/chat/completions``, as JSON or as SSE,
and the one path every chat-shaped API runs (:meth:`Generation.run_chat`).

All go the same way: parse; hold the request's model (:class:`ModelLookup`,
loading it if it has no engine); refuse at once what
admission would refuse (live requests, and the bytes streaming responses
hold for their clients: :class:`BufferBudget`), before any tokenizing; start ``n`` streams per
prompt; then either collect them into one JSON body or hand them to an
:class:`SSEBody`. The whole run is abortable by the drain (:class:`InFlight`).
What differs between APIs is only the parsing of the body (into a
:class:`ChatRequest`) and the :class:`Output` that shapes the answer.

With a reasoning syntax (``--reasoning-parser``), a chat's structured output
(``response_format``, a required or named tool) constrains only the answer
after the thinking (:meth:`ReasoningSyntax.grammar`), and each API's output
splits the thinking off with :meth:`ServedModel.reasoning_for`'s parser.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import msgspec
import trio
from quart import Response

from tserve.nursery import (
    LLM,
    EngineDeadError,
    InvalidRequest,
    RequestFailed,
    RequestStream,
    ShuttingDown,
)
from tserve.sampling import JsonSchema, SamplingParams
from tserve.validity import tokens_problem
from tserve.web._inflight import InFlight
from tserve.web._metrics import RequestRecord
from tserve.web._model_lookup import ModelHold, ModelLookup, ServedModel
from tserve.web._requests import ChatRequest, CompletionRequest, parse_chat, parse_completion
from tserve.web._responses import (
    CHAT,
    COMPLETION,
    ChatChoice,
    CompletionChoice,
    Envelope,
    total_usage,
)
from tserve.web._routing import json_response, read_body
from tserve.web._send_buffer import BufferBudget
from tserve.web._sse import SSEEvents
from tserve.web._streaming import (
    Output,
    SSEBody,
    StreamEvents,
    closed_on_error,
    collect,
    first_deltas,
)
from tserve.web._structured import rename_constraint_error
from tserve.web._tool_formats import detect_format
from tserve.web._tools import ToolPlan

__all__ = ["Generation", "OutputFactory"]

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

OutputFactory = Callable[[str, ToolPlan | None, int, ServedModel], Output]
"""An API's output for (the served model's name, the tool plan, the number of
streams, the model: its reasoning syntax, its token texts)."""


@dataclasses.dataclass(frozen=True, slots=True)
class OpenAIOutput:
    """Completions and chat completions: choices in an :class:`Envelope`, OpenAI's SSE."""

    envelope: Envelope
    choices: Sequence[CompletionChoice | ChatChoice]
    n: int
    include_usage: bool

    def response(self) -> Any:
        return self.envelope.response(self.choices, total_usage(self.choices, self.n))

    def events(self, streams: Sequence[RequestStream], request_id: str) -> StreamEvents:
        return SSEEvents(
            self.choices,
            chunk=partial(self.envelope.chunk, include_usage=self.include_usage),
            usage_chunk=self.envelope.usage_chunk if self.include_usage else None,
            n=self.n,
            request_id=request_id,
        )


class Generation:
    """The two OpenAI generation handlers of one app, and the chat path other APIs share."""

    def __init__(self, models: ModelLookup, in_flight: InFlight, buffers: BufferBudget) -> None:
        self._buffers = buffers
        self._models = models
        self._in_flight = in_flight
        # Each live SSE body's release of its model hold, called when it closes.
        # Weak keys: a body quart drops unentered leaves by itself (its hold is
        # released by the finalizer of ModelHold.keep_until_closed).
        self._releases: weakref.WeakKeyDictionary[SSEBody, Callable[[], None]] = (
            weakref.WeakKeyDictionary()
        )

    async def completions(self, record: RequestRecord) -> Response:
        req = parse_completion(await read_body())
        self._models.resolve(req.model)  # 404 before anything waits

        async def run() -> Response:
            async with self._models.hold(req.model, keep_alive=req.keep_alive) as held:
                record.model_name = held.name
                self._precheck(held.model.llm, len(req.prompts) * req.n)
                return await self._completions(record, req, held)

        return await self._named(req.constraint_field, self._in_flight.abortable(run))

    async def chat_completions(self, record: RequestRecord) -> Response:
        req = parse_chat(await read_body())
        return await self.run_chat(record, req, partial(self._openai_chat, req))

    async def run_chat(
        self, record: RequestRecord, req: ChatRequest, output: OutputFactory
    ) -> Response:
        """Run a validated chat request to its response, shaped by ``output``. A checkpoint.

        The whole shared path: the model held (loaded if need be), admission
        precheck, tool plan, streams, collect or SSE, abort by the drain
        (the wait for a load too), constraint errors named.
        """
        self._models.resolve(req.model)  # 404 before anything waits

        async def run() -> Response:
            async with self._models.hold(req.model, keep_alive=req.keep_alive) as held:
                record.model_name = held.name
                self._precheck(held.model.llm, req.n)
                plan = self._tool_plan(held.model.llm, req)
                field = _field(req, plan)
                try:
                    return await self._named(field, self._chat(record, req, held, plan, output))
                except InvalidRequest as exc:
                    if plan is None or field != plan.request.field or exc.param != field:
                        raise
                    param = await self._tool_field(held.model.llm, plan, field)
                    raise InvalidRequest(str(exc), param=param) from None

        return await self._in_flight.abortable(run)

    async def _tool_field(self, llm: LLM, plan: ToolPlan, field: str) -> str:
        """``tools[i].function.parameters`` of the first enforced tool whose own
        parameters cannot be honoured, else ``field``. A checkpoint (each check's
        verdict is cached)."""
        choice = plan.request.choice
        for i, (name, parameters) in enumerate(plan.request.parameters.items()):
            if choice not in ("required", name):
                continue
            try:
                await llm.constraints.check(JsonSchema(parameters))
            except InvalidRequest:
                return f"tools[{i}].function.parameters"
        return field

    def resolve_model(self, name: str | None) -> str:
        """The served model's name for the request's ``model`` (404 if it is not served)."""
        return self._models.resolve(name)

    async def count_chat_tokens(self, req: ChatRequest) -> int:
        """The prompt length, in tokens, that :meth:`run_chat` would send for ``req``
        (its model held, loaded if need be)."""
        async with self._models.hold(req.model, keep_alive=req.keep_alive) as held:
            llm = held.model.llm
            messages, tools, _ = self._chat_prompt(held.model, req, self._tool_plan(llm, req))
            return len(await llm.tokenize_chat(messages, tools, req.template_kwargs))

    @staticmethod
    def _openai_chat(
        req: ChatRequest, model: str, plan: ToolPlan | None, count: int, served: ServedModel
    ) -> OpenAIOutput:
        logprobs = req.logprobs is not None
        keep = not req.stream  # a streamed choice keeps nothing it has sent
        reasoning = served.reasoning_for(req.template_kwargs)
        texts = served.token_texts
        choices = [
            ChatChoice(i, texts, logprobs=logprobs, keep=keep, tools=plan, reasoning=reasoning)
            for i in range(count)
        ]
        envelope = Envelope(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model, CHAT)
        return OpenAIOutput(envelope, choices, req.n, req.include_usage)

    @staticmethod
    async def _named(field: str | None, response: Awaitable[Response]) -> Response:
        """``response``, a problem the nursery found with the constraint named by ``field``."""
        try:
            return await response
        except (InvalidRequest, RequestFailed) as exc:
            raise rename_constraint_error(exc, field) from None

    @staticmethod
    def _tool_plan(llm: LLM, req: ChatRequest) -> ToolPlan | None:
        """The request's tools for this model's template (its format read from its source)."""
        if req.tools is None:
            return None
        template = llm.tokenizer.chat_template(tools=True)
        return ToolPlan(req.tools, detect_format(template.source, reads_tools=template.reads_tools))

    def _precheck(self, llm: LLM, count: int) -> None:
        """Refuse at once what admission would refuse, before any tokenizing."""
        if not llm.engine_alive:
            raise EngineDeadError("the engine is not running")
        if self._in_flight.aborting is not None:
            raise ShuttingDown("the server is shutting down")
        llm.check_admission(count)
        self._buffers.check()

    async def _completions(
        self, record: RequestRecord, req: CompletionRequest, held: ModelHold
    ) -> Response:
        llm = held.model.llm
        streams = await self._start_completion(llm, req)
        prefixes = await self._echo_prefixes(llm, req)
        logprobs = req.logprobs is not None
        choices = [
            CompletionChoice(
                i,
                held.model.token_texts,
                logprobs=logprobs,
                prefix=prefixes[i // req.n],
                keep=not req.stream,  # a streamed choice keeps nothing it has sent
            )
            for i in range(len(streams))
        ]
        envelope = Envelope(f"cmpl-{uuid.uuid4().hex}", int(time.time()), held.name, COMPLETION)
        output = OpenAIOutput(envelope, choices, req.n, req.include_usage)
        return await self._respond(record, req, streams, output, req.constraint_field, held)

    async def _chat(
        self,
        record: RequestRecord,
        req: ChatRequest,
        held: ModelHold,
        plan: ToolPlan | None,
        output: OutputFactory,
    ) -> Response:
        streams = await self._start_chat(held.model, req, plan)
        output_ = output(held.name, plan, len(streams), held.model)
        return await self._respond(record, req, streams, output_, _field(req, plan), held)

    @staticmethod
    async def _start_completion(llm: LLM, req: CompletionRequest) -> list[RequestStream]:
        """Admit ``n`` streams per prompt; a prompt used ``n > 1`` times is tokenized once."""
        streams: list[RequestStream] = []
        with closed_on_error(streams):
            for prompt in req.prompts:
                source: str | list[int] = prompt
                if req.n > 1 and isinstance(prompt, str):
                    source = await llm.tokenize(prompt)
                streams.extend(llm.generate(source, req.params) for _ in range(req.n))
        return streams

    @staticmethod
    def _chat_prompt(
        served: ServedModel, req: ChatRequest, plan: ToolPlan | None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, SamplingParams]:
        """The messages and tools the template renders, and the params (a tool grammar
        added; a constraint put after the thinking)."""
        messages, tools, params = req.messages, None, req.params
        if plan is not None:
            messages, tools = plan.messages(messages), plan.template_tools()
            grammar = plan.grammar()
            if grammar is not None:
                params = msgspec.structs.replace(params, constraint=grammar)
        reasoning = served.reasoning_for(req.template_kwargs)
        if reasoning is not None and params.constraint is not None:
            constraint = reasoning.grammar(params.constraint)
            params = msgspec.structs.replace(params, constraint=constraint)
        return messages, tools, params

    async def _start_chat(
        self, served: ServedModel, req: ChatRequest, plan: ToolPlan | None
    ) -> list[RequestStream]:
        """Admit ``n`` streams. Without max_tokens (or past it, with ``max_tokens_fits``),
        the rest of the context is the limit."""
        llm = served.llm
        messages, tools, params = self._chat_prompt(served, req, plan)
        if req.max_tokens is not None and req.n == 1 and not req.max_tokens_fits:
            return [llm.chat(messages, params, tools=tools, template_kwargs=req.template_kwargs)]
        ids = await llm.tokenize_chat(messages, tools, req.template_kwargs)
        room = max(1, llm.ready.max_model_len - len(ids))
        if req.max_tokens is None or (req.max_tokens_fits and req.max_tokens > room):
            params = msgspec.structs.replace(params, max_tokens=room)
        streams: list[RequestStream] = []
        with closed_on_error(streams):
            streams.extend(llm.generate(ids, params) for _ in range(req.n))
        return streams

    @staticmethod
    async def _echo_prefixes(llm: LLM, req: CompletionRequest) -> list[str]:
        if not req.echo:
            return [""] * len(req.prompts)
        out = []
        for prompt in req.prompts:
            if isinstance(prompt, str):
                out.append(prompt)
                continue
            # Checked before decoding: an id past the vocabulary is a 400, not a decoder error.
            problem = tokens_problem(prompt, llm.ready.vocab_size, "prompt")
            if problem is not None:
                raise InvalidRequest(problem.message, param=problem.param)
            out.append(await trio.to_thread.run_sync(llm.decode, prompt))
        return out

    async def _respond(
        self,
        record: RequestRecord,
        req: CompletionRequest | ChatRequest,
        streams: list[RequestStream],
        output: Output,
        field: str | None,
        held: ModelHold,
    ) -> Response:
        """Collect ``streams`` into one JSON body, or stream them as SSE; ``field``
        names a constraint error in the stream's error event. An SSE body holds
        the model until it is closed."""
        record.choices_per_prompt = req.n
        if not req.stream:
            await collect(streams, output.choices, record)
            return json_response(output.response())
        firsts = await first_deltas(streams)
        body = SSEBody(
            streams,
            firsts,
            output.events(streams, record.request_id),
            record=record,
            budget=self._buffers,
            on_close=self._body_closed,
            name_error=partial(rename_constraint_error, field=field),
        )
        self._releases[body] = held.keep_until_closed(body)
        self._in_flight.add_body(body)
        record.streaming = True
        return Response(body, content_type="text/event-stream", headers=dict(_SSE_HEADERS))

    def _body_closed(self, body: SSEBody) -> None:
        """An SSE body's ``on_close``: it is no longer in flight, nor holds its model."""
        self._in_flight.body_closed(body)
        release = self._releases.pop(body, None)
        if release is not None:
            release()


def _field(req: ChatRequest, plan: ToolPlan | None) -> str | None:
    """The field a chat request's constraint came from: its own, or its tools'."""
    return req.constraint_field or (plan.request.field if plan is not None else None)
