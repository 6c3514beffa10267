"""Hand-written checkpoint, restore and weight update reports, and a scripted run of every
observer call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from rolloutd.domain.concurrency import InFlightReason
from rolloutd.domain.engine import EngineCounters, FinishedRequest, RequestObserver
from rolloutd.domain.episode import EpisodeEnd
from rolloutd.domain.errors import InvalidArgument
from rolloutd.domain.fate import EngineState, TokenFate
from rolloutd.domain.finishing import SampleScore, Verdict
from rolloutd.domain.group import GroupState
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.observer import (
    EnvironmentCall,
    EnvironmentCalled,
    EpisodeEnded,
    EpisodeTurn,
    GroupCommitted,
    GroupDropped,
    GroupFinished,
    Observer,
)
from rolloutd.domain.report import (
    CheckpointPhase,
    CheckpointReport,
    Disposition,
    Outcome,
    PhaseTiming,
    Reason,
    RecoveryState,
    RestorePhase,
    RestoreReport,
    RowKind,
    SizePart,
    SkippedSnapshot,
    TokenDisposition,
    Trigger,
)
from rolloutd.domain.weights import PhaseTiming as WeightsTiming
from rolloutd.domain.weights import (
    WeightsKind,
    WeightsObserver,
    WeightsPhase,
    WeightsReport,
    WeightsSource,
)
from rolloutd.scoring.results import ScoreFailure, failed, group_scores
from rolloutd.telemetry.sources import CheckpointState, StatusSnapshot

T0 = 1_767_000_000_000_000_000
"""A wall-clock instant in ns (late 2025)."""
MS = 1_000_000


def phases(
    kinds: Sequence[CheckpointPhase | RestorePhase],
    start_ns: int,
    failing: CheckpointPhase | RestorePhase | None = None,
) -> list[PhaseTiming]:
    """Consecutive phases of (i + 1) ms each; the failing one (if any) is the last."""
    out: list[PhaseTiming] = []
    at = start_ns
    for i, kind in enumerate(kinds):
        end = at + (i + 1) * MS
        error = OSError(28, "No space left on device") if kind == failing else None
        out.append(PhaseTiming(kind, at, end, error))
        at = end
        if error is not None:
            break
    return out


def checkpoint_report(
    *,
    start_ns: int = T0,
    trigger: Trigger = Trigger.ON_DEMAND,
    sequence: int = 7,
    failing: CheckpointPhase | None = None,
    skipped: Reason | None = None,
) -> CheckpointReport:
    if skipped is not None:
        return CheckpointReport(trigger, Outcome.SKIPPED, skipped, start_ns, start_ns + MS // 10)
    timings = phases(list(CheckpointPhase), start_ns, failing)
    end = timings[-1].end_ns
    if failing is not None:
        error = timings[-1].error
        return CheckpointReport(
            trigger, Outcome.FAILED, Reason.IO_ERROR, start_ns, end, None, "", None, timings,
            error=error,
        )  # fmt: skip
    return CheckpointReport(
        trigger,
        Outcome.COMPLETED,
        Reason.COMPLETED,
        start_ns,
        end,
        sequence=sequence,
        tag="step-40",
        trainer_step=40,
        phases=timings,
        rows={RowKind.NEW: 120, RowKind.REMOVED: 8, RowKind.LIVE: 512},
        size_bytes={SizePart.SEGMENTS: 4096, SizePart.SIDECAR: 512, SizePart.TOTAL: 4608},
    )


def restore_report(*, start_ns: int = T0, failing: RestorePhase | None = None) -> RestoreReport:
    timings = phases(list(RestorePhase), start_ns, failing)
    return RestoreReport(
        start_ns,
        timings[-1].end_ns,
        sequence=6,
        tag="step-30",
        phases=timings,
        groups={
            RecoveryState.COMMITTED: 5,
            RecoveryState.LEASED: 2,
            RecoveryState.ACKED: 1,
            RecoveryState.UNFINISHED: 3,
        },
        siblings={Disposition.REUSED: 7, Disposition.RERUN: 5},
        tokens={TokenDisposition.REUSED: 300, TokenDisposition.REGENERATED: 20},
        redispatch_s=0.004,
        skipped=[SkippedSnapshot(8, "checksum mismatch in segment-0008.arrow")],
        error=None if failing is None else timings[-1].error,
    )


def weights_report(
    *,
    start_ns: int = T0,
    source: WeightsSource = WeightsSource.PUSH,
    refused: bool = False,
    delta: bool = False,
) -> WeightsReport:
    """A push of 3 MB (a delta of 3 MB with a 2 % density): every phase (i + 1) ms (decode only
    for the delta), or refused during verify."""
    timings, at = [], start_ns
    for i, phase in enumerate(WeightsPhase):
        if phase is WeightsPhase.DECODE and not delta:
            continue
        timings.append(WeightsTiming(phase, at, at + (i + 1) * MS))
        at += (i + 1) * MS
        if refused and phase is WeightsPhase.VERIFY:
            break
    error = InvalidArgument("model.safetensors", "tensor x is F32[3], the served model's is F32[4]")
    return WeightsReport(
        version=5, source=source, started_ns=start_ns, ended_ns=at, phases=tuple(timings),
        files=1, bytes=3_000_000, error=error if refused else None,
        kind=WeightsKind.DELTA if delta else WeightsKind.FULL,
        base_version=4 if delta else None, density=0.02 if delta else None,
    )  # fmt: skip


def finished_groups() -> list[GroupFinished]:
    """Verdicts of a scoring stage: committed with rewards 1 and 0 (40 ms); dropped for zero
    variance (10 ms); dropped for a timed-out score (30 s); committed unscored (no verifier)."""
    ok, zero = SampleScore(1.0), SampleScore(0.0)
    timed_out = failed(ScoreFailure.TIMEOUT, "ran past 30 s")
    return [
        GroupFinished(3, T0, T0 + 40 * MS, Verdict(scores=group_scores([ok, zero])), 10),
        GroupFinished(
            4, T0, T0 + 10 * MS,
            Verdict("zero_variance", "reward std 0 <= 0", group_scores([ok, ok])), 10,
        ),
        GroupFinished(
            5, T0, T0 + 30_000 * MS,
            Verdict("scoring_failed", "1 of 2 scores failed", group_scores([timed_out, zero])), 10,
        ),
        GroupFinished(7, T0, T0 + MS, Verdict(), 10),
    ]  # fmt: skip


def episode_events() -> list[EpisodeTurn | EnvironmentCalled | EpisodeEnded]:
    """Two episodes after the restore: g1-s0 reuses two durable turns, reruns the third and
    replays two steps (one mismatched); g1-s1 runs a turn live whose step times out."""
    reused = Disposition.REUSED
    step, replay = EnvironmentCall.STEP, {"replay": True}
    return [
        EnvironmentCalled("g1-s0", EnvironmentCall.RESET, -1, T0, T0 + MS, **replay),
        EnvironmentCalled("g1-s0", step, 0, T0 + MS, T0 + 2 * MS, **replay),
        EnvironmentCalled("g1-s0", step, 1, T0 + 2 * MS, T0 + 3 * MS, mismatch=True, **replay),
        EpisodeTurn("g1-s0", 0, T0, T0, 20, 8, "stop", reused),
        EpisodeTurn("g1-s0", 1, T0, T0, 40, 8, "stop", reused),
        EpisodeTurn("g1-s0", 2, T0, T0 + 50 * MS, 60, 8, "stop", Disposition.RERUN, 3),
        EnvironmentCalled("g1-s0", step, 2, T0 + 50 * MS, T0 + 250 * MS, done=True),
        EpisodeEnded("g1-s0", T0 + 250 * MS, EpisodeEnd.DONE, 3, 20, 24, 30, 1.0),
        EpisodeTurn("g1-s1", 0, T0, T0 + 40 * MS, 20, 8, "stop"),
        EnvironmentCalled(
            "g1-s1", step, 0, T0 + 40 * MS, T0 + 540 * MS,
            failure=EpisodeEnd.STEP_TIMEOUT, detail="ran past 0.5 s",
        ),
        EpisodeEnded("g1-s1", T0 + 540 * MS, EpisodeEnd.STEP_TIMEOUT, 1, 20, 8, 0),
    ]  # fmt: skip


class Observes(Observer, WeightsObserver, Protocol):
    """The telemetry observer: the domain's reports and weight updates."""


