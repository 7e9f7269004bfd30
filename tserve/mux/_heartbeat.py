"""The heartbeat watch: engine silence as the engine's, not the event loop's.

An engine that is alive sends a frame at least every heartbeat interval (a
step's outputs, or a ``Heartbeat`` while idle). The mux declares it dead
once it has been silent for the heartbeat timeout. The event loop that
measures that silence can itself stall (a blocking call on it: a huge chat
template rendered inline, a long collection); while it stalls no frame is
read, so a stall longer than the timeout would look like a silent engine.

The rules (:class:`SilenceClock`, sans-IO, no clock or socket of its own):

1. A frame read from the socket resets the silence (``heard``).
2. The watch looks again at ``deadline``: the last frame heard plus the
   timeout. When it looks, it first drains the socket without blocking
   (``ZmqChannel.poll``). Frames waiting there unread arrived while the loop
   was not looking: the engine spoke, so this counts as heard now, however
   late the loop was.
3. Only a silence with nothing waiting in the socket at the deadline is the
   engine's: that is its death.
4. How late the watch woke (the loop's lateness) is measured and kept
   (``max_lateness``), and every deadline rule 2 excused is counted
   (``excused``): a loop that stalls shows in the numbers, not as a dead
   engine.

A truly silent engine (hung, stopped, gone) is still declared dead at the
first look after the timeout: at most the timeout plus the loop's own
lateness after its last frame.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import anyio

from tserve.mux._zmqio import ZmqChannel

__all__ = ["Silence", "SilenceClock", "watch_silence"]


class Silence(enum.Enum):
    """What one look at the deadline found."""

    HEARD = "heard"  # frames arrived in time, or were waiting unread (rule 2)
    DEAD = "dead"  # nothing for the whole timeout, nothing waiting (rule 3)


class SilenceClock:
    """Sans-IO: how long the engine has been silent, by times the caller passes in.

    ``timeout`` > 0 is the heartbeat timeout in seconds; ``now`` is when the
    engine was last heard (at the start: when it became ready).
    """

    __slots__ = ("_last_heard", "excused", "max_lateness", "timeout")

    def __init__(self, timeout: float, now: float) -> None:
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        self.timeout = timeout
        self._last_heard = now
        # The most any look came after the time it was planned for (>= 0 but
        # for a clock's jitter): how long the event loop stalled at worst.
        self.max_lateness = 0.0
        self.excused = 0  # deadlines at which frames were waiting unread

    @property
    def deadline(self) -> float:
        """When the engine's silence reaches the timeout, unless it is heard first."""
        return self._last_heard + self.timeout

    def heard(self, now: float) -> None:
        """A frame from the engine was read at ``now`` (rule 1)."""
        self._last_heard = max(self._last_heard, now)

    def look(self, now: float, frames_waiting: bool, *, planned: float) -> Silence:
        """Judge the silence at ``now``, when the watch meant to look at
        ``planned``; ``frames_waiting`` says whether a non-blocking drain of
        the socket found frames not yet read (rule 2).

        Before the deadline (a frame was heard meanwhile) this is HEARD.
        """
        self.max_lateness = max(self.max_lateness, now - planned)
        if now < self.deadline:
            return Silence.HEARD
        if frames_waiting:
            self.excused += 1
            self.heard(now)
            return Silence.HEARD
        return Silence.DEAD


async def watch_silence(
    clock: SilenceClock, channel: ZmqChannel, died: Callable[[str], None]
) -> None:
    """Look at ``clock`` at each deadline; call ``died(reason)`` once the engine is silent.

    Returns after calling ``died``; cancellable at any time (it only sleeps
    and drains the socket synchronously through ``channel.poll``).
    """
    while True:
        planned = clock.deadline
        await anyio.sleep_until(planned)
        now = anyio.current_time()
        if clock.look(now, channel.poll(), planned=planned) is Silence.DEAD:
            died(f"no message from the engine for {clock.timeout:g} s")
            return
