"""How the domain reports what happened, as plain data. Telemetry implements this interface.

Implementations must not raise into the caller and must not block: they run inside mutations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.report import CheckpointReport, RestoreReport


@dataclass(frozen=True)
class GroupCommitted:
    group_id: int
    tokens: int
    """Generated tokens of all siblings."""
    exact: bool
    """True when tokens were counted from captured token ids, False when estimated."""
    completion_s: float
    """Admission to commit."""


class Observer(Protocol):
    def mutation_blocked(self, kind: MutationKind, wait_s: float) -> None: ...

    def group_committed(self, event: GroupCommitted) -> None: ...

    def groups_leased(self, queue_s: list[float]) -> None:
        """``queue_s``: for each leased group, time from commit to its first lease."""

    def groups_evicted(self, count: int) -> None: ...

    def checkpoint_attempted(self, report: CheckpointReport) -> None: ...

    def restored(self, report: RestoreReport) -> None: ...


class NullObserver:
    """Observes nothing; the default when telemetry is off."""

    def mutation_blocked(self, kind: MutationKind, wait_s: float) -> None:
        return None

    def group_committed(self, event: GroupCommitted) -> None:
        return None

    def groups_leased(self, queue_s: list[float]) -> None:
        return None

    def groups_evicted(self, count: int) -> None:
        return None

    def checkpoint_attempted(self, report: CheckpointReport) -> None:
        return None

    def restored(self, report: RestoreReport) -> None:
        return None
