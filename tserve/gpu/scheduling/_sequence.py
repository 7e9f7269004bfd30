"""One record per request inside the engine, and the unit of work in a step.

Plain Python: no torch, zmq or trio. The scheduler owns every ``Sequence``;
the model runner and sampler only read them.

A sequence's states and the only legal transitions::

    WAITING --schedule--> RUNNING --finish--> FINISHED
       ^                     |
       +------preempt--------+          (WAITING or RUNNING) --abort/finish--> FINISHED

FINISHED is terminal. An illegal transition raises ``IllegalTransition``.
"""

from __future__ import annotations

import dataclasses
import enum

from tserve.protocol import FinishReason, Sampling, SamplingDefaults, SamplingParams

__all__ = ["IllegalTransition", "ScheduledChunk", "Sequence", "SequenceStatus"]


class IllegalTransition(RuntimeError):
    """A sequence was asked to move between states the lifecycle forbids."""


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ALLOWED: dict[SequenceStatus, frozenset[SequenceStatus]] = {
    SequenceStatus.WAITING: frozenset({SequenceStatus.RUNNING, SequenceStatus.FINISHED}),
    SequenceStatus.RUNNING: frozenset({SequenceStatus.WAITING, SequenceStatus.FINISHED}),
    SequenceStatus.FINISHED: frozenset(),
}


_NO_DEFAULTS = SamplingDefaults()


@dataclasses.dataclass(eq=False)
class Sequence:
    """The engine's state for one request.

    Invariants:
    * ``num_computed_tokens <= len(all_token_ids)``: tokens whose K/V are in the
      cache. It drops to 0 when the sequence is preempted (recompute).
    * ``block_tables`` (one per KV layer group, :mod:`tserve.gpu.scheduling._kv_groups`;
      ``block_table`` is the first) are of one length, cover at least
      ``num_computed_tokens`` positions while RUNNING, and are empty while
      WAITING or FINISHED. A windowed group's table may start with
      ``NO_BLOCK`` entries: blocks reclaimed outside its window.
    * ``output_token_ids`` only grows; ``num_sent`` of them have been reported.
    * ``block_hashes[i]`` is the prefix-cache key of the tokens of full block
      ``i`` and everything before them (see :mod:`tserve.gpu.scheduling._kv`); the tokens
      of a position never change, so the list only grows, preemption included.
    * ``num_cached_blocks <= len(block_table)``: the leading blocks of the table
      that the block manager has already offered to the prefix cache.
    * ``sampling`` is what the request samples with, fixed at creation:
      ``params``' own values, else ``defaults``' (the model's), else OpenAI's.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    peer: bytes = b""
    deadline: float | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    block_tables: list[list[int]] = dataclasses.field(default_factory=lambda: [[]])
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_param: str | None = None  # what ``error`` is about ("constraint"), if set
    num_sent: int = 0
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)
    num_cached_blocks: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens the prefix cache held at admission
    defaults: dataclasses.InitVar[SamplingDefaults | None] = None
    sampling: Sampling = dataclasses.field(init=False)

    def __post_init__(self, defaults: SamplingDefaults | None) -> None:
        self.sampling = (defaults or _NO_DEFAULTS).resolve(self.params)

    @property
    def block_table(self) -> list[int]:
        """The first group's block table: the only one of a model whose layers
        all attend alike."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables[0] = table

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Known tokens whose K/V are not cached yet: 1 for a decode, more for a prefill."""
        return self.num_tokens - self.num_computed_tokens

    def token_slice(self, start: int, stop: int) -> list[int]:
        """``all_token_ids[start:stop]`` without building the whole list (O(stop - start))."""
        n_prompt = len(self.prompt_token_ids)
        if stop <= n_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : stop - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def transition(self, new: SequenceStatus) -> None:
        if new not in _ALLOWED[self.status]:
            raise IllegalTransition(
                f"request {self.request_id!r}: {self.status.value} -> {new.value}"
            )
        self.status = new


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Part of one sequence's tokens to run through the model in this step.

    ``token_ids`` are at positions ``start .. start + len(token_ids) - 1`` and
    their K/V go to the slots given by the sequence's ``block_table``. When
    ``sample`` is true the chunk ends at the sequence's last known token and the
    step samples that sequence's next token from the chunk's last position.
    """

    seq: Sequence
    start: int
    token_ids: list[int]
    sample: bool
