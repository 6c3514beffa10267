from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import (
    Gauge,
    Histogram,
    HistogramDataPoint,
    InMemoryMetricReader,
    Metric,
    Sum,
)
from opentelemetry.sdk.trace import TracerProvider

from rolloutd.domain.finishing import SampleScore, ScoreStatus, Verdict
from rolloutd.domain.observer import GroupDropped, GroupFinished
from rolloutd.domain.report import CheckpointReport, Outcome, Reason, Trigger
from rolloutd.scoring.results import group_scores
from rolloutd.telemetry.catalogue import (
    BY_NAME,
    CATALOGUE,
    COUNTED_FROM_ZERO,
    FRACTION_BUCKETS,
    REASON_OUTCOME,
    SECONDS_BUCKETS,
    VERSION_BUCKETS,
    Kind,
)
from rolloutd.telemetry.metrics import MetricsObserver
from rolloutd.telemetry.observer import TelemetryObserver
from rolloutd.telemetry.sources import StatusSnapshot
from tests.telemetry.reports import (
    CHECKPOINT_STATE,
    ENGINE,
    MS,
    STATUS,
    T0,
    scripted_run,
)


def collect(reader: InMemoryMetricReader) -> dict[str, Metric]:
    data = reader.get_metrics_data()
    assert data is not None
    return {
        m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
    }


def points(metric: Metric) -> dict[frozenset[tuple[str, Any]], Any]:
    return {frozenset((p.attributes or {}).items()): p for p in metric.data.data_points}


def value(metric: Metric, **attributes: str) -> Any:
    point = points(metric)[frozenset(attributes.items())]
    return point if isinstance(point, HistogramDataPoint) else point.value


def observer_with_sources(provider) -> MetricsObserver:
    observer = MetricsObserver(provider)
    observer.register_sources(
        lambda: ENGINE, "synthetic", lambda: STATUS, lambda: CHECKPOINT_STATE, model="tiny"
    )
    return observer


def test_every_catalogue_instrument_is_created_exactly_once(metric_reader):
    provider, _ = metric_reader
    created = MetricsObserver(provider).created
    assert Counter(created) == Counter(i.name for i in CATALOGUE)


def test_counters_exist_at_zero_for_every_known_attribute_set_before_any_event(metric_reader):
    provider, reader = metric_reader
    MetricsObserver(provider)
    metrics = collect(reader)
    counters = COUNTED_FROM_ZERO
    names = {i.name for i in counters}
    assert {i.name for i in CATALOGUE if i.kind is Kind.COUNTER} < names
    for instrument in counters:
        series = points(metrics[instrument.name])
        expected = {frozenset(s.items()) for s in instrument.attribute_sets()}
        assert set(series) == expected, instrument.name
        assert {p.value for p in series.values()} == {0}, instrument.name
    attempts = points(metrics["rolloutd.checkpoint.attempts"])
    assert len(attempts) == 8 * len(Trigger)  # each reason with its own outcome only


def test_a_scripted_run_reports_every_catalogue_instrument_as_declared(metric_reader):
    provider, reader = metric_reader
    scripted_run(observer_with_sources(provider))
    metrics = collect(reader)

    assert sorted(metrics) == sorted(i.name for i in CATALOGUE)
    for name, metric in metrics.items():
        instrument = BY_NAME[name]
        assert metric.unit == instrument.unit, name
        assert metric.description == instrument.description, name
        expected_type = {
            Kind.COUNTER: Sum, Kind.OBSERVABLE_COUNTER: Sum, Kind.HISTOGRAM: Histogram,
            Kind.GAUGE: Gauge, Kind.OBSERVABLE_GAUGE: Gauge, Kind.OBSERVABLE_UP_DOWN_COUNTER: Sum,
        }[instrument.kind]  # fmt: skip
        assert isinstance(metric.data, expected_type), name
        assert metric.data.data_points, name
        for point in metric.data.data_points:
            attributes = dict(point.attributes or {})
            assert set(attributes) == {*instrument.attributes, *instrument.open_attributes}, name
            for key, val in attributes.items():
                if key in instrument.attributes:
                    assert val in instrument.attributes[key], (name, key, val)


