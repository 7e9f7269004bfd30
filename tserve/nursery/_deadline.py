"""A request's deadline on the two clocks that enforce it.

The API process enforces a deadline with a cancel scope on the event loop's
clock; the engine (another process) holds a copy on the wall clock as a
backstop for an API process that cannot act (a stalled event loop). The
copy expires :data:`ENGINE_DEADLINE_SLACK` s later, so normally our own
timer fires first and ends the request with exactly one Abort; when the
engine's fires first, its ABORT ending is read as a timeout (``_output.py``).
"""

from __future__ import annotations

import dataclasses
import math
import time

import anyio

__all__ = ["ENGINE_DEADLINE_SLACK", "Deadline"]

ENGINE_DEADLINE_SLACK = 1.0  # s between our deadline and the engine's copy


@dataclasses.dataclass(frozen=True, slots=True)
class Deadline:
    """One instant on both clocks; ``loop`` is ``math.inf`` and ``engine`` None for none."""

    loop: float  # on the event loop's clock (anyio.current_time())
    engine: float | None  # on the wall clock (time.time()), slack added: AddRequest.deadline

    @classmethod
    def after(cls, timeout: float | None) -> Deadline:
        """The deadline ``timeout`` s from now (None: no deadline). Call it on the event loop."""
        if timeout is None:
            return cls(math.inf, None)
        return cls(anyio.current_time() + timeout, time.time() + timeout + ENGINE_DEADLINE_SLACK)

    @property
    def is_set(self) -> bool:
        return self.engine is not None
