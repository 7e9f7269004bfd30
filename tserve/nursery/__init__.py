"""Request lifecycle and the embeddable anyio API (see DESIGN.md, "The request lifecycle")."""

from tserve.mux import EngineDeadError
from tserve.nursery._embed import Embedder, EmbeddingResult, attach_embedder, open_embedder
from tserve.nursery._errors import (
    InvalidRequest,
    LLMError,
    Overloaded,
    RequestFailed,
    RequestTimeout,
    ShuttingDown,
)
from tserve.nursery._llm import LLM, LLMStats, attach_llm, open_llm
from tserve.nursery._request import RequestStream
from tserve.nursery._results import Completion, Delta, Usage
from tserve.nursery._state import RequestState

__all__ = [
    "LLM",
    "Completion",
    "Delta",
    "Embedder",
    "EmbeddingResult",
    "EngineDeadError",
    "InvalidRequest",
    "LLMError",
    "LLMStats",
    "Overloaded",
    "RequestFailed",
    "RequestState",
    "RequestStream",
    "RequestTimeout",
    "ShuttingDown",
    "Usage",
    "attach_embedder",
    "attach_llm",
    "open_embedder",
    "open_llm",
]
