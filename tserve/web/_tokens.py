"""Token ids and text: ``/tokenize`` and ``/detokenize``, each on the request's model."""

from __future__ import annotations

import dataclasses

import trio
from quart import Response

from tserve.nursery import InvalidRequest
from tserve.validity import tokens_problem
from tserve.web._metrics import RequestRecord
from tserve.web._model_lookup import ModelLookup
from tserve.web._requests import parse_detokenize, parse_tokenize
from tserve.web._routing import json_response, read_body

__all__ = ["Tokenization"]


@dataclasses.dataclass(frozen=True, slots=True)
class Tokenization:
    """The handlers of ``POST /tokenize`` and ``POST /detokenize``."""

    models: ModelLookup  # the request's model, loaded if it has no engine

    async def tokenize(self, record: RequestRecord) -> Response:
        """A prompt or chat messages (through the chat template) as token ids."""
        req = parse_tokenize(await read_body())
        async with self.models.hold(req.model) as held:
            llm = held.model.llm
            if req.messages is not None:
                ids = await llm.tokenize_chat(req.messages)
            else:
                ids = await llm.tokenize(req.prompt or "")
            limit = llm.ready.max_model_len
        return json_response({"tokens": ids, "count": len(ids), "max_model_len": limit})

    async def detokenize(self, record: RequestRecord) -> Response:
        """Token ids as text (decoded off the event loop); 400 naming ``tokens`` for an
        id outside the vocabulary (the rule of :func:`tserve.validity.tokens_problem`)."""
        req = parse_detokenize(await read_body())
        async with self.models.hold(req.model) as held:
            llm = held.model.llm
            problem = tokens_problem(req.tokens, llm.ready.vocab_size, "tokens")
            if problem is not None:
                raise InvalidRequest(problem.message, param=problem.param)
            text = await trio.to_thread.run_sync(llm.decode, req.tokens)
        return json_response({"prompt": text})
