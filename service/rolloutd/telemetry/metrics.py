"""The metric catalogue as live instruments, fed by the domain's reports and the service's gauges.

Every instrument is created from :mod:`rolloutd.telemetry.catalogue`, and every attribute set
recorded is one the catalogue declares: a value it does not know raises ``KeyError`` (a wrong kind
must fail, not vanish from a series). :class:`~rolloutd.telemetry.observer.TelemetryObserver`
catches and logs that, so the domain never sees it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from opentelemetry.metrics import (
    CallbackOptions,
    Counter,
    Histogram,
    MeterProvider,
    Observation,
    _Gauge,
)
from opentelemetry.trace import INVALID_SPAN, set_span_in_context

from rolloutd import __version__
from rolloutd.domain.engine import EngineCounters, FinishedRequest
from rolloutd.domain.fate import EngineState, TokenFate
from rolloutd.domain.group import BUFFERED, ScoreStatus
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.observer import (
    EnvironmentCalled,
    EpisodeEnded,
    EpisodeTurn,
    GroupCommitted,
    GroupDropped,
    GroupFinished,
)
from rolloutd.domain.report import CheckpointReport, Outcome, RestoreReport
from rolloutd.domain.sampler import SUBMITTED
from rolloutd.domain.weights import WeightsOutcome, WeightsReport
from rolloutd.telemetry import catalogue as cat
from rolloutd.telemetry.catalogue import (
    TOTAL,
    EngineRequestState,
    GroupOutcome,
    Instrument,
    Kind,
    drop_reason,
    failure_label,
)
from rolloutd.telemetry.episode_metrics import EpisodeMetrics
from rolloutd.telemetry.generation import OPERATION, GenAIAttr
from rolloutd.telemetry.series import CatalogueSeries as _Series
from rolloutd.telemetry.sources import CheckpointState, StatusSnapshot

logger = logging.getLogger(__name__)

_NO_SPAN = set_span_in_context(INVALID_SPAN)
"""A context whose span is no span: values recorded in it carry no exemplar (an empty context
would not do: ``record`` takes the current one instead)."""

METER_NAME = "rolloutd"
ENGINE_ATTR = "engine"

Attributes = Mapping[str, str]
ObservableCallback = Callable[[CallbackOptions], Iterable[Observation]]


@dataclass(frozen=True)
class _Sources:
    engine_name: str
    engine_counters: Callable[[], EngineCounters]
    status: Callable[[], StatusSnapshot]
    checkpoint_state: Callable[[], CheckpointState]


class MetricsObserver:
    """Implements :class:`rolloutd.domain.observer.Observer` with the catalogue's instruments.

    Counters start at zero for every attribute set the catalogue declares, so dashboards and
    alerts see every series from start-up. The committed groups and tokens, counted for every
    group, are observable counters over plain integers (from zero as well); the other observable
    instruments read the callbacks given to :meth:`register_sources` (until then they report
    nothing). Not thread-safe for the observer calls (they come from the event loop); the
    callbacks run on reader threads.
    """

    def __init__(self, meter_provider: MeterProvider):
        self._meter = meter_provider.get_meter(METER_NAME, __version__)
        self.created: list[str] = []
        """Names of the instruments created, in catalogue order (a test checks one-to-one)."""
        self.episodes = EpisodeMetrics(self._counter, self._histogram)
        self._sources: _Sources | None = None
        self._last_completed_ns: int | None = None
        self._committed_groups = 0
        self._committed_tokens = {"false": 0, "true": 0}
        self._by_source: dict[str, list[int]] = {SUBMITTED: [0, 0]}
        """Source name -> [committed groups, committed tokens], from zero for each configured
        source (:meth:`register_sources`) and for submitted prompts: a bounded set."""
        """By ``estimated``. Both are added to on the event loop for every committed group and
        read at collection time: a synchronous counter's add costs microseconds per group."""

        self._group_completion = self._histogram(cat.GROUP_COMPLETION)
        self._group_queue = self._histogram(cat.GROUP_QUEUE)
        self._delivered_staleness = self._histogram(cat.DELIVERED_STALENESS)
        self._checkpoint_duration = self._histogram(cat.CHECKPOINT_DURATION)
        self._mutation_blocked = self._counter(cat.MUTATION_BLOCKED)
        self._mutation_wait = self._histogram(cat.MUTATION_WAIT)
        self._checkpoint_attempts = self._counter(cat.CHECKPOINT_ATTEMPTS)
        self._checkpoint_spacing = self._histogram(cat.CHECKPOINT_SPACING)
        self._restore_duration = self._histogram(cat.RESTORE_DURATION)
        self._recovery_groups = self._counter(cat.RECOVERY_GROUPS)
        self._recovery_siblings = self._counter(cat.RECOVERY_SIBLINGS)
        self._recovery_tokens = self._counter(cat.RECOVERY_TOKENS)
        self._checkpoint_rows = self._gauge(cat.CHECKPOINT_ROWS)
        self._checkpoint_size = self._gauge(cat.CHECKPOINT_SIZE)
        self._evicted_groups = self._counter(cat.EVICTED_GROUPS)
        self._weights_duration = self._histogram(cat.WEIGHTS_UPDATE_DURATION)
        self._weights_bytes = self._counter(cat.WEIGHTS_BYTES)
        self._weights_updates = self._counter(cat.WEIGHTS_UPDATES)
        self._weights_density = self._histogram(cat.WEIGHTS_DELTA_DENSITY)
        self._weights_pause = self._histogram(cat.WEIGHTS_PAUSE)
        self._rpc_duration = self._histogram(cat.RPC_SERVER_DURATION)
        self._sample_reward = self._histogram(cat.SAMPLE_REWARD)
        self._score_duration = self._histogram(cat.GROUP_SCORE_DURATION)
        self._scoring_failures = self._counter(cat.SCORING_FAILURES)
        self._dropped_groups = self._counter(cat.DROPPED_GROUPS)
        self._dropped_tokens = self._counter(cat.DROPPED_TOKENS)
        self._first_token = self._histogram(cat.TIME_TO_FIRST_TOKEN)
        self._per_output_token = self._histogram(cat.TIME_PER_OUTPUT_TOKEN)
        self._request_duration = self._histogram(cat.REQUEST_DURATION)
        self._token_usage = self._histogram(cat.TOKEN_USAGE)
        self._gen_ai: tuple[Attributes, Attributes, Attributes] | None = None
        """The GenAI metrics' attributes (the request's, its input's, its output's), once the
        engine is known (:meth:`register_sources`); nothing is recorded before."""

        self._observable(cat.COMMITTED_TOKENS, self._observe_committed_tokens)
        self._observable(cat.COMMITTED_GROUPS, self._observe_committed_groups)
        self._observable(cat.SOURCE_COMMITTED_GROUPS, self._observe_source(0))
        self._observable(cat.SOURCE_COMMITTED_TOKENS, self._observe_source(1))
        self._observable(cat.GENERATION_TOKENS, self._observe_generation_tokens)
        self._observable(cat.PROMPT_TOKENS, self._observe_prompt_tokens)
        self._observable(cat.CHECKPOINT_CONSECUTIVE_FAILURES, self._observe_failures)
        self._observable(cat.CHECKPOINT_INTERVAL, self._observe_interval)
        self._observable(cat.CHECKPOINT_SINCE_SUCCESS, self._observe_since_success)
        self._observable(cat.BUFFER_GROUPS, self._observe_buffer_groups)
        self._observable(cat.INFLIGHT_SAMPLES, self._observe_inflight)
        self._observable(cat.ENGINE_REQUESTS, self._observe_engine_requests)
        self._observable(cat.ENGINE_KV_CACHE_USAGE, self._observe_kv_cache)
        self._observable(cat.POLICY_VERSION, self._observe_policy_version)
        self._observable(cat.LEASES_EXPIRED, self._observe_leases_expired)
        self._observable(cat.GROUPS_REQUEUED, self._observe_groups_requeued)
        self._observable(cat.PROMPTS_PENDING, self._observe_prompts_pending)
        self._observable(cat.ACKED_GROUPS, self._observe_acked_groups)
        self._observable(cat.TRAINER_STEP, self._observe_trainer_step)
        self._observable(cat.TOKENS, self._observe_tokens)
        self._observable(cat.ENGINE_TIME, self._observe_engine_time)
        self._observable(cat.GOODPUT, self._observe_goodput)
        self._observable(cat.ENGINE_PREEMPTIONS, self._observe_preemptions)
        self._observable(cat.ENGINE_PREFIX_CACHE_HIT_RATIO, self._observe_prefix_cache)
        self._observable(cat.ADMISSION_IN_FLIGHT_LIMIT, self._observe_in_flight_limit)
        self._observable(cat.ADMISSION_CONSUMED_PER_VERSION, self._observe_consumed_per_version)
        self._observable(cat.ADMISSION_STALENESS_ROOM, self._observe_staleness_room)

        self._estimated = _Series(cat.COMMITTED_TOKENS)
        self._mutation_kind = _Series(cat.MUTATION_BLOCKED)
        self._checkpoint_phase = _Series(cat.CHECKPOINT_DURATION)
        self._attempt = _Series(cat.CHECKPOINT_ATTEMPTS)
        self._restore_phase = _Series(cat.RESTORE_DURATION)
        self._recovery_state = _Series(cat.RECOVERY_GROUPS)
        self._disposition = _Series(cat.RECOVERY_SIBLINGS)
        self._token_disposition = _Series(cat.RECOVERY_TOKENS)
        self._row_kind = _Series(cat.CHECKPOINT_ROWS)
        self._size_part = _Series(cat.CHECKPOINT_SIZE)
        self._group_state = _Series(cat.BUFFER_GROUPS)
        self._request_state = _Series(cat.ENGINE_REQUESTS)
        self._weights_phase = _Series(cat.WEIGHTS_UPDATE_DURATION)
        self._weights_attempt = _Series(cat.WEIGHTS_UPDATES)
        self._weights_moved = _Series(cat.WEIGHTS_BYTES)
        self._weights_kind = _Series(cat.WEIGHTS_PAUSE)
        self._rpc = _Series(cat.RPC_SERVER_DURATION)
        self._group_outcome = _Series(cat.SAMPLE_REWARD)
        self._failure_kind = _Series(cat.SCORING_FAILURES)
        self._drop_reason = _Series(cat.DROPPED_GROUPS)
        self._fate = _Series(cat.TOKENS)
        self._engine_state = _Series(cat.ENGINE_TIME)
        self._token_type = _Series(cat.TOKEN_USAGE)
        self._gen_ai_operation = _Series(cat.REQUEST_DURATION)
        self._in_flight_reason = _Series(cat.ADMISSION_IN_FLIGHT_LIMIT)

        self._start_counters_at_zero()

    # -- creation -------------------------------------------------------------------------------

    def _created(self, instrument: Instrument, kind: Kind) -> None:
        if instrument.kind is not kind:
            raise TypeError(f"{instrument.name} is a {instrument.kind.value}, not a {kind.value}")
        self.created.append(instrument.name)

    def _counter(self, instrument: Instrument) -> Counter:
        self._created(instrument, Kind.COUNTER)
        return self._meter.create_counter(instrument.name, instrument.unit, instrument.description)

    def _histogram(self, instrument: Instrument) -> Histogram:
        self._created(instrument, Kind.HISTOGRAM)
        return self._meter.create_histogram(
            instrument.name,
            instrument.unit,
            instrument.description,
            explicit_bucket_boundaries_advisory=instrument.buckets,
        )

    def _gauge(self, instrument: Instrument) -> _Gauge:
        self._created(instrument, Kind.GAUGE)
        return self._meter.create_gauge(instrument.name, instrument.unit, instrument.description)

    def _observable(self, instrument: Instrument, callback: ObservableCallback) -> None:
        if instrument.kind is Kind.OBSERVABLE_COUNTER:
            self._created(instrument, Kind.OBSERVABLE_COUNTER)
            self._meter.create_observable_counter(
                instrument.name, [callback], instrument.unit, instrument.description
            )
        elif instrument.kind is Kind.OBSERVABLE_UP_DOWN_COUNTER:
            self._created(instrument, Kind.OBSERVABLE_UP_DOWN_COUNTER)
            self._meter.create_observable_up_down_counter(
                instrument.name, [callback], instrument.unit, instrument.description
            )
        else:
            self._created(instrument, Kind.OBSERVABLE_GAUGE)
            self._meter.create_observable_gauge(
                instrument.name, [callback], instrument.unit, instrument.description
            )

    def _start_counters_at_zero(self) -> None:
        counters: list[tuple[Counter, Instrument]] = [
            (self._mutation_blocked, cat.MUTATION_BLOCKED),
            (self._checkpoint_attempts, cat.CHECKPOINT_ATTEMPTS),
            (self._recovery_groups, cat.RECOVERY_GROUPS),
            (self._recovery_siblings, cat.RECOVERY_SIBLINGS),
            (self._recovery_tokens, cat.RECOVERY_TOKENS),
            (self._evicted_groups, cat.EVICTED_GROUPS),
            (self._weights_bytes, cat.WEIGHTS_BYTES),
            (self._weights_updates, cat.WEIGHTS_UPDATES),
            (self._scoring_failures, cat.SCORING_FAILURES),
            (self._dropped_groups, cat.DROPPED_GROUPS),
            (self._dropped_tokens, cat.DROPPED_TOKENS),
        ]
        for counter, instrument in counters:
            for attributes in _Series(instrument).all():
                counter.add(0, attributes)

    def register_sources(
        self,
        engine_counters: Callable[[], EngineCounters],
        engine_name: str,
        status: Callable[[], StatusSnapshot],
        checkpoint_state: Callable[[], CheckpointState],
        dataset_sources: Sequence[str] = (),
        model: str | None = None,
    ) -> None:
        """Connects the observable instruments; the callbacks run on reader threads (see
        :mod:`rolloutd.telemetry.sources`). Calling again replaces the previous sources.
        ``dataset_sources``: the names of the dataset's sources, counted from zero; ``model``:
        what the engine serves (``gen_ai.request.model``)."""
        self._sources = _Sources(engine_name, engine_counters, status, checkpoint_state)
        for name in dataset_sources:
            self._by_source.setdefault(name, [0, 0])
        request = {**self._gen_ai_operation(OPERATION), GenAIAttr.PROVIDER_NAME: engine_name}
        if model is not None:
            request[GenAIAttr.REQUEST_MODEL] = model
        self._gen_ai = (
            MappingProxyType(request),
            MappingProxyType({**self._token_type(OPERATION, "input"), **request}),
            MappingProxyType({**self._token_type(OPERATION, "output"), **request}),
        )

    # -- Observer -------------------------------------------------------------------------------

    def mutation_blocked(self, kind: MutationKind, wait_s: float) -> None:
        attributes = self._mutation_kind(kind)
        self._mutation_blocked.add(1, attributes)
        self._mutation_wait.record(wait_s, attributes)

    def group_committed(self, event: GroupCommitted) -> None:
        self._committed_groups += 1
        self._committed_tokens["false" if event.exact else "true"] += event.tokens
        if event.source:
            counts = self._by_source.setdefault(event.source, [0, 0])
            counts[0] += 1
            counts[1] += event.tokens
        self._group_completion.record(event.completion_s)

    def group_finished(self, event: GroupFinished) -> None:
        """Rewards, failed scores and the stage's time of a group the stage scored or dropped;
        a group it committed without scores (no verifier) records nothing."""
        verdict = event.verdict
        if verdict.scores is None and verdict.commits:
            return
        self._score_duration.record(max(event.ended_ns - event.started_ns, 0) / 1e9)
        if verdict.scores is None:
            return
        outcome = self._group_outcome(
            GroupOutcome.COMMITTED if verdict.commits else GroupOutcome.DROPPED
        )
        for score in verdict.scores.samples:
            if score.status is ScoreStatus.FAILED:
                self._scoring_failures.add(1, self._failure_kind(failure_label(score)))
            elif score.reward is not None:
                self._sample_reward.record(score.reward, outcome)

    def group_dropped(self, event: GroupDropped) -> None:
        attributes = self._drop_reason(drop_reason(event.reason))
        self._dropped_groups.add(1, attributes)
        self._dropped_tokens.add(event.tokens, attributes)

    def groups_leased(self, queue_s: list[float], staleness: list[int]) -> None:
        """Recorded without the current span: each group's values would otherwise carry an
        exemplar of the fetch's span, the one the fetch's ``rpc.server.duration`` already
        carries, at the cost of an exemplar per group."""
        for seconds in queue_s:
            self._group_queue.record(seconds, context=_NO_SPAN)
        for versions in staleness:
            self._delivered_staleness.record(versions, context=_NO_SPAN)

    def groups_evicted(self, count: int) -> None:
        self._evicted_groups.add(count)

    def checkpoint_attempted(self, report: CheckpointReport) -> None:
        self._checkpoint_attempts.add(
            1, self._attempt(report.outcome, report.reason, report.trigger)
        )
        if report.outcome is Outcome.SKIPPED:
            return
        for phase in report.phases:
            self._checkpoint_duration.record(phase.seconds, self._checkpoint_phase(phase.phase))
        self._checkpoint_duration.record(report.seconds, self._checkpoint_phase(TOTAL))
        if report.outcome is not Outcome.COMPLETED:
            return
        if self._last_completed_ns is not None:
            spacing_s = (report.ended_ns - self._last_completed_ns) / 1e9
            self._checkpoint_spacing.record(max(spacing_s, 0.0))
        self._last_completed_ns = report.ended_ns
        for row_kind, rows in report.rows.items():
            self._checkpoint_rows.set(rows, self._row_kind(row_kind))
        for part, size in report.size_bytes.items():
            self._checkpoint_size.set(size, self._size_part(part))

    def rpc_finished(self, method: str, status_code: int, seconds: float) -> None:
        """One RolloutService RPC handled (called by the server interceptor, not the domain)."""
        self._rpc_duration.record(seconds, self._rpc(method, str(status_code)))

    def restored(self, report: RestoreReport) -> None:
        if report.sequence is None and not (report.skipped or report.replayed or report.error):
            return  # nothing to restore (a fresh store): no restore to time or count
        for phase in report.phases:
            self._restore_duration.record(phase.seconds, self._restore_phase(phase.phase))
        self._restore_duration.record(report.seconds, self._restore_phase(TOTAL))
        for state, groups in report.groups.items():
            self._recovery_groups.add(groups, self._recovery_state(state))
        for disposition, siblings in report.siblings.items():
            self._recovery_siblings.add(siblings, self._disposition(disposition))
        for token_disposition, tokens in report.tokens.items():
            self._recovery_tokens.add(tokens, self._token_disposition(token_disposition))

    def episode_turn(self, event: EpisodeTurn) -> None:
        self.episodes.turn(event)

    def environment_called(self, event: EnvironmentCalled) -> None:
        self.episodes.called(event)

    def episode_ended(self, event: EpisodeEnded) -> None:
        self.episodes.ended(event)

    def weights_updated(self, report: WeightsReport) -> None:
        for phase in report.phases:
            self._weights_duration.record(phase.seconds, self._weights_phase(phase.phase))
        self._weights_duration.record(report.seconds, self._weights_phase(TOTAL))
        attempt = self._weights_attempt(report.source, report.outcome)
        self._weights_updates.add(1, attempt)
        self._weights_bytes.add(
            report.bytes, self._weights_moved(report.source, report.kind, report.outcome)
        )
        if report.outcome is WeightsOutcome.LOADED:
            self._weights_pause.record(report.paused_s, self._weights_kind(report.kind))
            if report.density is not None:
                self._weights_density.record(report.density)

    # -- the engine's requests (RequestObserver) -----------------------------------------------

    def first_token(self, seconds: float) -> None:
        if self._gen_ai is not None:
            self._first_token.record(seconds, self._gen_ai[0])

    def request_finished(self, request: FinishedRequest) -> None:
        if self._gen_ai is None:
            return
        attributes, input_tokens, output_tokens = self._gen_ai
        self._request_duration.record(request.duration_s, attributes)
        if request.time_per_output_token_s is not None:
            self._per_output_token.record(request.time_per_output_token_s, attributes)
        self._token_usage.record(request.input_tokens, input_tokens)
        self._token_usage.record(request.output_tokens, output_tokens)

    # -- observable callbacks (reader threads) --------------------------------------------------

    def _observe_committed_groups(self, _: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._committed_groups)]

    def _observe_source(self, column: int) -> ObservableCallback:
        def observe(_: CallbackOptions) -> Iterable[Observation]:
            if self._sources is None:
                return []  # the sources' names are not known yet
            return [
                Observation(counts[column], {"source": name})
                for name, counts in list(self._by_source.items())
            ]

        return observe

    def _observe_committed_tokens(self, _: CallbackOptions) -> Iterable[Observation]:
        return [Observation(n, self._estimated(key)) for key, n in self._committed_tokens.items()]

    def _engine(self) -> tuple[str, EngineCounters] | None:
        sources = self._sources
        return None if sources is None else (sources.engine_name, sources.engine_counters())

    def _observe_generation_tokens(self, _: CallbackOptions) -> Iterable[Observation]:
        if (engine := self._engine()) is None:
            return []
        name, counters = engine
        return [Observation(counters.generation_tokens, {ENGINE_ATTR: name})]

    def _observe_prompt_tokens(self, _: CallbackOptions) -> Iterable[Observation]:
        if (engine := self._engine()) is None:
            return []
        name, counters = engine
        return [Observation(counters.prompt_tokens, {ENGINE_ATTR: name})]

    def _observe_engine_requests(self, _: CallbackOptions) -> Iterable[Observation]:
        if (engine := self._engine()) is None:
            return []
        name, counters = engine
        running = self._request_state(EngineRequestState.RUNNING)
        waiting = self._request_state(EngineRequestState.WAITING)
        return [
            Observation(counters.requests_running, {**running, ENGINE_ATTR: name}),
            Observation(counters.requests_waiting, {**waiting, ENGINE_ATTR: name}),
        ]

    def _observe_kv_cache(self, _: CallbackOptions) -> Iterable[Observation]:
        if (engine := self._engine()) is None:
            return []
        name, counters = engine
        return [Observation(counters.kv_cache_usage, {ENGINE_ATTR: name})]

    def _status(self) -> StatusSnapshot | None:
        sources = self._sources
        return None if sources is None else sources.status()

    def _observe_buffer_groups(self, _: CallbackOptions) -> Iterable[Observation]:
        if (status := self._status()) is None:
            return []
        return [
            Observation(status.groups.get(state, 0), self._group_state(state)) for state in BUFFERED
        ]

    def _observe_inflight(self, _: CallbackOptions) -> Iterable[Observation]:
        if (status := self._status()) is None:
            return []
        return [Observation(status.inflight_samples)]

    def _observe_policy_version(self, _: CallbackOptions) -> Iterable[Observation]:
        if (status := self._status()) is None:
            return []
        return [Observation(status.policy_version)]

    def _observe_leases_expired(self, _: CallbackOptions) -> Iterable[Observation]:
        if (status := self._status()) is None:
            return []
        return [Observation(status.expired_leases)]

    def _observe_groups_requeued(self, _: CallbackOptions) -> Iterable[Observation]:
        if (status := self._status()) is None:
            return []
        return [Observation(status.requeued_groups)]

    def _observe_prompts_pending(self, _: CallbackOptions) -> Iterable[Observation]:
        if (status := self._status()) is None:
            return []
        return [Observation(status.pending_prompts)]

    def _observe_acked_groups(self, _: CallbackOptions) -> Iterable[Observation]:
        if (status := self._status()) is None:
            return []
        return [Observation(status.acked_groups)]

    def _observe_trainer_step(self, _: CallbackOptions) -> Iterable[Observation]:
        if (status := self._status()) is None or status.trainer_step < 0:
            return []  # no trainer has acked yet: no value, rather than a step that never was
        return [Observation(status.trainer_step)]

    def _observe_tokens(self, _: CallbackOptions) -> Iterable[Observation]:
        if (status := self._status()) is None:
            return []
        fates = status.token_fates
        return [Observation(fates.get(f, 0), self._fate(f)) for f in TokenFate]

    def _observe_engine_time(self, _: CallbackOptions) -> Iterable[Observation]:
        if (status := self._status()) is None:
            return []
        seconds = status.engine_seconds
        return [Observation(seconds.get(s, 0.0), self._engine_state(s)) for s in EngineState]

    def _observe_goodput(self, _: CallbackOptions) -> Iterable[Observation]:
        if (status := self._status()) is None or not status.generated_tokens:
            return []  # nothing generated: no ratio, rather than a zero that looks like waste
        delivered = status.token_fates.get(TokenFate.DELIVERED, 0)
        return [Observation(delivered / status.generated_tokens)]

    def _observe_preemptions(self, _: CallbackOptions) -> Iterable[Observation]:
        if (engine := self._engine()) is None:
            return []
        name, counters = engine
        return [Observation(counters.preemptions, {ENGINE_ATTR: name})]

    def _observe_prefix_cache(self, _: CallbackOptions) -> Iterable[Observation]:
        if (engine := self._engine()) is None:
            return []
        name, counters = engine
        return [Observation(counters.prefix_cache_hit_ratio, {ENGINE_ATTR: name})]

    def _observe_in_flight_limit(self, _: CallbackOptions) -> Iterable[Observation]:
        if (status := self._status()) is None:
            return []
        return [
            Observation(status.in_flight_limit, self._in_flight_reason(status.in_flight_reason))
        ]

    def _observe_consumed_per_version(self, _: CallbackOptions) -> Iterable[Observation]:
        if (status := self._status()) is None or status.consumed_per_version is None:
            return []  # not measured yet: no value, rather than a pace of zero
        return [Observation(status.consumed_per_version)]

    def _observe_staleness_room(self, _: CallbackOptions) -> Iterable[Observation]:
        if (status := self._status()) is None:
            return []
        return [Observation(status.staleness_room)]

    def _checkpoint_state(self) -> CheckpointState | None:
        sources = self._sources
        return None if sources is None else sources.checkpoint_state()

    def _observe_failures(self, _: CallbackOptions) -> Iterable[Observation]:
        if (state := self._checkpoint_state()) is None:
            return []
        return [Observation(state.consecutive_failures)]

    def _observe_interval(self, _: CallbackOptions) -> Iterable[Observation]:
        if (state := self._checkpoint_state()) is None:
            return []
        return [Observation(state.interval_s)]

    def _observe_since_success(self, _: CallbackOptions) -> Iterable[Observation]:
        if (state := self._checkpoint_state()) is None:
            return []
        return [Observation(state.since_success_s)]
