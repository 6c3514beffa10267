"""What a checkpoint or restore attempt reports, as plain data (enums, timings, counts).

Telemetry turns these into spans and instruments; the API into RPC responses. Timestamps are
wall-clock nanoseconds so spans can be recorded after the fact with their true start and end.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from rolloutd.domain.errors import public_cause


class CheckpointPhase(enum.Enum):
    BARRIER_WAIT = "barrier_wait"
    EXCLUSIVE_HOLD = "exclusive_hold"
    BUFFER_SAVE = "buffer_save"
    SIDECAR_WRITE = "sidecar_write"
    COMMIT = "commit"


class RestorePhase(enum.Enum):
    RESOLVE_SNAPSHOT = "resolve_snapshot"
    DATALOADER = "dataloader"
    BUFFER = "buffer"
    REPLAY_METADATA = "replay_metadata"
    RECOVERY_LEDGER = "recovery_ledger"
    REDISPATCH = "redispatch"


class Outcome(enum.Enum):
    COMPLETED = "completed"
    SKIPPED = "skipped"
    FAILED = "failed"


class Reason(enum.Enum):
    COMPLETED = "completed"
    NO_CHANGES = "no_changes"
    IN_PROGRESS = "in_progress"
    RESTORING = "restoring"
    SHUTTING_DOWN = "shutting_down"
    IO_ERROR = "io_error"
    TIMEOUT = "timeout"
    INVARIANT_ERROR = "invariant_error"


class Trigger(enum.Enum):
    PERIODIC = "periodic"
    ON_DEMAND = "on_demand"
    SHUTDOWN = "shutdown"


class RowKind(enum.Enum):
    """Rows counted per snapshot: written in this delta, removed since the last, live in total."""

    NEW = "new"
    REMOVED = "removed"
    LIVE = "live"


class SizePart(enum.Enum):
    SEGMENTS = "segments"
    GROUPS = "groups"
    """Group segments: the metadata of the groups that changed."""
    SIDECAR = "sidecar"
    SUBMISSIONS = "submissions"
    """Pieces of submitted prompts: those accepted since the parent snapshot, or a merge."""
    LEDGER = "ledger"
    """Pieces of the finalized-lease ledger: leases finalized since the parent, or a merge."""
    PARTIALS = "partials"
    """Tokens of siblings still generating (``recovery.granularity: token``)."""
    TOTAL = "total"
    """The sum of the other parts."""


class RecoveryState(enum.Enum):
    """State a group is found in at restore."""

    COMMITTED = "committed"
    LEASED = "leased"
    ACKED = "acked"
    UNFINISHED = "unfinished"


class Disposition(enum.Enum):
    REUSED = "reused"
    RERUN = "rerun"


class TokenDisposition(enum.Enum):
    """What a restore did with the partial tokens a snapshot held: continued from them, or
    threw them away to generate them again."""

    REUSED = "reused"
    REGENERATED = "regenerated"


@dataclass
class PhaseTiming:
    phase: CheckpointPhase | RestorePhase
    start_ns: int
    end_ns: int
    error: BaseException | None = None

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


@dataclass
class PhaseClock:
    """Records consecutive phases; a phase that raises is recorded with its error."""

    phases: list[PhaseTiming] = field(default_factory=list)

    @contextmanager
    def phase(self, phase: CheckpointPhase | RestorePhase) -> Iterator[None]:
        start = time.time_ns()
        try:
            yield
        except BaseException as exc:
            self.phases.append(PhaseTiming(phase, start, time.time_ns(), exc))
            raise
        self.phases.append(PhaseTiming(phase, start, time.time_ns()))

    def seconds(self) -> dict[str, float]:
        return {p.phase.value: p.seconds for p in self.phases}


@dataclass
class CheckpointReport:
    trigger: Trigger
    outcome: Outcome
    reason: Reason
    started_ns: int
    ended_ns: int
    sequence: int | None = None
    tag: str = ""
    trainer_step: int | None = None
    phases: list[PhaseTiming] = field(default_factory=list)
    rows: dict[RowKind, int] = field(default_factory=dict)
    size_bytes: dict[SizePart, int] = field(default_factory=dict)
    error: BaseException | None = None
    retagged: int | None = None
    """The newest older snapshot with the same tag: the tag names this one now, and that one
    stays reachable by its sequence number."""

    @property
    def seconds(self) -> float:
        return (self.ended_ns - self.started_ns) / 1e9

    def phase_seconds(self) -> dict[str, float]:
        return {p.phase.value: p.seconds for p in self.phases}

    def message(self) -> str:
        """What the caller should know beyond the outcome: the error of a failed attempt, or
        that its tag moved to this snapshot."""
        if self.error is not None:
            return public_cause(self.error)
        if self.retagged is not None:
            return (
                f"tag {self.tag!r} now names snapshot {self.sequence}; snapshot {self.retagged}, "
                f"which it named before, stays reachable by its sequence ({self.retagged})"
            )
        return ""


@dataclass
class SkippedSnapshot:
    sequence: int
    reason: str


@dataclass
class RestoreReport:
    started_ns: int
    ended_ns: int
    sequence: int | None = None
    tag: str = ""
    phases: list[PhaseTiming] = field(default_factory=list)
    groups: dict[RecoveryState, int] = field(default_factory=dict)
    siblings: dict[Disposition, int] = field(default_factory=dict)
    tokens: dict[TokenDisposition, int] = field(default_factory=dict)
    """Partial tokens of unfinished siblings, by what the restore did with them."""
    redispatch_s: float = 0.0
    skipped: list[SkippedSnapshot] = field(default_factory=list)
    replayed: int = 0
    """Journal records (acks, lease grants, submitted prompts) applied after the snapshot, or
    from the start of the journal when there was none."""
    error: BaseException | None = None

    @property
    def seconds(self) -> float:
        return (self.ended_ns - self.started_ns) / 1e9
