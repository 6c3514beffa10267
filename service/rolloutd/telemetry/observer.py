"""The observer the domain reports through when telemetry is on: metrics plus spans.

It never raises into the domain: a failure in telemetry (a value the catalogue does not know, a
broken exporter) is logged, at a bounded rate, and the mutation that reported it carries on.
Recording is in-memory (instruments aggregate, finished spans are queued for a background
exporter thread), so nothing here waits on the network.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

from opentelemetry.context import Context
from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import TracerProvider

from rolloutd import __version__
from rolloutd.domain.engine import EngineCounters, FinishedRequest
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.observer import (
    EnvironmentCalled,
    EpisodeEnded,
    EpisodeStarted,
    EpisodeTurn,
    GenerationStarted,
    GroupCommitted,
    GroupDropped,
    GroupFinished,
)
from rolloutd.domain.report import CheckpointReport, RestoreReport
from rolloutd.domain.weights import WeightsReport
from rolloutd.telemetry import spans, throttle
from rolloutd.telemetry.episode_spans import EpisodeSpans
from rolloutd.telemetry.generation import GenerationSpans
from rolloutd.telemetry.metrics import MetricsObserver
from rolloutd.telemetry.score import record_score, scored
from rolloutd.telemetry.sources import CheckpointState, StatusSnapshot
from rolloutd.telemetry.tracer_provider import records_spans
from rolloutd.telemetry.weights import record_weights_update

logger = logging.getLogger(__name__)
logger.addFilter(throttle.SHARED)

TRACER_NAME = "rolloutd"


@contextmanager
def _never_raises(what: str) -> Iterator[None]:
    try:
        yield
    except Exception:
        # Telemetry must never break the host: the domain calls this from inside mutations.
        logger.exception("telemetry failed to record %s; the service carries on", what)


class TelemetryObserver:
    """Implements :class:`rolloutd.domain.observer.Observer`: catalogue metrics and span trees."""

    def __init__(self, tracer_provider: TracerProvider, meter_provider: MeterProvider):
        self.metrics = MetricsObserver(meter_provider)
        self._tracer = tracer_provider.get_tracer(TRACER_NAME, __version__)
        self.generation = GenerationSpans(self._tracer, records_spans(tracer_provider))
        self.episodes = EpisodeSpans(self._tracer, self.generation)

    def register_sources(
        self,
        engine_counters: Callable[[], EngineCounters],
        engine_name: str,
        status: Callable[[], StatusSnapshot],
        checkpoint_state: Callable[[], CheckpointState],
        model: str | None = None,
        dataset_sources: Sequence[str] = (),
    ) -> None:
        """See :meth:`MetricsObserver.register_sources`; ``model`` names the weights on the
        generation spans and the GenAI metrics (``gen_ai.request.model``)."""
        self.metrics.register_sources(
            engine_counters, engine_name, status, checkpoint_state, dataset_sources, model
        )
        self.generation.engine, self.generation.model = engine_name, model

    def first_token(self, seconds: float) -> None:
        """Implements :class:`rolloutd.domain.engine.RequestObserver` (the engine calls it)."""
        with _never_raises("a first token"):
            self.metrics.first_token(seconds)

    def request_finished(self, request: FinishedRequest) -> None:
        with _never_raises("a finished engine request"):
            self.metrics.request_finished(request)

    def rpc_finished(self, method: str, status_code: int, seconds: float) -> None:
        with _never_raises("a finished RPC"):
            self.metrics.rpc_finished(method, status_code, seconds)

    def mutation_blocked(self, kind: MutationKind, wait_s: float) -> None:
        with _never_raises("a blocked mutation"):
            self.metrics.mutation_blocked(kind, wait_s)

    def generation_started(self, event: GenerationStarted) -> Mapping[str, str]:
        with _never_raises("a generation span"):
            return self.generation.started(event)
        return {}

    def generation_abandoned(self, group_id: int, reason: str) -> None:
        with _never_raises("an abandoned generation span"):
            self.generation.abandoned(group_id, reason)

    def group_committed(self, event: GroupCommitted) -> None:
        with _never_raises("a committed group"):
            self.metrics.group_committed(event)
        with _never_raises("a generation span"):
            self.generation.committed(event)

    def group_finished(self, event: GroupFinished) -> None:
        with _never_raises("a finished group"):
            self.metrics.group_finished(event)
        with _never_raises("a score span"):
            parent = self.generation.get(event.group_id)
            if parent is not None and scored(event):
                record_score(self._tracer, parent, event)

    def group_dropped(self, event: GroupDropped) -> None:
        with _never_raises("a dropped group"):
            self.metrics.group_dropped(event)

    def groups_leased(self, queue_s: list[float], staleness: list[int]) -> None:
        with _never_raises("leased groups"):
            self.metrics.groups_leased(queue_s, staleness)

    def groups_evicted(self, count: int) -> None:
        with _never_raises("evicted groups"):
            self.metrics.groups_evicted(count)

    def checkpoint_attempted(self, report: CheckpointReport) -> None:
        self.record_checkpoint(report)

    def restored(self, report: RestoreReport) -> None:
        self.record_restore(report)

    def record_checkpoint(self, report: CheckpointReport, context: Context | None = None) -> None:
        """Like :meth:`checkpoint_attempted`, with the span tree under an explicit parent
        ``context`` (for an attempt reported outside the task of the request that asked for it)."""
        with _never_raises("checkpoint metrics"):
            self.metrics.checkpoint_attempted(report)
        with _never_raises("checkpoint spans"):
            spans.record_checkpoint(self._tracer, report, context)

    def weights_updated(self, report: WeightsReport) -> None:
        """Implements :class:`rolloutd.domain.weights.WeightsObserver`; the span tree joins the
        current span (the ``UpdateWeights`` / ``PushWeights`` server span)."""
        with _never_raises("weight update metrics"):
            self.metrics.weights_updated(report)
        with _never_raises("weight update spans"):
            record_weights_update(self._tracer, report)

    def record_restore(self, report: RestoreReport, context: Context | None = None) -> None:
        with _never_raises("restore metrics"):
            self.metrics.restored(report)
        with _never_raises("restore spans"):
            spans.record_restore(self._tracer, report, context)

    def episode_started(self, event: EpisodeStarted) -> None:
        with _never_raises("an episode span"):
            self.episodes.started(event)

    def episode_turn(self, event: EpisodeTurn) -> None:
        with _never_raises("an episode turn"):
            self.metrics.episode_turn(event)
        with _never_raises("an episode turn span"):
            self.episodes.turn(event)

    def environment_called(self, event: EnvironmentCalled) -> None:
        with _never_raises("an environment call"):
            self.metrics.environment_called(event)
        with _never_raises("an environment call span"):
            self.episodes.called(event)

    def episode_ended(self, event: EpisodeEnded) -> None:
        with _never_raises("an ended episode"):
            self.metrics.episode_ended(event)
        with _never_raises("an episode span"):
            self.episodes.ended(event)
