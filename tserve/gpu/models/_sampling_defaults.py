"""What a model recommends sampling with, read once when the engine loads it.

``EngineConfig.generation_config`` says where from (vLLM's
``--generation-config``):

* "auto": each of temperature, top_p and top_k from the first source that
  states it: the model directory's ``generation_config.json`` (for a GGUF
  file, the one beside it), then a GGUF file's ``general.sampling.temp``,
  ``general.sampling.top_p`` and ``general.sampling.top_k``, then, for the
  bundled default model, SmolLM2-135M-Instruct's model card (temperature
  0.2, top_p 0.9);
* "none": nothing; every request gets OpenAI's defaults;
* any other value: a directory whose ``generation_config.json`` alone gives
  them (an error at load if it has none).

Only the values tserve samples with are read. Others a source recommends
(``min_p``, ``repetition_penalty``, the GGUF's penalties) are named in the
log as not applied; ``do_sample`` is ignored, as vLLM ignores it. A value
out of range (the rule a request's value obeys, ``tserve.validity``) is
dropped with a log line. The engine applies the result to every request it
receives (``Sequence.sampling``) and reports it in ``EngineReady``, so an
API process, and an embedder of an engine on another host, learn it from
there. Blocking (a small file read).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np

from tserve._model_json import read_json_object
from tserve.gpu.models._directory import ModelLoadError
from tserve.sampling import SamplingDefaults, SamplingParams
from tserve.validity import params_problem

__all__ = ["DEFAULT_MODEL_CARD", "GGUF_SAMPLING_PREFIX", "read_sampling_defaults"]

log = logging.getLogger(__name__)

GENERATION_CONFIG: Final = "generation_config.json"
GGUF_SAMPLING_PREFIX: Final = "general.sampling."

DEFAULT_MODEL_CARD: Final = {"temperature": 0.2, "top_p": 0.9}
"""SmolLM2-135M-Instruct's recommendation (its model card's generation example)."""

# Our field -> its name in generation_config.json, and in GGUF metadata (after the prefix).
_FIELDS: Final = {
    "temperature": ("temperature", "temp"),
    "top_p": ("top_p", "top_p"),
    "top_k": ("top_k", "top_k"),
}
# What the sources may recommend that tserve has no sampler for.
_UNSUPPORTED: Final = ("min_p", "typical_p", "repetition_penalty")


def read_sampling_defaults(
    generation_config: str,
    *,
    model_dir: Path,
    gguf_metadata: Mapping[str, Any] | None = None,
    default_model: bool = False,
) -> SamplingDefaults:
    """The defaults ``generation_config`` ("auto", "none" or a directory) gives.

    ``model_dir`` holds the model's generation_config.json, if any;
    ``gguf_metadata`` is a GGUF file's ``general.sampling.*`` fields (full
    keys); ``default_model``: the model is the bundled default. Raises
    ModelLoadError for a directory without the file, or a file that is not
    a JSON object.
    """
    if generation_config == "none":
        return SamplingDefaults()
    if generation_config != "auto":
        directory = Path(generation_config).expanduser()
        if not (directory / GENERATION_CONFIG).is_file():
            raise ModelLoadError(f"--generation-config {generation_config}: no {GENERATION_CONFIG}")
        return _merge([(str(directory / GENERATION_CONFIG), _from_file(directory))])
    sources = [(str(model_dir / GENERATION_CONFIG), _from_file(model_dir))]
    if gguf_metadata:
        sources.append(("the GGUF file's general.sampling metadata", _from_gguf(gguf_metadata)))
    if default_model:
        sources.append(("SmolLM2-135M-Instruct's model card", dict(DEFAULT_MODEL_CARD)))
    return _merge(sources)


def _from_file(directory: Path) -> dict[str, Any]:
    config = read_json_object(directory / GENERATION_CONFIG, ModelLoadError)
    _name_unsupported(GENERATION_CONFIG, [k for k in _UNSUPPORTED if config.get(k) is not None])
    return {ours: config[theirs] for ours, (theirs, _) in _FIELDS.items() if theirs in config}


def _from_gguf(metadata: Mapping[str, Any]) -> dict[str, Any]:
    fields = {key.removeprefix(GGUF_SAMPLING_PREFIX): value for key, value in metadata.items()}
    # GGUF stores these as float32: 0.2 reads back as 0.20000000298..., so
    # take the shortest decimal that is the same float32.
    fields = {
        k: float(str(np.float32(v))) if isinstance(v, float) else v for k, v in fields.items()
    }
    read = {theirs for _, theirs in _FIELDS.values()} | {"sequence"}
    _name_unsupported("the GGUF file", sorted(set(fields) - read))
    return {ours: fields[theirs] for ours, (_, theirs) in _FIELDS.items() if theirs in fields}


def _name_unsupported(where: str, keys: list[str]) -> None:
    if keys:
        log.info("%s also states %s, which tserve does not apply", where, ", ".join(keys))


def _merge(sources: list[tuple[str, dict[str, Any]]]) -> SamplingDefaults:
    """Each field from the first source that states a valid value for it."""
    chosen: dict[str, Any] = {}
    used: list[str] = []
    for where, values in sources:
        took = False
        for field, value in values.items():
            if field in chosen or value is None:
                continue
            if _valid(field, value, where):
                chosen[field] = float(value) if field != "top_k" else int(value)
                took = True
        if took:
            used.append(where)
    return SamplingDefaults(**chosen, source=" and ".join(used))


def _valid(field: str, value: object, where: str) -> bool:
    """Whether ``value`` is one a request may give ``field`` (logged when not)."""
    problem = "not a number"
    if isinstance(value, int) and not isinstance(value, bool) and field == "top_k":
        problem = _problem(SamplingParams(top_k=value))
    elif isinstance(value, int | float) and not isinstance(value, bool) and field != "top_k":
        one = {
            "temperature": SamplingParams(temperature=value),
            "top_p": SamplingParams(top_p=value),
        }
        problem = _problem(one[field])
    if problem:
        log.warning("%s: %s %r is not applied: %s", where, field, value, problem)
    return not problem


def _problem(params: SamplingParams) -> str:
    problem = params_problem(params, vocab_size=1)
    return "" if problem is None else problem.message
