"""What the observable instruments read: small plain-data snapshots the composition root supplies.

The callbacks that return these run on the metric readers' threads (the periodic OTLP exporter and
every ``/metrics`` scrape), not on the event loop. They must be cheap and thread-safe: read counters
the controller keeps up to date, never iterate a container the loop may be changing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rolloutd.domain.concurrency import InFlightReason
from rolloutd.domain.controller import ControllerStatus
from rolloutd.domain.fate import EngineState, TokenFate
from rolloutd.domain.group import GroupState


@dataclass(frozen=True)
class StatusSnapshot:
    """What the controller holds right now."""

    groups: Mapping[GroupState, int] = field(default_factory=dict)
    """Groups by state; a state left out counts as zero."""
    inflight_samples: int = 0
    """Sibling requests dispatched to the engine and not yet staged."""
    policy_version: int = 0
    """Policy version of the weights the engine generates with."""
    pending_prompts: int = 0
    """Submitted prompts waiting for admission."""
    expired_leases: int = 0
    """Leases that expired unacked, since the store began (cumulative)."""
    requeued_groups: int = 0
    """Groups made available again by an expired lease or a Rewind (cumulative)."""
    acked_groups: int = 0
    """Groups acked by trainers, since the store began (cumulative)."""
    trainer_step: int = -1
    """The highest trainer step acked; -1 before the first ack."""
    generated_tokens: int = 0
    """Tokens the engine handed to the service, since the store began (domain/fate.py)."""
    token_fates: Mapping[TokenFate, int] = field(default_factory=dict)
    """``generated_tokens`` by fate; ``buffered`` is what the others leave."""
    engine_seconds: Mapping[EngineState, float] = field(default_factory=dict)
    """The engine's time by state, since the store began."""
    in_flight_limit: int = 0
    """Groups that may be generating or finishing at once now."""
    in_flight_reason: InFlightReason = InFlightReason.FIXED
    consumed_per_version: float | None = None
    """Trainers' pace per policy version, as the staleness gate measured it; None: not yet."""
    staleness_room: int = 0
    """Groups the staleness gate would still admit."""


@dataclass(frozen=True)
class CheckpointState:
    """The checkpointer's cadence and health."""

    interval_s: float = 0.0
    """Configured periodic interval (0: periodic checkpoints off)."""
    since_success_s: float = 0.0
    """Seconds since the last completed checkpoint, or since start-up if none."""
    consecutive_failures: int = 0
    """Failed attempts in a row."""


def status_snapshot(status: ControllerStatus) -> StatusSnapshot:
    """The controller's status as the gauges read it."""
    b, a, c = status.buffer, status.admission, status.counters
    return StatusSnapshot(
        groups={
            GroupState.GENERATING: b.generating,
            GroupState.FINISHING: b.finishing,
            GroupState.COMMITTED: b.committed,
            GroupState.LEASED: b.leased,
            GroupState.ACKED: b.acked,
        },
        inflight_samples=status.inflight_samples,
        policy_version=status.policy_version,
        pending_prompts=status.pending_prompts,
        expired_leases=status.counters.expired_leases,
        requeued_groups=status.counters.requeued_groups,
        acked_groups=status.counters.acked_groups,
        trainer_step=status.trainer_step,
        generated_tokens=c.generated_tokens,
        token_fates={**c.settled(), TokenFate.BUFFERED: c.buffered_tokens},
        engine_seconds={s: c.engine_seconds.get(s.value, 0.0) for s in EngineState},
        in_flight_limit=a.in_flight_limit,
        in_flight_reason=a.in_flight_reason,
        consumed_per_version=a.consumed_per_version,
        staleness_room=a.staleness_room,
    )
