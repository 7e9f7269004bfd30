"""How a request samples: :class:`SamplingParams`, its output constraints, a model's defaults.

:class:`SamplingParams` travels in every ``AddRequest``; a :data:`Constraint`
(:class:`JsonSchema`, :class:`Regex`, :class:`Choice`, :class:`LarkGrammar`)
is what its output must match; :class:`SamplingDefaults` is what the engine
gives a request that leaves temperature, top_p or top_k unset, reported in
``EngineReady``; :class:`Sampling` is the values a request ends up with. A leaf
beside :mod:`tserve.protocol` (which re-exports it): it imports only the
standard library and msgspec.
"""

from __future__ import annotations

from typing import Any, Final, NamedTuple, TypeAlias, TypeVar

import msgspec

__all__ = [
    "OPENAI_SAMPLING",
    "Choice",
    "Constraint",
    "JsonSchema",
    "LarkGrammar",
    "Regex",
    "Sampling",
    "SamplingDefaults",
    "SamplingParams",
]


class JsonSchema(msgspec.Struct, tag=1, array_like=True, frozen=True):
    """Output is one JSON value matching ``schema`` (a JSON Schema as a dict);
    ``schema`` None = any JSON object (OpenAI's ``json_object``)."""

    schema: dict[str, Any] | None = None


class Regex(msgspec.Struct, tag=2, array_like=True, frozen=True):
    """Output matches ``pattern`` in full (the grammar engine's regex dialect)."""

    pattern: str


class Choice(msgspec.Struct, tag=3, array_like=True, frozen=True):
    """Output is exactly one of ``choices``."""

    choices: tuple[str, ...]


class LarkGrammar(msgspec.Struct, tag=4, array_like=True, frozen=True):
    """Output is a sentence of ``grammar``, a Lark grammar in llguidance's dialect
    (``start`` is the start rule; ``%json {...}`` embeds a JSON Schema)."""

    grammar: str


Constraint: TypeAlias = JsonSchema | Regex | Choice | LarkGrammar
"""What a request's output must match (structured outputs, tool calls).
Tagged on the wire by its first element."""


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """How to pick each next token of one request.

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` disable
    those filters. ``temperature``, ``top_p`` and ``top_k`` None (unset) take
    the model's recommended value (the engine's :class:`SamplingDefaults`,
    which it applies to every request it receives), else OpenAI's: 1.0, 1.0
    and no top-k. ``seed`` makes sampling reproducible for this request
    whatever else is in the batch. ``logprobs`` is the number of top
    alternatives to report per token (0 = only the chosen token's logprob,
    None = no logprobs). EOS ends the request unless ``ignore_eos``.
    ``stop`` strings are matched on text by the API process, which strips
    them before sending; the engine never sees text.
    ``logit_bias``: (token id, bias in [-100, 100]) pairs added to the raw
    logits before sampling; +100 forces a token, -100 bans it.
    ``constraint``: the output must match it; the engine masks the logits of
    tokens the grammar forbids (after penalties and ``logit_bias``).
    """

    max_tokens: int = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    constraint: Constraint | None = None


class Sampling(NamedTuple):
    """The values one request samples with, every one set (see SamplingParams)."""

    temperature: float
    top_p: float
    top_k: int


OPENAI_SAMPLING: Final = Sampling(temperature=1.0, top_p=1.0, top_k=0)
"""What a request that sets none of them gets from a model that recommends nothing."""


class SamplingDefaults(msgspec.Struct, array_like=True, frozen=True):
    """A model's recommended sampling values; None where it recommends nothing.

    The engine reads them once at load (``EngineConfig.generation_config``,
    ``tserve.gpu.models._sampling_defaults``), applies them to every request that
    leaves the field unset, and reports them in ``tserve.protocol.EngineReady``.
    ``source`` says where they came from ("" when from nowhere).
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    source: str = ""

    def resolve(self, params: SamplingParams) -> Sampling:
        """What ``params`` samples with: its own values, else these, else OpenAI's."""
        return Sampling(
            _first(params.temperature, self.temperature, OPENAI_SAMPLING.temperature),
            _first(params.top_p, self.top_p, OPENAI_SAMPLING.top_p),
            _first(params.top_k, self.top_k, OPENAI_SAMPLING.top_k),
        )

    def describe(self) -> str:
        """One line for the logs: the values in use and where they came from."""
        stated = [
            f"{name} {value}"
            for name, value in (
                ("temperature", self.temperature),
                ("top_p", self.top_p),
                ("top_k", self.top_k),
            )
            if value is not None
        ]
        if not stated:
            return "sampling defaults: OpenAI's (the model recommends none, or they are off)"
        return (
            f"sampling defaults: {', '.join(stated)} (from {self.source}), for requests that "
            "leave them unset; OpenAI's for the rest"
        )


_V = TypeVar("_V", int, float)


def _first(own: _V | None, default: _V | None, fallback: _V) -> _V:
    if own is not None:
        return own
    return fallback if default is None else default
