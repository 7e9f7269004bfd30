"""Token ids and text: ``/tokenize``, ``/detokenize``, and the text of one token for logprobs."""

from __future__ import annotations

import dataclasses

import trio
from quart import Response

from tserve.nursery import LLM, InvalidRequest
from tserve.validity import tokens_problem
from tserve.web._metrics import RequestRecord
from tserve.web._models import ServedModels
from tserve.web._requests import parse_detokenize, parse_tokenize
from tserve.web._routing import json_response, read_body

__all__ = ["TokenTexts", "Tokenization"]


class TokenTexts:
    """The text of one token id (a :data:`tserve.web._responses.TokenText`), cached.

    Bound: one entry per token id ever asked for, at most the vocabulary.
    Synchronous: a miss decodes on the calling thread (one token is cheap).
    """

    def __init__(self, llm: LLM) -> None:
        self._llm = llm
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._llm.decode([token_id])
        return text


@dataclasses.dataclass(frozen=True, slots=True)
class Tokenization:
    """The handlers of ``POST /tokenize`` and ``POST /detokenize``."""

    llm: LLM
    models: ServedModels  # the names a request may use

    async def tokenize(self, record: RequestRecord) -> Response:
        """A prompt or chat messages (through the chat template) as token ids."""
        req = parse_tokenize(await read_body())
        self.models.resolve(req.model)
        if req.messages is not None:
            ids = await self.llm.tokenize_chat(req.messages)
        else:
            ids = await self.llm.tokenize(req.prompt or "")
        limit = self.llm.ready.max_model_len
        return json_response({"tokens": ids, "count": len(ids), "max_model_len": limit})

    async def detokenize(self, record: RequestRecord) -> Response:
        """Token ids as text (decoded off the event loop); 400 naming ``tokens`` for an
        id outside the vocabulary (the rule of :func:`tserve.validity.tokens_problem`)."""
        req = parse_detokenize(await read_body())
        self.models.resolve(req.model)
        problem = tokens_problem(req.tokens, self.llm.ready.vocab_size, "tokens")
        if problem is not None:
            raise InvalidRequest(problem.message, param=problem.param)
        text = await trio.to_thread.run_sync(self.llm.decode, req.tokens)
        return json_response({"prompt": text})
