"""The served models as clients see them: ``/v1/models``, ``/v1/models/{id}``, and the
admin routes of llama.cpp's router mode (``GET /models``, ``POST /models/load``,
``POST /models/unload``).

A model's card carries its load state twice: ``state`` (``unloaded``,
``loading``, ``loaded``, ``unloading``, ``failed``), and llama.cpp's
``status.value``; ``max_model_len`` while it is loaded; ``reason`` when it
failed. With several models, each card also shows ``resident_bytes`` (what the
memory budget counts for it), ``keep_alive`` (seconds; negative: pinned) and
``expires_at`` (the Unix time its keep-alive unloads it if it stays idle; null
while it is held, pinned or not loaded). Listing rescans a models directory
(``--models-dir``) first.
"""

from __future__ import annotations

import time
from typing import Any

from quart import Response

from tserve.nursery._model_state import ModelState
from tserve.web._bodies import ModelAdminBody
from tserve.web._metrics import RequestRecord
from tserve.web._model_lookup import ModelLookup, ModelStatus
from tserve.web._requests import decode_body
from tserve.web._routing import json_response, read_body

__all__ = ["ModelRoutes"]


class ModelRoutes:
    """The model listing and admin handlers of one app."""

    def __init__(self, models: ModelLookup) -> None:
        self._models = models
        self.created = int(time.time())

    async def models(self, record: RequestRecord) -> Response:
        """``GET /v1/models`` (and ``GET /models``): every served model, then the
        embedding model while its engine runs."""
        return json_response({"object": "list", "data": self._cards()})

    async def model(self, record: RequestRecord, model_id: str) -> Response:
        """``GET /v1/models/{id}``: one card; 404 listing the names for another id."""
        for card in self._cards():
            if card["id"] == model_id:
                return json_response(card)
        raise self._models.not_found(model_id)

    async def load(self, record: RequestRecord) -> Response:
        """``POST /models/load``: load the model, if it has no engine; returns once it
        is loaded (a client that leaves does not cancel it). 503 if it fails."""
        name = decode_body(await read_body(), ModelAdminBody).model
        await self._models.load(name)
        return json_response({"success": True, "model": name})

    async def unload(self, record: RequestRecord) -> Response:
        """``POST /models/unload``: stop the model's engine once no request holds it;
        returns once it is gone."""
        name = decode_body(await read_body(), ModelAdminBody).model
        await self._models.unload(name)
        return json_response({"success": True, "model": name})

    def _cards(self) -> list[dict[str, Any]]:
        statuses = self._models.statuses(rescan=True)
        cards = [self._card(status) for status in statuses]
        for status in statuses:
            embedder = None if status.llm is None else status.llm.embedder
            if status.name == self._models.embedding_owner and embedder is not None:
                embedding = ModelStatus(embedder.model, ModelState.LOADED)
                cards.append(self._card(embedding, embedder.max_input_tokens))
        return cards

    def _card(self, status: ModelStatus, max_model_len: int | None = None) -> dict[str, Any]:
        card: dict[str, Any] = {
            "id": status.name,
            "object": "model",
            "created": self.created,
            "owned_by": "tserve",
            "state": status.state.value,
            "status": {"value": status.state.value},
        }
        if max_model_len is None and status.llm is not None:
            max_model_len = status.llm.ready.max_model_len
        if max_model_len is not None:
            card["max_model_len"] = max_model_len
        if status.reason is not None:
            card["reason"] = status.reason
        if status.resident_bytes is not None:  # several models
            card["resident_bytes"] = status.resident_bytes
            card["keep_alive"] = status.keep_alive
            card["expires_at"] = status.expires_at
        return card