ENGINE = EngineCounters(
    prompt_tokens=900, generation_tokens=4000, requests_running=3, requests_waiting=1,
    kv_cache_usage=0.25, preemptions=6, prefix_cache_hit_ratio=0.75,
)  # fmt: skip
FATES = {
    TokenFate.DELIVERED: 2400, TokenFate.EVICTED: 300, TokenFate.DROPPED: 200,
    TokenFate.REGENERATED: 50, TokenFate.FAILED: 30, TokenFate.BUFFERED: 1020,
}  # fmt: skip
ENGINE_SECONDS = {
    EngineState.GENERATING: 90.0, EngineState.WEIGHT_UPDATE: 2.5,
    EngineState.IDLE_NO_WORK: 5.0, EngineState.IDLE_BUFFER_FULL: 12.5,
}  # fmt: skip
STATUS = StatusSnapshot(
    groups={GroupState.GENERATING: 4, GroupState.COMMITTED: 2, GroupState.LEASED: 1},
    inflight_samples=13,
    policy_version=3,
    acked_groups=5,
    trainer_step=7,
    generated_tokens=sum(FATES.values()),
    token_fates=FATES,
    engine_seconds=ENGINE_SECONDS,
    in_flight_limit=12,
    in_flight_reason=InFlightReason.KV_CACHE_HIGH,
    consumed_per_version=6.5,
    staleness_room=3,
)
CHECKPOINT_STATE = CheckpointState(interval_s=60.0, since_success_s=12.5, consecutive_failures=1)