def test_scripted_run_values(metric_reader):
    provider, reader = metric_reader
    scripted_run(observer_with_sources(provider))
    m = collect(reader)

    assert value(m["rolloutd.committed.tokens"], estimated="false") == 256
    assert value(m["rolloutd.committed.tokens"], estimated="true") == 100
    assert value(m["rolloutd.committed.groups"]) == 2
    assert value(m["rolloutd.group.completion.duration"]).sum == pytest.approx(2.25)
    assert value(m["rolloutd.group.queue.duration"]).count == 2
    assert value(m["rolloutd.buffer.mutation.blocked"], **{"mutation.kind": "admit"}) == 1
    assert value(m["rolloutd.buffer.mutation.blocked"], **{"mutation.kind": "ack"}) == 0
    wait = value(m["rolloutd.buffer.mutation.wait.duration"], **{"mutation.kind": "stage_sample"})
    assert wait.sum == pytest.approx(0.002)
    assert value(m["rolloutd.evicted.groups"]) == 2

    committed = value(m["rolloutd.sample.reward"], outcome="committed")
    assert (committed.count, committed.sum) == (2, 1.0)
    dropped = value(m["rolloutd.sample.reward"], outcome="dropped")
    assert (dropped.count, dropped.sum) == (3, 2.0)  # the timed-out score has no reward
    score = value(m["rolloutd.group.score.duration"])  # the unscored commit is left out
    assert (score.count, score.sum) == (3, pytest.approx(30.05))
    failures = m["rolloutd.scoring.failures"]
    assert value(failures, **{"failure.kind": "timeout"}) == 1
    assert sum(p.value for p in points(failures).values()) == 1
    for reason, groups, tokens in [
        ("zero_variance", 1, 10), ("scoring_failed", 1, 10), ("engine_error", 1, 3),
        ("stage_failed", 0, 0), ("other", 0, 0),
    ]:  # fmt: skip
        assert value(m["rolloutd.dropped.groups"], reason=reason) == groups, reason
        assert value(m["rolloutd.dropped.tokens"], reason=reason) == tokens, reason

    attempts = m["rolloutd.checkpoint.attempts"]
    assert value(attempts, outcome="completed", reason="completed", trigger="on_demand") == 1
    assert value(attempts, outcome="completed", reason="completed", trigger="periodic") == 1
    assert value(attempts, outcome="skipped", reason="no_changes", trigger="on_demand") == 1
    assert value(attempts, outcome="failed", reason="io_error", trigger="on_demand") == 1
    assert sum(p.value for p in points(attempts).values()) == 4

    duration = m["rolloutd.checkpoint.duration"]
    assert value(duration, phase="total").count == 3  # the skipped attempt ran no phases
    assert value(duration, phase="buffer_save").count == 3
    assert value(duration, phase="commit").count == 2
    assert value(duration, phase="barrier_wait").sum == pytest.approx(0.003)

    spacing = value(m["rolloutd.checkpoint.spacing"])
    assert (spacing.count, spacing.sum) == (1, pytest.approx(60.0))
    assert value(m["rolloutd.checkpoint.rows"], kind="live") == 512
    assert value(m["rolloutd.checkpoint.size"], part="total") == 4608

    assert value(m["rolloutd.restore.duration"], phase="total").sum == pytest.approx(0.021)
    assert value(m["rolloutd.restore.duration"], phase="redispatch").sum == pytest.approx(0.006)
    assert value(m["rolloutd.recovery.groups"], state="unfinished") == 3
    assert value(m["rolloutd.recovery.siblings"], disposition="reused") == 7
    assert value(m["rolloutd.recovery.tokens"], disposition="reused") == 300
    assert value(m["rolloutd.recovery.tokens"], disposition="regenerated") == 20

    assert value(m["rolloutd.generation.tokens"], engine="synthetic") == 4000
    assert value(m["rolloutd.prompt.tokens"], engine="synthetic") == 900
    assert value(m["rolloutd.engine.requests"], engine="synthetic", state="running") == 3
    assert value(m["rolloutd.engine.requests"], engine="synthetic", state="waiting") == 1
    assert value(m["rolloutd.engine.kv_cache.usage"], engine="synthetic") == 0.25
    assert value(m["rolloutd.buffer.groups"], state="generating") == 4
    assert value(m["rolloutd.buffer.groups"], state="acked") == 0
    assert value(m["rolloutd.inflight.samples"]) == 13
    assert value(m["rolloutd.policy.version"]) == 3
    assert value(m["rolloutd.checkpoint.interval"]) == 60.0
    assert value(m["rolloutd.checkpoint.since_success"]) == 12.5
    assert value(m["rolloutd.checkpoint.consecutive_failures"]) == 1
    limit = m["rolloutd.admission.in_flight.limit"]
    assert value(limit, reason="kv_cache_high") == 12
    assert len(points(limit)) == 1  # only the current reason's series
    assert value(m["rolloutd.admission.consumed_per_version"]) == 6.5
    assert value(m["rolloutd.admission.staleness.room"]) == 3

    assert value(m["rolloutd.tokens"], fate="delivered") == 2400
    assert value(m["rolloutd.tokens"], fate="buffered") == 1020
    assert sum(p.value for p in points(m["rolloutd.tokens"]).values()) == 4000
    assert value(m["rolloutd.engine.time"], state="idle_buffer_full") == 12.5
    assert value(m["rolloutd.goodput"]) == pytest.approx(0.6)
    assert value(m["rolloutd.engine.preemptions"], engine="synthetic") == 6
    assert value(m["rolloutd.engine.prefix_cache.hit_ratio"], engine="synthetic") == 0.75
    gen_ai = {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": "synthetic",
        "gen_ai.request.model": "tiny",
    }
    first = value(m["gen_ai.server.time_to_first_token"], **gen_ai)
    assert (first.count, first.sum) == (2, pytest.approx(0.08))
    duration = value(m["gen_ai.server.request.duration"], **gen_ai)
    assert (duration.count, duration.sum) == (2, pytest.approx(1.04))
    per_token = value(m["gen_ai.server.time_per_output_token"], **gen_ai)
    assert per_token.count == 1  # a one-token request has no time after its first token
    usage = m["gen_ai.client.token.usage"]
    assert value(usage, **gen_ai, **{"gen_ai.token.type": "input"}).sum == 24
    assert value(usage, **gen_ai, **{"gen_ai.token.type": "output"}).sum == 41


