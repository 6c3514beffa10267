"""How many groups may generate at once: a fixed number, or one that follows the engine.

A static ``limits.max_in_flight`` is either too low (the engine idles) or too high: past the KV
cache's capacity vLLM preempts running requests and computes them again, and generation slows
down several times over. With ``limits.max_in_flight: auto`` the limit follows the engine's own
signals (``EngineCounters.kv_cache_usage`` and the cumulative ``preemptions``), one decision per
turnover: once the groups in flight at the last change have left flight (as many groups left
since as there were in it), the readings in between tell whether the limit is safe. Waiting for
a turnover matters: a sequence's KV cache grows while it decodes, so usage read right after an
increase says little about where it goes.

- **Back off on preemption.** A preemption since the last reading lowers the limit, once per
  turnover (the groups in flight when it backs off go on overflowing until they finish): to the
  value of the last turnover without a preemption (one below the limit if that was the limit
  itself), if that lies above ``backoff`` times the limit, else by ``backoff``. The value that
  overflowed is remembered.
- **Grow while there is room.** If nothing was preempted in the turnover, the limit was binding
  (groups were in flight up to it) and its mean KV-cache usage, in proportion to one group more,
  stays under ``kv_cache_soft_limit``, it grows: at once to where its *peak* usage, in
  proportion, would meet the soft limit (at most ``growth`` times), and past that by one group a
  turnover. Below a value that overflowed it halves the distance to it and stops one below;
  every ``probe_after`` quiet turnovers there it may try one more, so a lighter workload is found
  again, and a try that preempts goes straight back.
- **Never above** ``limits.max_in_flight_ceiling``.

The peak sizes the jumps, the mean and preemption bound the creep: samples of different lengths
start and finish at different times, and usage swings by a block per sequence as they grow, so a
turnover's peak touches the cache's edge long before sequences run out of room (a limit held
under the peak leaves a third of the cache idle), while a jump past the peak overflows the cache
all at once, and every sequence in flight preempts until it finishes.

The reason for the current value is an enum (:class:`InFlightReason`), reported beside it. The
value is part of every snapshot (:class:`ConcurrencyState`), so a restart continues from what
the engine was found to hold, not from ``initial``.

Pure: :mod:`rolloutd.domain.generation` feeds it a reading every ``interval_s``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class InFlightReason(enum.Enum):
    """Why the limit on groups in flight is what it is."""

    FIXED = "fixed"
    """``limits.max_in_flight`` is a number."""
    STARTING = "starting"
    """Adaptive, at its initial (or restored) value, no decision made yet."""
    GROWING = "growing"
    """It grew: mean usage stayed under the soft limit through a turnover, with no preemption."""
    KV_CACHE_HIGH = "kv_cache_high"
    """Held: mean KV-cache usage over the last turnover reached the soft limit (or would, one
    group more)."""
    PREEMPTED = "preempted"
    """Backed off because the engine preempted requests, or held just below the value that
    made it preempt."""
    CEILING = "ceiling"
    """Held at ``limits.max_in_flight_ceiling``."""
    NOT_LIMITING = "not_limiting"
    """Held: fewer groups were in flight than it allows (the buffer, staleness gating or the
    dataset held admission back), so growing would prove nothing."""


@dataclass(frozen=True)
class ConcurrencyConfig:
    """The adaptive limit's settings; ``config/components.py`` exposes ``ceiling`` and ``kv_cache_soft_limit``
    as ``limits.max_in_flight_ceiling`` and ``limits.kv_cache_soft_limit``."""

    ceiling: int = 64
    """The most groups in flight ``limits.max_in_flight: auto`` may reach."""
    kv_cache_soft_limit: float = 0.9
    """With ``limits.max_in_flight: auto``: the limit grows only while the engine's mean KV-cache
    usage over a turnover stays under this fraction (vLLM preempts when it is full)."""
    initial: int = 8
    """Groups in flight before the engine has been read (capped by ``ceiling``)."""
    backoff: float = 0.5
    """Factor applied to the limit when the engine preempted requests (unless a value that
    turned over without a preemption lies between)."""
    growth: float = 2.0
    """Most the limit grows by in one step."""
    interval_s: float = 0.25
    """How often the engine's signals are read."""
    probe_after: int = 8
    """Quiet turnovers just below the lowest value that made the engine preempt before it may
    try one more group."""


@dataclass(frozen=True)
class EngineReading:
    """One reading of what the limit follows."""

    kv_cache_usage: float
    """Fraction of the KV cache in use now."""
    preemptions: int
    """Requests the engine preempted since it started (cumulative)."""
    in_flight: int
    """Groups generating or finishing now."""
    departed: int
    """Groups that left flight so far (cumulative; any origin, only differences count)."""


@dataclass(frozen=True)
class ConcurrencyState:
    """What a snapshot keeps of the adaptive limit."""

    value: int | None = None
    """The limit when the snapshot was taken; None: fixed, or a snapshot from before it."""


