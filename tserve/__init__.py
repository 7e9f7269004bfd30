"""tserve: an OpenAI-compatible LLM inference server on structured concurrency.

The embeddable API is imported lazily, so that the engine process, which
imports ``tserve.protocol`` and ``tserve.gpu``, never loads anyio, trio or
the mux.

Packages (imports run ``web → nursery → mux → protocol ← gpu``):
``web`` (the HTTP server), ``nursery`` (the request lifecycle and the
embeddable API), ``mux`` (the one socket to the engine), ``gpu`` (the engine
process), ``bench`` (``python -m tserve bench``). Modules beside them:
``__main__`` (the commands: serve, engine, keys, bench), ``_serve`` (serving
once the options are parsed), ``_models_dir`` (the models of ``--models-dir``),
``_options`` (their options and environment defaults), ``protocol`` (the wire), ``engine_config``
(how to start an engine), ``sampling`` (how a request samples: its
parameters, constraints and the model's defaults), ``validity`` (the one
rule for a valid request), ``grammar`` (structured-output constraints as
llguidance grammars), ``_grammar_worker`` (the process an API process
checks them in), ``_host`` (fd limit, pid probe, log format), ``_gc`` (the cyclic GC's
settings while serving), ``_model_json`` (a model
directory's JSON files, as both processes read them), ``_curve`` (the CURVE
key files of an engine on the network), ``_metrics_dir`` (the API processes'
shared metrics directory), ``_errors`` (:class:`LLMError`, the root of every
error type).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tserve.protocol import EngineConfig, FinishReason
from tserve.sampling import Choice, JsonSchema, LarkGrammar, Regex, SamplingDefaults, SamplingParams

if TYPE_CHECKING:
    from tserve.nursery import (
        LLM,
        Completion,
        Delta,
        EngineDeadError,
        InvalidRequest,
        KeyFileError,
        LLMError,
        LLMStats,
        ModelLoadFailed,
        ModelNotServed,
        ModelRegistry,
        ModelsBusy,
        ModelState,
        Overloaded,
        RequestFailed,
        RequestTimeout,
        ShuttingDown,
        Usage,
        open_llm,
        open_models,
    )

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "Choice",
    "Completion",
    "Delta",
    "EngineConfig",
    "EngineDeadError",
    "FinishReason",
    "InvalidRequest",
    "JsonSchema",
    "KeyFileError",
    "LLMError",
    "LLMStats",
    "LarkGrammar",
    "ModelLoadFailed",
    "ModelNotServed",
    "ModelRegistry",
    "ModelState",
    "ModelsBusy",
    "Overloaded",
    "Regex",
    "RequestFailed",
    "RequestTimeout",
    "SamplingDefaults",
    "SamplingParams",
    "ShuttingDown",
    "Usage",
    "__version__",
    "open_llm",
    "open_models",
]


def __getattr__(name: str) -> Any:
    # Called only for a name not bound above: an exported one is then the embeddable
    # API, imported from tserve.nursery on first use.
    if name in __all__:
        return getattr(importlib.import_module("tserve.nursery"), name)
    raise AttributeError(f"module 'tserve' has no attribute {name!r}")