def test_goodput_is_absent_before_any_token(metric_reader):
    provider, reader = metric_reader
    observer = MetricsObserver(provider)
    observer.register_sources(
        lambda: ENGINE, "synthetic", lambda: StatusSnapshot(), lambda: CHECKPOINT_STATE
    )
    m = collect(reader)
    assert "rolloutd.goodput" not in m
    assert sum(p.value for p in points(m["rolloutd.tokens"]).values()) == 0


def test_engine_requests_are_not_recorded_before_the_engine_is_known(metric_reader):
    provider, reader = metric_reader
    observer = MetricsObserver(provider)
    observer.first_token(0.1)
    assert "gen_ai.server.time_to_first_token" not in collect(reader)


def test_observable_instruments_report_nothing_until_sources_are_registered(metric_reader):
    """Except those the observer counts itself (``COUNTED_FROM_ZERO``)."""
    provider, reader = metric_reader
    MetricsObserver(provider)
    counted = {i.name for i in COUNTED_FROM_ZERO}
    observable = {i.name for i in CATALOGUE if i.kind.name.startswith("OBSERVABLE")}
    assert observable & counted
    assert (observable - counted).isdisjoint(collect(reader))


@pytest.mark.parametrize("views", [True, False], ids=["views", "advisory"])
def test_histograms_use_the_catalogue_buckets(views, metric_reader, viewed_metric_reader):
    """Seconds get second-scale buckets, policy versions small integers."""
    provider, reader = viewed_metric_reader if views else metric_reader
    scripted_run(MetricsObserver(provider))
    for name, metric in collect(reader).items():
        instrument = BY_NAME[name]
        if instrument.kind is Kind.HISTOGRAM:
            expected = instrument.bucket_bounds or {
                "s": SECONDS_BUCKETS,
                "1": FRACTION_BUCKETS,
                "{version}": VERSION_BUCKETS,
            }.get(instrument.unit)
            assert instrument.buckets == expected, name
            for point in points(metric).values():
                assert tuple(point.explicit_bounds) == expected, name