class InFlightLimit:
    """The limit on groups in flight: fixed (``config`` None) or adaptive; see the module
    docstring."""

    def __init__(self, fixed: int, config: ConcurrencyConfig | None = None) -> None:
        self.config = config
        if config is None:
            self.value, self.reason = fixed, InFlightReason.FIXED
            self.ceiling = fixed
            return
        self.ceiling = config.ceiling
        self.value = max(1, min(config.initial, config.ceiling))
        self.reason = InFlightReason.STARTING
        self._preemptions: int | None = None
        """The engine's count at the previous reading (None: not read yet)."""
        self._window: tuple[int, int] | None = None
        """(departed, in flight) when the current window began: it ends at a turnover."""
        self._usage = 0.0
        """Sum of the KV-cache usage read in the current window."""
        self._peak = 0.0
        """Highest KV-cache usage read in the current window."""
        self._readings = 0
        """Readings in the current window."""
        self._busiest = 0
        """Most groups in flight read in the current window."""
        self._cooling = False
        """Backed off in the current window: its readings judge the groups in flight before."""
        self._held: int | None = None
        """The value of the last turnover without a preemption (None: none since the last
        back-off): a preemption above it goes back to it, one at it goes one below."""
        self._overflow: int | None = None
        """The lowest value known to have made the engine preempt (None: none yet). Growth stops
        below it; it creeps up by one every ``probe_after`` quiet turnovers spent just below it,
        so a lighter workload is found again."""
        self._quiet = 0
        """Turnovers spent just below ``_overflow`` without a preemption."""

    @property
    def adaptive(self) -> bool:
        return self.config is not None

    def observe(self, reading: EngineReading) -> bool:
        """Takes one reading; returns whether the value changed. A fixed limit never does."""
        cfg = self.config
        if cfg is None:
            return False
        preempted = self._preemptions is not None and reading.preemptions > self._preemptions
        self._preemptions = reading.preemptions  # a restarted engine counts from 0 again
        if self._window is None:
            self._new_window(reading)
        if preempted and not self._cooling:
            return self._back_off(reading, cfg)
        self._usage += reading.kv_cache_usage
        self._peak = max(self._peak, reading.kv_cache_usage)
        self._readings += 1
        self._busiest = max(self._busiest, reading.in_flight)
        assert self._window is not None
        departed, in_flight = self._window
        if reading.departed - departed < max(in_flight, 1):
            return False  # not turned over yet
        if self._cooling:
            self._cooling = False
            return self._hold(reading, InFlightReason.PREEMPTED)
        self._held = self.value
        mean, soft = self._usage / self._readings, cfg.kv_cache_soft_limit
        if mean * (self.value + 1) / self.value >= soft:
            return self._hold(reading, InFlightReason.KV_CACHE_HIGH)  # one group more reaches it
        if self.value >= self.ceiling:
            return self._hold(reading, InFlightReason.CEILING)
        if self._busiest < self.value:
            return self._hold(reading, InFlightReason.NOT_LIMITING)
        # a jump to where the peak, in proportion to the groups, meets the soft limit; past it,
        # one group a turnover
        grown = math.floor(self.value * cfg.growth)
        if self._peak > 0:
            grown = min(grown, math.floor(self.value * soft / self._peak))
        grown = min(max(grown, self.value + 1), self.ceiling)
        if self._overflow is not None:
            # half the way to what overflowed, at most to one below it
            grown = min(grown, self.value + max(1, (self._overflow - self.value) // 2))
            if grown >= self._overflow:
                grown = self._overflow - 1
            if grown <= self.value:
                self._quiet += 1
                if self._quiet >= cfg.probe_after:
                    self._overflow, self._quiet = self._overflow + 1, 0
                return self._hold(reading, InFlightReason.PREEMPTED)
        return self._set(grown, reading, InFlightReason.GROWING)

    def _back_off(self, reading: EngineReading, cfg: ConcurrencyConfig) -> bool:
        """The engine preempted: the groups in flight when it backs off go on overflowing until
        they finish, so one back-off per turnover, not one per reading."""
        self._cooling = True
        self._overflow = min(self.value, self._overflow or self.value)
        self._quiet = 0
        value = max(1, math.floor(self.value * cfg.backoff))
        if self._held is not None:  # it turned over there without a preemption
            value = max(value, min(self._held, self.value - 1))
        self._held = None
        return self._set(value, reading, InFlightReason.PREEMPTED)

    def _new_window(self, reading: EngineReading) -> None:
        """A window begins after ``reading``, which ended the previous one."""
        self._window = (reading.departed, reading.in_flight)
        self._usage, self._peak, self._readings, self._busiest = 0.0, 0.0, 0, 0

    def _hold(self, reading: EngineReading, reason: InFlightReason) -> bool:
        self.reason = reason
        self._new_window(reading)
        return False

    def _set(self, value: int, reading: EngineReading, reason: InFlightReason) -> bool:
        changed = value != self.value
        self.value, self.reason = value, reason
        self._new_window(reading)
        return changed

    def state(self) -> ConcurrencyState:
        return ConcurrencyState(self.value if self.adaptive else None)

    def restore(self, state: ConcurrencyState) -> None:
        """Continues from a snapshot's value (within the ceiling); a fixed limit keeps its own."""
        if self.config is None or state.value is None:
            return
        self.value = max(1, min(state.value, self.ceiling))
        self.reason = InFlightReason.STARTING
        self._window = None
        self._cooling = False
        self._held = None
