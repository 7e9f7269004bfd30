"""A step's prefill budget: the prompt tokens that may run beside its decodes.

Plain Python, no torch: rule 4 of the scheduler (see ``_scheduler.py``). A
step's cost is modelled as ``step_overhead_tokens + its tokens``; while D
sequences decode, prompt tokens are capped so that a step costs at most
``max_decode_slowdown`` times a decode-only step, and never below one token
(so a prefill always progresses). ``max_decode_slowdown == 0`` turns it off.
"""

from __future__ import annotations

__all__ = ["STEP_OVERHEAD_TOKENS", "check_budget", "prefill_budget"]

STEP_OVERHEAD_TOKENS = 8
"""A step's fixed cost in prompt tokens' worth of work.

Measured on CPU (the default model, SmolLM2-135M Q8_0 on the native runner,
one thread; CPU time of the step loop's thread, so the machine's load does
not enter): a step of one decode costs about 10 ms (8 ms of it the forward
pass's fixed cost, about 1 ms the step loop's own Python), each prompt token
in a step adds about 1.2 ms, each decoding row about 1.5 ms. So the fixed
cost is about 8 prompt tokens' worth, and a step that prefills
``(max_decode_slowdown - 1) * (8 + D)`` tokens beside D decodes costs about
``max_decode_slowdown`` times a decode-only step. A larger value than the
real fixed cost lets a step's prefill cost several times more than the
bound says (32 let a 48-token chunk beside one decode cost 7 decode steps).
On a GPU the fixed cost is a larger share of a step; a larger value then
gives prefill the room it costs nothing to take.
"""


def check_budget(max_decode_slowdown: float, step_overhead_tokens: int) -> None:
    """Raise ValueError for settings the rule does not define."""
    if not (max_decode_slowdown == 0 or max_decode_slowdown >= 1):
        raise ValueError(f"max_decode_slowdown must be 0 or >= 1, got {max_decode_slowdown}")
    if step_overhead_tokens < 0:
        raise ValueError(f"step_overhead_tokens must be >= 0, got {step_overhead_tokens}")


def prefill_budget(
    step_tokens: int, num_decodes: int, max_decode_slowdown: float, step_overhead_tokens: int
) -> int:
    """Prompt tokens a step of at most ``step_tokens`` tokens with ``num_decodes`` decodes may run.

    ``(max_decode_slowdown - 1) * (step_overhead_tokens + num_decodes)``, at
    least 1, at most what the decodes leave of ``step_tokens``; all of that
    when nothing decodes or the rule is off.
    """
    full = step_tokens - num_decodes
    if num_decodes == 0 or max_decode_slowdown == 0:
        return full
    bounded = (max_decode_slowdown - 1) * (step_overhead_tokens + num_decodes)
    return min(full, max(1, int(bounded)))