class ServiceObserver(Observes, RequestObserver, Protocol):
    """The domain's observer plus what the server's RPC interceptor and the engine report."""

    def rpc_finished(self, method: str, status_code: int, seconds: float) -> None: ...


def scripted_run(observer: ServiceObserver) -> None:
    """Every kind of observer call, in the order a short run makes them."""
    observer.rpc_finished("FetchGroups", 0, 0.004)
    observer.rpc_finished("FetchGroups", 3, 0.0002)
    observer.restored(restore_report(start_ns=T0))
    for event in episode_events():
        if isinstance(event, EpisodeTurn):
            observer.episode_turn(event)
        elif isinstance(event, EnvironmentCalled):
            observer.environment_called(event)
        else:
            observer.episode_ended(event)
    observer.mutation_blocked(MutationKind.STAGE_SAMPLE, 0.002)
    observer.mutation_blocked(MutationKind.ADMIT, 0.0005)
    observer.group_committed(GroupCommitted(1, 256, True, 1.5, prompt_tokens=12, group_size=4))
    observer.group_committed(GroupCommitted(2, 100, False, 0.75, prompt_tokens=9, group_size=4))
    observer.groups_leased([0.25, 0.5], [0, 1])
    for event in finished_groups():
        observer.group_finished(event)
        if not event.verdict.commits:
            observer.group_dropped(GroupDropped(event.group_id, event.verdict.drop_reason, 10))
    observer.group_dropped(GroupDropped(6, "engine_error", 3))
    observer.groups_evicted(2)
    observer.checkpoint_attempted(checkpoint_report(start_ns=T0 + 1_000 * MS, sequence=7))
    observer.checkpoint_attempted(
        checkpoint_report(start_ns=T0 + 2_000 * MS, skipped=Reason.NO_CHANGES)
    )
    observer.checkpoint_attempted(
        checkpoint_report(start_ns=T0 + 3_000 * MS, failing=CheckpointPhase.BUFFER_SAVE)
    )
    observer.checkpoint_attempted(
        checkpoint_report(start_ns=T0 + 61_000 * MS, sequence=8, trigger=Trigger.PERIODIC)
    )
    observer.weights_updated(weights_report(start_ns=T0 + 62_000 * MS, refused=True))
    observer.weights_updated(weights_report(start_ns=T0 + 63_000 * MS))
    observer.weights_updated(weights_report(start_ns=T0 + 63_500 * MS, delta=True))
    observer.first_token(0.03)
    observer.first_token(0.05)
    observer.request_finished(FinishedRequest(12, 40, 1.0, 0.025))
    observer.request_finished(FinishedRequest(12, 1, 0.04, None))