def test_every_histogram_has_explicit_buckets():
    """The SDK's default buckets suit milliseconds, not seconds nor rewards."""
    assert all(i.buckets for i in CATALOGUE if i.kind is Kind.HISTOGRAM)


def test_a_custom_stages_reasons_and_failures_are_counted_as_other(metric_reader):
    """A custom finishing stage names its own drop reasons and failed scores: the series stay
    bounded, and the group is still counted."""
    provider, reader = metric_reader
    observer = MetricsObserver(provider)
    weird = SampleScore(None, ScoreStatus.FAILED, "my judge is asleep")
    verdict = Verdict("too_long", "", group_scores([weird, SampleScore(0.25)]))
    observer.group_finished(GroupFinished(1, T0, T0 + MS, verdict, 9))
    observer.group_dropped(GroupDropped(1, "too_long", 9))
    m = collect(reader)
    assert value(m["rolloutd.dropped.groups"], reason="other") == 1
    assert value(m["rolloutd.dropped.tokens"], reason="other") == 9
    assert value(m["rolloutd.scoring.failures"], **{"failure.kind": "other"}) == 1
    assert value(m["rolloutd.sample.reward"], outcome="dropped").sum == 0.25


def test_a_combination_the_catalogue_does_not_know_fails_loudly(metric_reader):
    provider, _ = metric_reader
    bogus = CheckpointReport(Trigger.PERIODIC, Outcome.FAILED, Reason.COMPLETED, T0, T0 + MS)
    with pytest.raises(KeyError, match="not in the catalogue"):
        MetricsObserver(provider).checkpoint_attempted(bogus)


def test_the_telemetry_observer_logs_instead_of_raising_into_the_domain(
    metric_reader, span_exporter, caplog
):
    meter_provider, _ = metric_reader
    tracer_provider, spans = span_exporter
    bogus = CheckpointReport(Trigger.PERIODIC, Outcome.FAILED, Reason.COMPLETED, T0, T0 + MS)
    observer = TelemetryObserver(tracer_provider, meter_provider)
    with caplog.at_level(logging.ERROR, logger="rolloutd.telemetry.observer"):
        observer.checkpoint_attempted(bogus)
    assert "checkpoint metrics" in caplog.text
    assert [s.name for s in spans.get_finished_spans()] == ["rolloutd.checkpoint"]


def test_every_checkpoint_reason_belongs_to_one_outcome():
    assert set(REASON_OUTCOME) == set(Reason)
    assert set(REASON_OUTCOME.values()) == set(Outcome)


def test_a_fetchs_exemplar_is_on_its_rpc_duration_not_on_each_group_it_leased(metric_reader):
    """Inside a sampled server span the RPC's duration carries an exemplar of it (the SDK's
    default trace-based filter); the per-group values recorded in the same span carry none."""
    provider, reader = metric_reader
    observer = observer_with_sources(provider)
    tracer = TracerProvider(shutdown_on_exit=False).get_tracer("t")
    with tracer.start_as_current_span("rolloutd.v1.RolloutService/FetchGroups") as span:
        observer.groups_leased([0.25, 0.5, 2.0], [0, 1, 1])
        observer.rpc_finished("FetchGroups", 0, 0.01)
    metrics = collect(reader)
    [rpc] = metrics["rpc.server.duration"].data.data_points
    assert [e.span_id for e in rpc.exemplars] == [span.get_span_context().span_id]
    for name in ("rolloutd.group.queue.duration", "rolloutd.delivered.staleness"):
        [point] = metrics[name].data.data_points
        assert point.count == 3 and not point.exemplars, name
