"""``POST /v1/embeddings``: one engine request per input, all in one batch when they fit.

The embedding engine belongs to one served model's engine pair
(:attr:`ModelLookup.embedding_owner`): a request holds that model, loading
it if it has no engine, and names the embedding model itself (or nothing).
"""

from __future__ import annotations

import dataclasses

from quart import Response

from tserve.nursery import InvalidRequest
from tserve.web._errors import ModelNotFound, NotFound
from tserve.web._inflight import InFlight
from tserve.web._metrics import RequestRecord
from tserve.web._model_lookup import ModelLookup
from tserve.web._requests import parse_embeddings
from tserve.web._responses import embedding_response
from tserve.web._routing import json_response, read_body

__all__ = ["Embeddings"]

_NONE = "This server has no embedding model (see --embedding-model)"


@dataclasses.dataclass(frozen=True, slots=True)
class Embeddings:
    """The embeddings handler; 404 when no served model has an embedding model."""

    models: ModelLookup
    in_flight: InFlight  # an embedding request is abortable by the drain too

    async def embeddings(self, record: RequestRecord) -> Response:
        req = parse_embeddings(await read_body())
        owner = self.models.embedding_owner
        if owner is None:
            raise NotFound(_NONE)

        async def work() -> Response:
            async with self.models.hold(owner, keep_alive=req.keep_alive) as held:
                embedder = held.model.llm.embedder
                if embedder is None:
                    raise NotFound(_NONE)
                model = embedder.model
                if req.model is not None and req.model != model:
                    raise ModelNotFound(
                        f"The model '{req.model}' does not exist or does not embed; this "
                        f"server embeds with '{model}'",
                        param="model",
                    )
                if req.dimensions is not None and req.dimensions != embedder.dimensions:
                    raise InvalidRequest(
                        f"'dimensions' must be {embedder.dimensions} for {model}: its vectors "
                        "cannot be shortened",
                        param="dimensions",
                    )
                result = await held.model.llm.embed(req.inputs)
            record.embedded(len(req.inputs), result.prompt_tokens)
            return json_response(embedding_response(model, result, req.encoding_format))

        return await self.in_flight.abortable(work)
