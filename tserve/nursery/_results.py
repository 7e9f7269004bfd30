"""What a caller of the embeddable API gets back."""

from __future__ import annotations

import dataclasses

from tserve.protocol import TokenLogprob

__all__ = ["Completion", "Delta", "Usage"]


@dataclasses.dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt tokens, those the engine's prefix cache held

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclasses.dataclass(frozen=True, slots=True)
class Delta:
    """New output of one request since the previous delta.

    ``text`` never ends inside a UTF-8 character and never reaches past a
    stop string. ``logprobs`` has one entry per token in ``token_ids`` when
    the request asked for logprobs. The last delta has ``finish_reason``
    ("stop", "length" or "abort") and ``usage``; ``stop_string`` is the
    request's stop string that ended it, when one did.
    """

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    stop_string: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Completion:
    """A whole result, as :meth:`tserve.LLM.complete` returns it."""

    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    logprobs: list[TokenLogprob] | None = None
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)
