"""Request lifecycle and the embeddable anyio API (see DESIGN.md, "The request lifecycle").

Modules, each with one job (imports run down this list, never up)::

    _open_registry.py   open_models / open_registry: a registry for a block,
                        its preloads loaded first, every engine stopped on exit
    _registry.py        ModelRegistry: the served models, each one's engine owned
                        by one task; loads on demand, one per model at a time
    _keeper.py          Keeper: the residency rules applied to the registry's
                        slots (room in the budget, the keep-alive timer, RSS);
                        ModelsBusy, ModelFigures
    _model_slot.py      a served model's slot: spec, lifecycle, load, residency fields
    _residency.py       sans-IO: which models stay loaded (keep-alive, the
                        budget's least-recently-used rule); parse_keep_alive
    _memory.py          a process's RSS, the machine's memory, a model's weight bytes
    _model_state.py     sans-IO: a model's load states and their legal moves
    _open.py            open_llm / attach_llm / open_embedder / attach_embedder:
                        an engine, its session and a client, for a block;
                        EngineOwner: how this process starts the engines it owns
    _llm.py             LLM: generation requests, admission, LLMStats
    _embedder.py        Embedder: embedding calls, their inputs and EmbeddingResult
    _client.py          EngineClient (identity, liveness, ids, its admission)
                        and ClientSettings, shared by LLM and Embedder
    _constraint.py      ConstraintCheck: a request's grammar validated in a
                        grammar worker process, verdicts cached
    _tokenizer.py       tokenizer policy: inline vs worker thread, decoding,
                        the chat template, loading both models' tokenizers
    _model_tokenizer.py a model's tokenizer without torch or transformers:
                        text, ids and chats (ModelTokenizer); the encoder's pipeline
    _chat_template.py   chat templates rendered as transformers renders them, in
                        a jinja2 sandbox; ChatTemplateError
    _tokenizer_files.py what a model directory's tokenizer files say: special
                        tokens, templates, limits, generation defaults
    _request.py         RequestStream: the IO shell of one request (submit,
                        read, abort, close) over a RequestSeam
    _output.py          sans-IO: an engine output to a Delta or a decision
                        (stop, time out, fail, finished); mux failures
    _admission.py       Admission: slots, the FIFO queue of waiting units, the
                        overload modes (wait, raise) and the HTTP queue's bounds
    _deadline.py        a deadline on the loop's and the engine's clocks
    _detokenize.py      sans-IO: token ids to text deltas, stop strings
    _session.py         engine_session: the mux, the progress log, unwrapping
                        our task groups' exception groups
    _watch.py           process watchers: an engine's exit becomes engine death,
                        the embedding engine's death the generation engine's
    _engine_process.py  starting and stopping an engine process
    _results.py         what a caller gets: Delta, Usage, Completion
    _errors.py          the error types (LLMError and its subclasses)
"""

from tserve._curve import KeyFileError
from tserve.mux import EngineDeadError, RequestState
from tserve.nursery._client import ClientSettings
from tserve.nursery._embedder import Embedder, EmbeddingResult
from tserve.nursery._errors import (
    InvalidRequest,
    LLMError,
    Overloaded,
    RequestFailed,
    RequestTimeout,
    ShuttingDown,
)
from tserve.nursery._keeper import ModelFigures, ModelsBusy
from tserve.nursery._llm import LLM, LLMStats
from tserve.nursery._model_state import ModelState
from tserve.nursery._open import attach_embedder, attach_llm, open_embedder, open_llm
from tserve.nursery._open_registry import open_models
from tserve.nursery._registry import ModelLoadFailed, ModelNotServed, ModelRegistry
from tserve.nursery._request import RequestStream
from tserve.nursery._residency import parse_keep_alive
from tserve.nursery._results import Completion, Delta, Usage

__all__ = [
    "LLM",
    "ClientSettings",
    "Completion",
    "Delta",
    "Embedder",
    "EmbeddingResult",
    "EngineDeadError",
    "InvalidRequest",
    "KeyFileError",
    "LLMError",
    "LLMStats",
    "ModelFigures",
    "ModelLoadFailed",
    "ModelNotServed",
    "ModelRegistry",
    "ModelState",
    "ModelsBusy",
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
    "open_models",
    "parse_keep_alive",
]
