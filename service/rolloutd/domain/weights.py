"""What a weight update did, as plain data: its phases with true times, bytes and outcome (a port
of the domain: the engine records its phases here).

The updater and the engine measure; :mod:`rolloutd.telemetry` turns a :class:`WeightsReport` into
a span tree and instruments, :mod:`rolloutd.api` into an RPC response. Standard library and the
domain's errors only.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from rolloutd.domain.errors import InvalidArgument, ResourceExhausted


class WeightsPhase(enum.Enum):
    """The phases of one update, in order. ``pause``, ``load`` and ``resume`` happen inside the
    engine; generation is stopped only from the start of ``pause`` to the end of ``resume``."""

    TRANSFER = "transfer"
    """Files copied from an fsspec URL, or received from a push, into local staging."""
    VERIFY = "verify"
    """Sizes, checksums, and safetensors headers against the served model."""
    DECODE = "decode"
    """A delta applied to the served weights, and every resulting tensor's checksum checked."""
    PAUSE = "pause"
    """Generation pausing (requests in flight finish or are aborted)."""
    LOAD = "load"
    """The engine reading the new weights."""
    RESUME = "resume"
    """Generation resuming with the new weights."""


class WeightsSource(enum.Enum):
    """Where the new weights came from."""

    PATH = "path"
    """A directory on the service's own filesystem, loaded in place."""
    URL = "url"
    """An fsspec URL (object storage), copied into staging."""
    PUSH = "push"
    """Streamed by the trainer over ``PushWeights``."""
    STORE = "store"
    """The weights store's anchor and chain of deltas, caught up with before admitting work."""


class WeightsKind(enum.Enum):
    """What was moved: whole weights, or what changed since the served version."""

    FULL = "full"
    DELTA = "delta"


class WeightsOutcome(enum.Enum):
    """How an update attempt ended."""

    LOADED = "loaded"
    """The new version serves."""
    REFUSED = "refused"
    """Bad or oversized weights or request, refused before the engine saw them; the old serve."""
    FAILED = "failed"
    """Anything else: storage unreachable, stream cut, or the engine failing while loading."""


@dataclass(frozen=True)
class PhaseTiming:
    phase: WeightsPhase
    start_ns: int
    """Wall-clock nanoseconds since the Unix epoch."""
    end_ns: int

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


@dataclass
class WeightsTimeline:
    """Collects phase timings as they happen; the engine adds its own phases to the updater's.

    Wall-clock times (``time.time_ns``) so that spans line up with the caller's trace.
    """

    phases: list[PhaseTiming] = field(default_factory=list)

    @contextmanager
    def phase(self, phase: WeightsPhase) -> Iterator[None]:
        """Times the block as ``phase``; a block that raises is recorded too (until it raised)."""
        start = time.time_ns()
        try:
            yield
        finally:
            self.phases.append(PhaseTiming(phase, start, time.time_ns()))

    def seconds(self) -> dict[str, float]:
        """Seconds per phase that ran (a phase that ran twice is summed)."""
        out: dict[str, float] = {}
        for p in self.phases:
            out[p.phase.value] = out.get(p.phase.value, 0.0) + p.seconds
        return out


@dataclass(frozen=True)
class WeightsReport:
    """One update attempt, successful or not."""

    version: int
    source: WeightsSource
    started_ns: int
    ended_ns: int
    phases: tuple[PhaseTiming, ...]
    files: int
    """Safetensors files loaded (or that would have been)."""
    bytes: int
    """Bytes moved: the safetensors files, or the delta (with the anchor when one was fetched)."""
    kind: WeightsKind = WeightsKind.FULL
    base_version: int | None = None
    """The version a delta applies to."""
    density: float | None = None
    """Of a delta: the fraction of elements it changes (known once its header was read)."""
    error: BaseException | None = None
    """Why the update was refused or failed; None when the new version serves."""

    @property
    def seconds(self) -> float:
        return (self.ended_ns - self.started_ns) / 1e9

    @property
    def outcome(self) -> WeightsOutcome:
        if self.error is None:
            return WeightsOutcome.LOADED
        if isinstance(self.error, InvalidArgument | ResourceExhausted):
            return WeightsOutcome.REFUSED
        return WeightsOutcome.FAILED

    def phase_seconds(self) -> dict[str, float]:
        """Seconds per phase that ran (a phase that ran twice is summed)."""
        return WeightsTimeline(list(self.phases)).seconds()

    @property
    def paused_s(self) -> float:
        """How long generation stood still: from the start of pause to the end of resume."""
        inside = [p for p in self.phases if p.phase in _ENGINE_PHASES]
        if not inside:
            return 0.0
        return (max(p.end_ns for p in inside) - min(p.start_ns for p in inside)) / 1e9


_ENGINE_PHASES = frozenset({WeightsPhase.PAUSE, WeightsPhase.LOAD, WeightsPhase.RESUME})


class WeightsObserver(Protocol):
    """Receives every update attempt; must not raise or block (telemetry implements it)."""

    def weights_updated(self, report: WeightsReport) -> None: ...


class NullWeightsObserver:
    def weights_updated(self, report: WeightsReport) -> None:
        return None
