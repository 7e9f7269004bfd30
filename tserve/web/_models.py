"""The model names this server answers to: which a request may name, and ``/v1/models``."""

from __future__ import annotations

import time
from typing import Any

from quart import Response

from tserve.nursery import LLM
from tserve.web._errors import ModelNotFound
from tserve.web._metrics import RequestRecord
from tserve.web._routing import json_response

__all__ = ["ServedModels"]


class ServedModels:
    """The generation model under ``names`` (its own name when empty), and the embedding model."""

    def __init__(self, llm: LLM, names: tuple[str, ...]) -> None:
        self._llm = llm
        self.names = names or (llm.model,)
        self.created = int(time.time())

    def resolve(self, name: str | None) -> str:
        """The name a generation answers with: ``name``, or the first when none.
        Raises ModelNotFound (404) for a name this server does not serve."""
        if name is None:
            return self.names[0]
        if name not in self.names:
            raise ModelNotFound(f"The model '{name}' does not exist", param="model")
        return name

    async def models(self, record: RequestRecord) -> Response:
        """``GET /v1/models``: every generation name, then the embedding model if any."""
        limit = self._llm.ready.max_model_len
        data = [self._card(name, limit) for name in self.names]
        embedder = self._llm.embedder
        if embedder is not None:
            data.append(self._card(embedder.model, embedder.max_input_tokens))
        return json_response({"object": "list", "data": data})

    def _card(self, name: str, max_model_len: int) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "tserve",
            "max_model_len": max_model_len,
        }
