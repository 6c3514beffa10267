"""Time the service did not run: frozen (SIGSTOP, a paused VM) or its event loop held up.

A lease is meant to expire when its trainer is gone, not when the service was paused: during
a pause no trainer could ack, and right after it a lease would be found expired and its groups
delivered again, while its trainer, about to ack, gets NOT_FOUND. So lease time counts only what
the service observed while it ran. A loop that sleeps a known interval (the lease reaper)
measures how long it was really away on the monotonic clock; whatever exceeds the interval by
:data:`PAUSE_MIN_S` or more is a pause, and a lease granted before a pause was noticed expires
that much later.

The pauses live in memory only: after a restart a restored lease expires at its recorded
deadline, as a lease of a process that was down (not paused) should.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

PAUSE_MIN_S = 1.0
"""Shorter delays are scheduling noise (a collection, a busy loop), not pauses."""

KEPT = 1024
"""Pauses remembered: a lease outlives this many pauses of a second or more only in theory."""


@dataclass(frozen=True)
class Pause:
    noticed_at: float
    """Wall-clock time the pause was noticed (it ended just before)."""
    seconds: float


class Pauses:
    """The pauses noticed so far; see the module docstring."""

    def __init__(self) -> None:
        self._noticed: deque[Pause] = deque(maxlen=KEPT)

    def observe(self, meant_s: float, took_s: float, now: float) -> Pause | None:
        """A loop meant to sleep ``meant_s`` and came back after ``took_s`` (monotonic clock) at
        wall-clock time ``now``; returns the pause this was, if it was one."""
        late = took_s - meant_s
        if late < PAUSE_MIN_S:
            return None
        pause = Pause(now, late)
        self._noticed.append(pause)
        return pause

    def since(self, t: float) -> float:
        """Seconds of the pauses noticed after wall-clock time ``t``: what a lease granted at
        ``t`` does not count."""
        return sum(p.seconds for p in self._noticed if p.noticed_at > t)
