"""The metric catalogue: every instrument rolloutd exports, in one place.

Names, units, descriptions, attribute values and histogram buckets are defined here and nowhere
else. ``docs/metrics.md`` is generated from this module and the Grafana dashboard is tested
against it.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import grpc

from rolloutd.domain.concurrency import InFlightReason
from rolloutd.domain.episode import EpisodeEnd
from rolloutd.domain.fate import MEANINGS, STATES, DropReason, EngineState, TokenFate
from rolloutd.domain.group import BUFFERED, SampleScore, ScoreFailure
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.report import (
    CheckpointPhase,
    Disposition,
    Outcome,
    Reason,
    RecoveryState,
    RestorePhase,
    RowKind,
    SizePart,
    TokenDisposition,
    Trigger,
)
from rolloutd.domain.weights import WeightsKind, WeightsOutcome, WeightsPhase, WeightsSource
from rolloutd.telemetry.generation import OPERATION, GenAIAttr
from rolloutd.v1 import rollout_pb2 as pb


class Kind(enum.Enum):
    COUNTER = "counter"
    HISTOGRAM = "histogram"
    GAUGE = "gauge"
    OBSERVABLE_COUNTER = "observable_counter"
    OBSERVABLE_UP_DOWN_COUNTER = "observable_up_down_counter"
    OBSERVABLE_GAUGE = "observable_gauge"


class EngineRequestState(enum.Enum):
    """Where an engine request sits in the engine's scheduler."""

    RUNNING = "running"
    WAITING = "waiting"


class GroupOutcome(enum.Enum):
    """What became of a group the finishing stage decided about."""

    COMMITTED = "committed"
    DROPPED = "dropped"


REASON_OUTCOME: Mapping[Reason, Outcome] = {
    Reason.COMPLETED: Outcome.COMPLETED,
    Reason.NO_CHANGES: Outcome.SKIPPED,
    Reason.IN_PROGRESS: Outcome.SKIPPED,
    Reason.RESTORING: Outcome.SKIPPED,
    Reason.SHUTTING_DOWN: Outcome.SKIPPED,
    Reason.IO_ERROR: Outcome.FAILED,
    Reason.TIMEOUT: Outcome.FAILED,
    Reason.INVARIANT_ERROR: Outcome.FAILED,
}
"""The outcome each reason belongs to; the attempt counter starts at zero only for these pairs."""


class Area(enum.Enum):
    GENERATION = "generation"
    USABLE_OUTPUT = "usable output"
    LATENCY = "latency"
    CHECKPOINT_LATENCY = "checkpoint latency"
    BACKPRESSURE = "backpressure"
    RELIABILITY = "reliability"
    CADENCE = "cadence"
    RESTORE = "restore"
    RECOVERY = "recovery"
    SNAPSHOT_SIZE = "snapshot size"
    WEIGHTS = "weight updates"
    DRILL_DOWN = "drill-down"
    DELIVERY = "delivery"
    RPC = "rpc"
    REWARDS = "rewards"
    ADMISSION = "admission"
    EFFICIENCY = "efficiency"
    ENGINE = "engine"
    EPISODES = "episodes"


