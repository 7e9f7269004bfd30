"""One request's engine outputs to what its caller sees. Sans-IO.

:class:`OutputMapper` turns each :class:`~tserve.protocol.RequestOutput` of
a request, in order, into an :class:`Outcome`: a :class:`Delta` to hand out,
or nothing yet, or the error to raise, and whether the request is over. It
never does IO and holds no lifecycle state: what is sent, aborted or failed
is the request's :class:`~tserve.mux.Lifecycle` (``tserve/mux/_lifecycle.py``),
which the IO shell (``_request.py``) drives. The rules, checked in this order
for each output:

1. ``FinishReason.ERROR``: the outcome is RequestFailed with the engine's
   reason and ``param``; when the engine names a part of the request (its
   ``constraint``) and generated no token for it (in this output or before),
   InvalidRequest instead (the request, not the engine, is at fault).
2. ``FinishReason.ABORT`` on a request with a deadline: we did not abort it
   (we would not be reading it), so the engine's copy of the deadline
   expired first (``_deadline.py``): the outcome is RequestTimeout.
3. The text reaches a stop string: the final delta, reason "stop". If the
   engine still runs the request (no finish reason yet), STOPPED: the shell
   closes the request, which aborts it.
4. Any other finish reason: the final delta with the held-back text and the
   engine's reason.
5. No tokens and no text: nothing to tell yet; read again.

:func:`finish_error` and :func:`mux_error` are the rules 1-2 and the mux
failure mapping on their own, for the embeddings (``_embedder.py``), which
read one final output per input and no text.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence

from tserve.mux import EngineDeadError, MuxClosedError
from tserve.nursery._detokenize import IncrementalDetokenizer, StopMatcher
from tserve.nursery._errors import (
    InvalidRequest,
    LLMError,
    RequestFailed,
    RequestTimeout,
    ShuttingDown,
)
from tserve.nursery._results import Delta, Usage
from tserve.protocol import FinishReason, RequestOutput

__all__ = ["Decision", "Outcome", "OutputMapper", "finish_error", "mux_error"]


class Decision(enum.Enum):
    """What the shell does with one output."""

    WAIT = "wait"  # nothing to tell yet: read the mailbox again
    DELTA = "delta"  # hand out the delta; the request goes on
    FINISHED = "finished"  # hand out the final delta; the engine is done with it
    STOPPED = "stopped"  # hand out the final delta; the engine still runs it: a stop string hit
    FAILED = "failed"  # raise the error: the engine failed the request
    TIMED_OUT = "timed out"  # raise the error: the engine's copy of the deadline expired


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    """An output's meaning. ``delta`` is set for DELTA, FINISHED and STOPPED;
    ``error`` for FAILED and TIMED_OUT."""

    decision: Decision
    delta: Delta | None = None
    error: LLMError | None = None

    @property
    def over(self) -> bool:
        """The request has ended for its caller: close it."""
        return self.decision not in (Decision.WAIT, Decision.DELTA)


_WAIT = Outcome(Decision.WAIT)


class OutputMapper:
    """The output rules of one generation request (see the module docstring).

    Synchronous; never blocks. Feed it outputs only between :meth:`submitted`
    and the first outcome that is ``over``.
    """

    __slots__ = (
        "_cached_tokens",
        "_deadline_message",
        "_detok",
        "_has_deadline",
        "_num_tokens",
        "_prompt_tokens",
        "_stop",
    )

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        stop: Sequence[str],
        *,
        has_deadline: bool,
        request_id: str,
    ) -> None:
        """``decode`` turns token ids into text; ``stop`` are the request's stop strings."""
        self._detok = IncrementalDetokenizer(decode)
        self._stop = StopMatcher(stop)
        self._has_deadline = has_deadline
        # Invariant: the token ids of every output pushed so far; with
        # _prompt_tokens, the final delta's usage.
        self._num_tokens = 0
        self._prompt_tokens = 0
        self._cached_tokens = 0
        self._deadline_message = f"request {request_id} passed its deadline"

    def submitted(self, prompt_tokens: int) -> None:
        """The request went to the engine with a prompt of ``prompt_tokens`` tokens."""
        self._prompt_tokens = prompt_tokens

    def push(self, output: RequestOutput) -> Outcome:
        """The meaning of the request's next output (rules 1-5)."""
        self._num_tokens += len(output.token_ids)
        if output.cached_tokens is not None:
            self._cached_tokens = output.cached_tokens
        finish = output.finish_reason
        error = None
        if finish is not None:
            error = finish_error(
                output,
                has_deadline=self._has_deadline,
                failed="the engine failed this request",
                timed_out=self._deadline_message,
            )
        if isinstance(error, RequestFailed) and error.param is not None and not self._num_tokens:
            error = InvalidRequest(str(error), param=error.param)
        if error is not None:
            failed = isinstance(error, (RequestFailed, InvalidRequest))
            return Outcome(Decision.FAILED if failed else Decision.TIMED_OUT, error=error)
        text = self._stop.push(self._detok.push(output.token_ids))
        if self._stop.stopped:
            decision = Decision.STOPPED if finish is None else Decision.FINISHED
            reason = "stop"
        elif finish is not None:
            text += self._stop.push(self._detok.flush()) + self._stop.flush()
            decision, reason = Decision.FINISHED, finish.openai
        elif not text and not output.token_ids:
            return _WAIT
        else:
            return Outcome(Decision.DELTA, Delta(text, output.token_ids, output.logprobs))
        usage = Usage(self._prompt_tokens, self._num_tokens, self._cached_tokens)
        delta = Delta(text, output.token_ids, output.logprobs, reason, usage, self._stop.matched)
        return Outcome(decision, delta)

    def timed_out(self) -> RequestTimeout:
        """The error for our own deadline passing (the caller closes the request: the abort)."""
        return RequestTimeout(self._deadline_message)


def finish_error(
    output: RequestOutput, *, has_deadline: bool, failed: str, timed_out: str
) -> LLMError | None:
    """The error an output ending stands for (rules 1-2), or None.

    ERROR: RequestFailed with the engine's reason (else ``failed``) and param. ABORT on
    a request with a deadline: RequestTimeout(``timed_out``).
    """
    finish = output.finish_reason
    if finish is FinishReason.ERROR:
        return RequestFailed(output.error or failed, param=output.error_param)
    if finish is FinishReason.ABORT and has_deadline:
        return RequestTimeout(timed_out)
    return None


def mux_error(error: EngineDeadError | MuxClosedError, closed: str) -> LLMError | EngineDeadError:
    """What a caller sees when the mux fails its request.

    EngineDeadError as it is (the engine died: every request fails with it);
    MuxClosedError as ShuttingDown(``closed``): the client is being left, and
    the mux itself queued the abort of what the engine still runs.
    """
    if isinstance(error, MuxClosedError):
        return ShuttingDown(closed)
    return error
