"""The episode instruments of the catalogue, fed by the episode events the runner reports
(:mod:`rolloutd.domain.observer`): turns made durable, turns a restore recovered, environment
steps' durations and failures, replay mismatches, and episodes by how they ended.

Counted as they happen, turn by turn, so that ``/metrics`` read right after a restore already
holds the turns it reused (a benchmark reads them before the next SIGKILL).
"""

from __future__ import annotations

from collections.abc import Callable

from opentelemetry.metrics import Counter, Histogram

from rolloutd.domain.observer import EnvironmentCall, EnvironmentCalled, EpisodeEnded, EpisodeTurn
from rolloutd.domain.report import Disposition
from rolloutd.telemetry import catalogue as cat
from rolloutd.telemetry.catalogue import Instrument
from rolloutd.telemetry.series import CatalogueSeries


class EpisodeMetrics:
    """Created by :class:`~rolloutd.telemetry.metrics.MetricsObserver` with its instrument
    factories; its counters start at zero for every declared attribute set."""

    def __init__(
        self,
        counter: Callable[[Instrument], Counter],
        histogram: Callable[[Instrument], Histogram],
    ) -> None:
        self._recovered = counter(cat.RECOVERY_TURNS)
        self._turns = counter(cat.EPISODE_TURNS)
        self._episodes = counter(cat.EPISODES)
        self._step_duration = histogram(cat.EPISODE_STEP_DURATION)
        self._step_failures = counter(cat.EPISODE_STEP_FAILURES)
        self._replay_mismatches = counter(cat.EPISODE_REPLAY_MISMATCHES)
        self._disposition = CatalogueSeries(cat.RECOVERY_TURNS)
        self._end = CatalogueSeries(cat.EPISODES)
        self._reason = CatalogueSeries(cat.EPISODE_STEP_FAILURES)
        for instrument, created in (
            (cat.RECOVERY_TURNS, self._recovered),
            (cat.EPISODE_TURNS, self._turns),
            (cat.EPISODES, self._episodes),
            (cat.EPISODE_STEP_FAILURES, self._step_failures),
            (cat.EPISODE_REPLAY_MISMATCHES, self._replay_mismatches),
        ):
            for attributes in CatalogueSeries(instrument).all():
                created.add(0, attributes)

    def turn(self, event: EpisodeTurn) -> None:
        if event.recovered is not None:
            self._recovered.add(1, self._disposition(event.recovered))
        if event.recovered is not Disposition.REUSED:
            self._turns.add(1)

    def called(self, event: EnvironmentCalled) -> None:
        if event.mismatch:
            self._replay_mismatches.add(1)
        if event.failure is not None:
            self._step_failures.add(1, self._reason(event.failure))
        if event.call is EnvironmentCall.STEP and not event.replay:
            self._step_duration.record(max(event.ended_ns - event.started_ns, 0) / 1e9)

    def ended(self, event: EpisodeEnded) -> None:
        if event.end is not None:
            self._episodes.add(1, self._end(event.end))
