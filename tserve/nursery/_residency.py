"""Which models stay resident: keep-alive and the memory budget's LRU rule. Sans-IO.

A :class:`~tserve.nursery._registry.ModelRegistry` asks these functions
what to do; it alone does it (starts, stops and measures engines).

Rules:

1. **Keep-alive, Ollama's semantics.** A duration in seconds: an idle
   model (nothing in flight) is unloaded that long after its last use (its
   last ``acquire``, or the end of its last ``use`` block); ``0`` unloads
   it as soon as it is idle; a negative value pins it (never unloaded for
   idleness). The latest call that asked for the model sets its keep-alive,
   with its own value or, when it gives none, the registry's default
   (Ollama: the latest request's value sets the expiry).
2. **Resident bytes.** A LOADED model counts its engines' measured RSS, a
   LOADING one its estimate, an UNLOADING one its last measured RSS until
   its process is gone; any other state counts nothing.
3. **The estimate** of a model about to load is the RSS measured during its
   last residency; before its first load, the size of its weights (a file's
   size, the files directly in a directory; 0 for a name that is no path,
   such as "default") plus the engine floor: the least RSS beyond its
   weights that any engine measured right after its load (0 until one has).
4. **A load fits** when the other models' resident bytes plus its estimate
   stay within the budget, or when no other model is resident: a model
   larger than the whole budget loads alone.
5. **Room, LRU first.** When it does not fit, idle LOADED models are
   unloaded least recently used first, as few as make it fit, and only if
   they do make it fit: otherwise nothing is unloaded and the load waits
   for a busy model to go idle. A model with requests in flight (or with
   callers about to receive it from its load) is never chosen.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Sequence
from typing import Final

__all__ = ["DEFAULT_KEEP_ALIVE", "Occupant", "expiry", "parse_keep_alive", "plan_room"]

DEFAULT_KEEP_ALIVE: Final = 300.0
"""Seconds an idle model stays loaded unless a call says otherwise (Ollama's 5 minutes)."""

_UNITS: Final = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,  # U+00B5 MICRO SIGN, as Go writes it
    "μs": 1e-6,  # U+03BC GREEK SMALL LETTER MU
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_NUMBER: Final = r"(?:\d+(?:\.\d*)?|\.\d+)"
_PART: Final = re.compile(rf"({_NUMBER})(ns|us|µs|μs|ms|s|m|h)")
_DURATION: Final = re.compile(rf"([-+]?)((?:{_NUMBER}(?:ns|us|µs|μs|ms|s|m|h))+)")
_SECONDS: Final = re.compile(rf"[-+]?{_NUMBER}")
_KEEP_ALIVE_FORMS: Final = (
    "keep_alive must be a duration such as '5m', '1h30m' or '30s', a number of "
    "seconds, or a negative value (-1) to keep the model loaded"
)


def parse_keep_alive(value: object) -> float:
    """Ollama's ``keep_alive`` as seconds: a number (seconds), a string of one
    ("300", "-1"), or a Go duration ("5m", "1h30m", "1.5s", "-1m"). Any
    negative value means "pinned" and comes back as -1.0; 0 unloads right
    after the request. ValueError naming the forms for anything else (a
    bool, NaN, infinity, "5 min", "").
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{_KEEP_ALIVE_FORMS}; got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        if _SECONDS.fullmatch(text):
            seconds = float(text)
        elif match := _DURATION.fullmatch(text):
            sign, body = match.groups()
            total = sum(float(n) * _UNITS[u] for n, u in _PART.findall(body))
            seconds = -total if sign == "-" else total
        else:
            raise ValueError(f"{_KEEP_ALIVE_FORMS}; got {value!r}")
    else:
        seconds = float(value)
    if not math.isfinite(seconds):
        raise ValueError(f"{_KEEP_ALIVE_FORMS}; got {value!r}")
    return -1.0 if seconds < 0 else seconds


def expiry(last_used: float, keep_alive: float) -> float | None:
    """When an idle model last used at ``last_used`` is unloaded (rule 1); None if pinned."""
    return None if keep_alive < 0 else last_used + keep_alive


@dataclasses.dataclass(frozen=True, slots=True)
class Occupant:
    """A model other than the one to load, as the budget sees it (rule 2)."""

    name: str
    resident_bytes: int
    evictable: bool  # LOADED, nothing in flight and no caller about to receive it
    last_used: float  # on the registry's clock; the least is unloaded first


def plan_room(need: int, budget: int, others: Iterable[Occupant]) -> Sequence[str] | None:
    """What to unload so that a load of ``need`` bytes fits in ``budget``
    (rules 4 and 5): ``()`` when it fits now, the idle models to unload (least
    recently used first) when that makes it fit, None when it cannot fit until
    a busy model goes idle."""
    others = [o for o in others if o.resident_bytes > 0]
    resident = sum(o.resident_bytes for o in others)
    if not others or resident + need <= budget:
        return ()
    idle = sorted((o for o in others if o.evictable), key=lambda o: o.last_used)
    victims: list[str] = []
    for occupant in idle:
        victims.append(occupant.name)
        resident -= occupant.resident_bytes
        if len(victims) == len(others) or resident + need <= budget:
            return victims
    return None