VERSION_BUCKETS: tuple[float, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
"""Staleness in policy versions: small integers, bounded by limits.max_staleness."""
SECONDS_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
"""From 100 µs (an exclusive hold) to 5 min (a long restore or a slow group)."""

FRACTION_BUCKETS: tuple[float, ...] = (
    0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0,
)  # fmt: skip
"""Fractions, logarithmically: a delta's density is typically 0.1-3 %."""


REWARD_BUCKETS: tuple[float, ...] = (
    0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0,
)  # fmt: skip
"""Tenths across [0, 1], where pass/fail and graded rewards live (0 and 1 are bounds, so binary
rewards land exactly), then coarser steps for shaped rewards above 1. No bound is negative: the
Prometheus exposition leaves out a histogram's ``_sum`` and ``_count`` when one is, and the mean
reward is read from those. A negative reward is counted in the first bucket (``le="0"``) and
lowers ``_sum``, which PromQL's ``rate`` reads as a counter reset; the built-in dashboard takes
plain differences and is exact."""


def _values(e: type[enum.Enum], *extra: str) -> tuple[str, ...]:
    return (*[m.value for m in e], *extra)


@dataclass(frozen=True)
class Instrument:
    name: str
    kind: Kind
    unit: str
    description: str
    area: Area
    attributes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Attribute keys and every value they take; counters start at zero for each combination."""
    open_attributes: tuple[str, ...] = ()
    """Attribute keys whose values are not enumerable (e.g. the engine name)."""
    valid: Callable[[Mapping[str, str]], bool] | None = None
    """Restricts the cross product of ``attributes`` to the combinations that can occur."""
    valid_doc: str = ""
    """What ``valid`` admits, in words (for the generated documentation)."""
    bucket_bounds: tuple[float, ...] | None = None
    """A histogram's explicit bucket bounds when its unit is not seconds (or when a semantic
    convention sets them)."""
    meanings: Mapping[str, str] = field(default_factory=dict)
    """What an attribute value means, where its name does not say (for the documentation)."""

    @property
    def buckets(self) -> tuple[float, ...] | None:
        if self.kind is not Kind.HISTOGRAM:
            return None
        if self.bucket_bounds is not None:
            return self.bucket_bounds
        return {"s": SECONDS_BUCKETS, "1": FRACTION_BUCKETS, "{version}": VERSION_BUCKETS}.get(
            self.unit
        )

    def attribute_sets(self) -> list[dict[str, str]]:
        """Every known combination of attribute values (one empty set when there are none)."""
        keys = list(self.attributes)
        combos = (
            dict(zip(keys, values, strict=True))
            for values in itertools.product(*(self.attributes[k] for k in keys))
        )
        return [c for c in combos if self.valid is None or self.valid(c)]


PHASE_ATTR = "phase"
TOTAL = "total"

GENERATION_TOKENS = Instrument(
    "rolloutd.generation.tokens", Kind.OBSERVABLE_COUNTER, "{token}",
    "Tokens generated by the engine (raw throughput), from its cumulative counters.",
    Area.GENERATION, open_attributes=("engine",),
)  # fmt: skip
PROMPT_TOKENS = Instrument(
    "rolloutd.prompt.tokens", Kind.OBSERVABLE_COUNTER, "{token}",
    "Prompt tokens processed by the engine, from its cumulative counters.",
    Area.GENERATION, open_attributes=("engine",),
)  # fmt: skip
COMMITTED_TOKENS = Instrument(
    "rolloutd.committed.tokens", Kind.OBSERVABLE_COUNTER, "{token}",
    "Generated tokens of groups that became training-ready (usable output).",
    Area.USABLE_OUTPUT, attributes={"estimated": ("false", "true")},
)  # fmt: skip
COMMITTED_GROUPS = Instrument(
    "rolloutd.committed.groups", Kind.OBSERVABLE_COUNTER, "{group}",
    "Groups that became training-ready.", Area.USABLE_OUTPUT,
)  # fmt: skip
SOURCE_COMMITTED_GROUPS = Instrument(
    "rolloutd.source.committed.groups", Kind.OBSERVABLE_COUNTER, "{group}",
    "Groups that became training-ready, by the name of their dataset source (one series per "
    "configured source; submitted: a submitted prompt's).", Area.USABLE_OUTPUT,
    open_attributes=("source",),
)  # fmt: skip
SOURCE_COMMITTED_TOKENS = Instrument(
    "rolloutd.source.committed.tokens", Kind.OBSERVABLE_COUNTER, "{token}",
    "Generated tokens of groups that became training-ready, by the name of their dataset "
    "source.", Area.USABLE_OUTPUT, open_attributes=("source",),
)  # fmt: skip
GROUP_COMPLETION = Instrument(
    "rolloutd.group.completion.duration", Kind.HISTOGRAM, "s",
    "Time from a group's admission until all its siblings are staged.", Area.LATENCY,
)  # fmt: skip
GROUP_QUEUE = Instrument(
    "rolloutd.group.queue.duration", Kind.HISTOGRAM, "s",
    "Time a training-ready group waits in the buffer until a trainer first leases it.",
    Area.LATENCY,
)  # fmt: skip
CHECKPOINT_DURATION = Instrument(
    "rolloutd.checkpoint.duration", Kind.HISTOGRAM, "s",
    "Duration of each checkpoint phase, and of the whole attempt (phase=total) for attempts "
    "that ran (completed or failed; skipped attempts are only counted in attempts).",
    Area.CHECKPOINT_LATENCY, attributes={PHASE_ATTR: _values(CheckpointPhase, TOTAL)},
)  # fmt: skip
MUTATION_BLOCKED = Instrument(
    "rolloutd.buffer.mutation.blocked", Kind.COUNTER, "{mutation}",
    "Mutations that had to wait for a checkpoint's exclusive hold.",
    Area.BACKPRESSURE, attributes={"mutation.kind": _values(MutationKind)},
)  # fmt: skip
MUTATION_WAIT = Instrument(
    "rolloutd.buffer.mutation.wait.duration", Kind.HISTOGRAM, "s",
    "How long a blocked mutation waited for the barrier.",
    Area.BACKPRESSURE, attributes={"mutation.kind": _values(MutationKind)},
)  # fmt: skip
CHECKPOINT_ATTEMPTS = Instrument(
    "rolloutd.checkpoint.attempts", Kind.COUNTER, "{attempt}",
    "Checkpoint attempts by outcome, reason and trigger.", Area.RELIABILITY,
    attributes={
        "outcome": _values(Outcome), "reason": _values(Reason), "trigger": _values(Trigger),
    },
    valid=lambda a: REASON_OUTCOME[Reason(a["reason"])].value == a["outcome"],
    valid_doc="each reason occurs with one outcome: "
    + ", ".join(f"{r.value} → {o.value}" for r, o in REASON_OUTCOME.items()),
)  # fmt: skip
CHECKPOINT_CONSECUTIVE_FAILURES = Instrument(
    "rolloutd.checkpoint.consecutive_failures", Kind.OBSERVABLE_GAUGE, "{attempt}",
    "Failed checkpoint attempts in a row; the service turns not-ready at the configured limit.",
    Area.RELIABILITY,
)  # fmt: skip
CHECKPOINT_INTERVAL = Instrument(
    "rolloutd.checkpoint.interval", Kind.OBSERVABLE_GAUGE, "s",
    "Configured periodic checkpoint interval (0: periodic checkpoints off).", Area.CADENCE,
)  # fmt: skip
CHECKPOINT_SINCE_SUCCESS = Instrument(
    "rolloutd.checkpoint.since_success", Kind.OBSERVABLE_GAUGE, "s",
    "Seconds since the snapshot was last known current: a completed checkpoint, or a periodic "
    "one skipped because nothing changed (since start-up if neither).", Area.CADENCE,
)  # fmt: skip
CHECKPOINT_SPACING = Instrument(
    "rolloutd.checkpoint.spacing", Kind.HISTOGRAM, "s",
    "Time between consecutive completed checkpoints.", Area.CADENCE,
)  # fmt: skip
RESTORE_DURATION = Instrument(
    "rolloutd.restore.duration", Kind.HISTOGRAM, "s",
    "Duration of each restore phase, and of the whole restore (phase=total).",
    Area.RESTORE, attributes={PHASE_ATTR: _values(RestorePhase, TOTAL)},
)  # fmt: skip
RECOVERY_GROUPS = Instrument(
    "rolloutd.recovery.groups", Kind.COUNTER, "{group}",
    "Groups found at restore, by the state they were in.",
    Area.RECOVERY, attributes={"state": _values(RecoveryState)},
)  # fmt: skip
RECOVERY_SIBLINGS = Instrument(
    "rolloutd.recovery.siblings", Kind.COUNTER, "{sample}",
    "Siblings of unfinished groups at restore: reused from the snapshot or generated again.",
    Area.RECOVERY, attributes={"disposition": _values(Disposition)},
)  # fmt: skip
RECOVERY_TOKENS = Instrument(
    "rolloutd.recovery.tokens", Kind.COUNTER, "{token}",
    "Partial tokens of unfinished siblings at restore: continued from, or generated again.",
    Area.RECOVERY, attributes={"disposition": _values(TokenDisposition)},
)  # fmt: skip

STEP_FAILURES: tuple[str, ...] = tuple(e.value for e in EpisodeEnd if e.failed)
"""The ways an environment call fails: the failure values of ``EpisodeEnd``."""
RECOVERY_TURNS = Instrument(
    "rolloutd.episode.recovered.turns", Kind.COUNTER, "{turn}",
    "Model turns of episodes a restore brought back: durable turns reused (never generated "
    "again), and the first turn each restored episode generated (rerun: under way at the crash, "
    "continued from its captured tokens or generated again).",
    Area.RECOVERY, attributes={"disposition": _values(Disposition)},
)  # fmt: skip
EPISODE_TURNS = Instrument(
    "rolloutd.episode.turns", Kind.COUNTER, "{turn}",
    "Model turns of episodes generated and made durable, reruns after a restore included (a "
    "turn reused from a restore is counted in rolloutd.episode.recovered.turns only).",
    Area.EPISODES,
)  # fmt: skip
EPISODES = Instrument(
    "rolloutd.episodes", Kind.COUNTER, "{episode}",
    "Episodes finished, by how they ended (their samples' finish reason is episode:<end>).",
    Area.EPISODES, attributes={"end": _values(EpisodeEnd)},
)  # fmt: skip
EPISODE_STEP_DURATION = Instrument(
    "rolloutd.episode.step.duration", Kind.HISTOGRAM, "s",
    "Duration of each live step of an environment (with its state() when it has one), failed "
    "ones too; steps replayed after a restore are left out.", Area.EPISODES,
)  # fmt: skip
EPISODE_STEP_FAILURES = Instrument(
    "rolloutd.episode.step.failures", Kind.COUNTER, "{call}",
    "Environment calls (reset, step, restore) that failed and ended their episode, by reason.",
    Area.EPISODES, attributes={"reason": STEP_FAILURES},
)  # fmt: skip
EPISODE_REPLAY_MISMATCHES = Instrument(
    "rolloutd.episode.replay.mismatches", Kind.COUNTER, "{call}",
    "Environment calls replayed after a restore (an environment without state) that answered "
    "other messages than the recorded ones; the recorded ones are kept.", Area.EPISODES,
)  # fmt: skip

CHECKPOINT_ROWS = Instrument(
    "rolloutd.checkpoint.rows", Kind.GAUGE, "{row}",
    "Rows of the last completed snapshot: new in its delta, removed since the previous, live.",
    Area.SNAPSHOT_SIZE, attributes={"kind": _values(RowKind)},
)  # fmt: skip
CHECKPOINT_SIZE = Instrument(
    "rolloutd.checkpoint.size", Kind.GAUGE, "By",
    "Bytes written by the last completed checkpoint, by part.",
    Area.SNAPSHOT_SIZE, attributes={"part": _values(SizePart)},
)  # fmt: skip
BUFFER_GROUPS = Instrument(
    "rolloutd.buffer.groups", Kind.OBSERVABLE_GAUGE, "{group}",
    "Groups held by the service, by state.", Area.DRILL_DOWN,
    attributes={"state": tuple(s.value for s in BUFFERED)},
)  # fmt: skip
INFLIGHT_SAMPLES = Instrument(
    "rolloutd.inflight.samples", Kind.OBSERVABLE_GAUGE, "{sample}",
    "Sibling requests dispatched to the engine and not yet staged.", Area.DRILL_DOWN,
)  # fmt: skip
ENGINE_REQUESTS = Instrument(
    "rolloutd.engine.requests", Kind.OBSERVABLE_GAUGE, "{request}",
    "Engine requests running or waiting in its scheduler.", Area.DRILL_DOWN,
    attributes={"state": _values(EngineRequestState)}, open_attributes=("engine",),
)  # fmt: skip
ENGINE_KV_CACHE_USAGE = Instrument(
    "rolloutd.engine.kv_cache.usage", Kind.OBSERVABLE_GAUGE, "1",
    "Fraction of the engine's KV cache in use.", Area.DRILL_DOWN, open_attributes=("engine",),
)  # fmt: skip
POLICY_VERSION = Instrument(
    "rolloutd.policy.version", Kind.OBSERVABLE_GAUGE, "{version}",
    "Policy version of the weights the engine generates with.", Area.DRILL_DOWN,
)  # fmt: skip
EVICTED_GROUPS = Instrument(
    "rolloutd.evicted.groups", Kind.COUNTER, "{group}",
    "Groups evicted for being more than max_staleness policy versions old.", Area.DRILL_DOWN,
)  # fmt: skip
WEIGHTS_UPDATE_DURATION = Instrument(
    "rolloutd.weights.update.duration", Kind.HISTOGRAM, "s",
    "Duration of each phase of a weight update attempt that reached it (transfer, verify; pause, "
    "load, resume inside the engine), and of the whole attempt (phase=total).",
    Area.WEIGHTS, attributes={PHASE_ATTR: _values(WeightsPhase, TOTAL)},
)  # fmt: skip
WEIGHTS_BYTES = Instrument(
    "rolloutd.weights.bytes", Kind.COUNTER, "By",
    "Bytes moved by weight update attempts (safetensors files, or a delta), by source, kind "
    "(full, delta) and outcome.",
    Area.WEIGHTS,
    attributes={
        "source": _values(WeightsSource),
        "kind": _values(WeightsKind),
        "outcome": _values(WeightsOutcome),
    },
)  # fmt: skip
WEIGHTS_DELTA_DENSITY = Instrument(
    "rolloutd.weights.delta.density", Kind.HISTOGRAM, "1",
    "Fraction of the elements each delta that was loaded changed.", Area.WEIGHTS,
)  # fmt: skip
WEIGHTS_PAUSE = Instrument(
    "rolloutd.weights.pause.duration", Kind.HISTOGRAM, "s",
    "Generation stopped by each loaded update (start of pause to end of resume), by kind.",
    Area.WEIGHTS, attributes={"kind": _values(WeightsKind)},
)  # fmt: skip
WEIGHTS_UPDATES = Instrument(
    "rolloutd.weights.updates", Kind.COUNTER, "{update}",
    "Weight update attempts, by source and outcome (refused: bad weights that never reached "
    "the engine).",
    Area.WEIGHTS,
    attributes={"source": _values(WeightsSource), "outcome": _values(WeightsOutcome)},
)  # fmt: skip
LEASES_EXPIRED = Instrument(
    "rolloutd.leases.expired", Kind.OBSERVABLE_COUNTER, "{lease}",
    "Leases that expired unacknowledged; their groups became available again.", Area.DELIVERY,
)  # fmt: skip
GROUPS_REQUEUED = Instrument(
    "rolloutd.groups.requeued", Kind.OBSERVABLE_COUNTER, "{group}",
    "Groups made available again, by an expired lease or a Rewind.", Area.DELIVERY,
)  # fmt: skip
ACKED_GROUPS = Instrument(
    "rolloutd.acked.groups", Kind.OBSERVABLE_COUNTER, "{group}",
    "Groups acknowledged by trainers (delivered), over the life of the store.", Area.DELIVERY,
)  # fmt: skip
TRAINER_STEP = Instrument(
    "rolloutd.trainer.step", Kind.OBSERVABLE_GAUGE, "{step}",
    "Highest trainer step acknowledged (a Rewind lowers it); absent before the first ack.",
    Area.DELIVERY,
)  # fmt: skip
DELIVERED_STALENESS = Instrument(
    "rolloutd.delivered.staleness", Kind.HISTOGRAM, "{version}",
    "Policy versions between the weights generating when a group is leased and the weights "
    "that generated it (0: on-policy).", Area.DELIVERY,
)  # fmt: skip
PROMPTS_PENDING = Instrument(
    "rolloutd.prompts.pending", Kind.OBSERVABLE_GAUGE, "{prompt}",
    "Submitted prompts (SubmitPrompts) waiting for admission.", Area.DELIVERY,
)  # fmt: skip

ADMISSION_IN_FLIGHT_LIMIT = Instrument(
    "rolloutd.admission.in_flight.limit", Kind.OBSERVABLE_GAUGE, "{group}",
    "Groups that may be generating or finishing at once, under the reason for the value: fixed "
    "(limits.max_in_flight is a number), or with auto starting, growing, kv_cache_high, "
    "preempted, ceiling or not_limiting. Only the current reason's series has a value.",
    Area.ADMISSION, attributes={"reason": _values(InFlightReason)},
)  # fmt: skip
ADMISSION_CONSUMED_PER_VERSION = Instrument(
    "rolloutd.admission.consumed_per_version", Kind.OBSERVABLE_GAUGE, "{group}",
    "Groups trainers consumed (leased) per policy version, smoothed over versions: the pace "
    "staleness gating admits for. Absent until a version change after a group was leased.",
    Area.ADMISSION,
)  # fmt: skip
ADMISSION_STALENESS_ROOM = Instrument(
    "rolloutd.admission.staleness.room", Kind.OBSERVABLE_GAUGE, "{group}",
    "Groups the staleness gate would still admit: what trainers can consume within "
    "limits.max_staleness versions, less the groups generating, finishing or ready (reported "
    "also when limits.staleness_gating is off).", Area.ADMISSION,
)  # fmt: skip

OTHER = "other"
DROP_REASONS: tuple[str, ...] = _values(DropReason, OTHER)
"""Drop reasons as a series label: the domain's, and ``other`` for whatever a custom finishing
stage names (a stage's reasons are free text; a series is not)."""
FAILURE_KINDS: tuple[str, ...] = _values(ScoreFailure, OTHER)
"""Kinds of failed scores as a series label; ``other`` for a custom stage's failed scores."""


def drop_reason(reason: DropReason | str) -> str:
    """The series label of a drop reason (a custom stage's own reason: ``other``)."""
    known = DropReason.of(reason)
    return known.value if isinstance(known, DropReason) else OTHER


def failure_label(score: SampleScore) -> str:
    """The series label of a failed score's kind (``other``: no known kind)."""
    return OTHER if score.failure is None else score.failure.value


SAMPLE_REWARD = Instrument(
    "rolloutd.sample.reward", Kind.HISTOGRAM, "1",
    "Reward of each scored sample (failed scores have none), by what became of its group.",
    Area.REWARDS, attributes={"outcome": _values(GroupOutcome)}, bucket_bounds=REWARD_BUCKETS,
)  # fmt: skip
GROUP_SCORE_DURATION = Instrument(
    "rolloutd.group.score.duration", Kind.HISTOGRAM, "s",
    "Time the finishing stage took to score a group and decide about it (groups it committed "
    "without scores are left out).", Area.REWARDS,
)  # fmt: skip
SCORING_FAILURES = Instrument(
    "rolloutd.scoring.failures", Kind.COUNTER, "{sample}",
    "Samples whose score failed, by kind (a verifier that raised, timed out, killed its worker, "
    "returned a non-finite or malformed result; an HTTP verifier's error status or absence).",
    Area.REWARDS, attributes={"failure.kind": FAILURE_KINDS},
)  # fmt: skip
DROPPED_GROUPS = Instrument(
    "rolloutd.dropped.groups", Kind.COUNTER, "{group}",
    "Groups dropped before delivery, by reason: before they became training-ready, or when "
    "delivery gave up on them (undeliverable, lease_expiries); their prompt positions count as "
    "consumed.", Area.REWARDS, attributes={"reason": DROP_REASONS},
)  # fmt: skip
DROPPED_TOKENS = Instrument(
    "rolloutd.dropped.tokens", Kind.COUNTER, "{token}",
    "Generated tokens of the dropped groups' siblings: generation wasted, by drop reason.",
    Area.REWARDS, attributes={"reason": DROP_REASONS},
)  # fmt: skip

TOKENS = Instrument(
    "rolloutd.tokens", Kind.OBSERVABLE_UP_DOWN_COUNTER, "{token}",
    "Generated tokens by fate, over the life of the store: every token the engine handed to the "
    "service is in exactly one fate, so the fates add up to the tokens generated. Only buffered "
    "falls (as tokens get a fate), and delivered when a Rewind makes groups available again. A "
    "restore takes them back to its snapshot's: tokens generated after it are counted nowhere.",
    Area.EFFICIENCY, attributes={"fate": _values(TokenFate)},
    meanings={f.value: m for f, m in MEANINGS.items()},
)  # fmt: skip
ENGINE_TIME = Instrument(
    "rolloutd.engine.time", Kind.OBSERVABLE_COUNTER, "s",
    "The engine's time while the service generated, by state, over the life of the store (a "
    "restore takes it back to its snapshot's; time down or restoring is not counted).",
    Area.EFFICIENCY, attributes={"state": _values(EngineState)},
    meanings={s.value: m for s, m in STATES.items()},
)  # fmt: skip
GOODPUT = Instrument(
    "rolloutd.goodput", Kind.OBSERVABLE_GAUGE, "1",
    "Delivered tokens over generated tokens, over the life of the store (absent before any "
    "token).", Area.EFFICIENCY,
)  # fmt: skip

GEN_AI: dict[str, tuple[str, ...]] = {GenAIAttr.OPERATION_NAME: (OPERATION,)}
"""The GenAI metrics' fixed attribute; ``gen_ai.provider.name`` (the engine) and
``gen_ai.request.model`` ride along as open attributes."""
GEN_AI_OPEN = (GenAIAttr.PROVIDER_NAME, GenAIAttr.REQUEST_MODEL)
TIME_TO_FIRST_TOKEN = Instrument(
    "gen_ai.server.time_to_first_token", Kind.HISTOGRAM, "s",
    "Time from an engine request's arrival to its first token (queue and prefill), as the "
    "engine measures it (OpenTelemetry GenAI semantic conventions).",
    Area.ENGINE, attributes=GEN_AI, open_attributes=GEN_AI_OPEN,
    bucket_bounds=(
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    ),
)  # fmt: skip
TIME_PER_OUTPUT_TOKEN = Instrument(
    "gen_ai.server.time_per_output_token", Kind.HISTOGRAM, "s",
    "Decode time per output token after the first, of each finished engine request.",
    Area.ENGINE, attributes=GEN_AI, open_attributes=GEN_AI_OPEN,
    bucket_bounds=(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5),
)  # fmt: skip
REQUEST_DURATION = Instrument(
    "gen_ai.server.request.duration", Kind.HISTOGRAM, "s",
    "Time from an engine request's arrival to its last token, of each finished request.",
    Area.ENGINE, attributes=GEN_AI, open_attributes=GEN_AI_OPEN,
    bucket_bounds=(
        0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
    ),
)  # fmt: skip
TOKEN_USAGE = Instrument(
    "gen_ai.client.token.usage", Kind.HISTOGRAM, "{token}",
    "Input (prompt) and output tokens of each finished engine request.",
    Area.ENGINE,
    attributes={**GEN_AI, GenAIAttr.TOKEN_TYPE: ("input", "output")},
    open_attributes=GEN_AI_OPEN,
    bucket_bounds=tuple(float(4**k) for k in range(14)),
)  # fmt: skip
ENGINE_PREEMPTIONS = Instrument(
    "rolloutd.engine.preemptions", Kind.OBSERVABLE_COUNTER, "{request}",
    "Requests the engine's scheduler preempted (their KV cache freed, to be computed again): "
    "more sequences in flight than the KV cache holds.", Area.ENGINE,
    open_attributes=("engine",),
)  # fmt: skip
ENGINE_PREFIX_CACHE_HIT_RATIO = Instrument(
    "rolloutd.engine.prefix_cache.hit_ratio", Kind.OBSERVABLE_GAUGE, "1",
    "Share of the prompt tokens of the engine's most recent requests (about a thousand) found "
    "in its prefix cache.", Area.ENGINE, open_attributes=("engine",),
)  # fmt: skip

RPC_METHODS: tuple[str, ...] = tuple(
    m.name for m in pb.DESCRIPTOR.services_by_name["RolloutService"].methods
)
RPC_STATUS_CODES: tuple[str, ...] = tuple(str(code.value[0]) for code in grpc.StatusCode)
RPC_SERVER_DURATION = Instrument(
    "rpc.server.duration", Kind.HISTOGRAM, "s",
    "Duration of each RolloutService RPC, by method and gRPC status code (RPC semantic "
    "conventions; rpc.grpc.status_code is the code's number, 0 being OK).",
    Area.RPC,
    attributes={"rpc.method": RPC_METHODS, "rpc.grpc.status_code": RPC_STATUS_CODES},
)  # fmt: skip

CATALOGUE: tuple[Instrument, ...] = tuple(
    v for v in list(globals().values()) if isinstance(v, Instrument)
)
BY_NAME: dict[str, Instrument] = {i.name: i for i in CATALOGUE}

COUNTED_FROM_ZERO: tuple[Instrument, ...] = (
    *(i for i in CATALOGUE if i.kind is Kind.COUNTER),
    COMMITTED_TOKENS,
    COMMITTED_GROUPS,
)
"""Instruments with a series at zero for every declared attribute set from start-up: the
counters, and the observable counters the metrics observer counts itself (over plain integers,
since they move with every committed group)."""
