"""The catalogue histograms' exemplars are the SDK's own: a value recorded inside a sampled span
carries an exemplar of it (the trace-based filter), each bucket keeps the last value offered in
the interval (the aligned-bucket reservoir), and a value recorded outside any span carries none."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider

from rolloutd.telemetry.catalogue import CATALOGUE, Instrument
from rolloutd.telemetry.providers import histogram_views

pytestmark = pytest.mark.usefixtures("clean_env")

BUCKETED = next(i for i in CATALOGUE if i.buckets is not None)


@pytest.fixture
def provider() -> Iterator[tuple[MeterProvider, InMemoryMetricReader]]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(
        metric_readers=[reader], views=histogram_views(), shutdown_on_exit=False
    )
    yield provider, reader
    provider.shutdown()


def points(reader: InMemoryMetricReader, instrument: Instrument) -> list[HistogramDataPoint]:
    data = reader.get_metrics_data()
    assert data is not None
    return [
        point
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == instrument.name
        for point in m.data.data_points  # type: ignore[union-attr]
    ]


def test_every_histogram_with_buckets_has_a_view():
    views = histogram_views()
    assert len(views) == sum(1 for i in CATALOGUE if i.buckets is not None) > 0


def test_a_value_recorded_in_a_span_carries_it_and_one_outside_carries_none(provider):
    meter_provider, reader = provider
    histogram = meter_provider.get_meter("t").create_histogram(BUCKETED.name, unit=BUCKETED.unit)
    assert BUCKETED.buckets is not None
    tracer = TracerProvider(shutdown_on_exit=False).get_tracer("t")
    with tracer.start_as_current_span("call") as span:
        histogram.record(BUCKETED.buckets[0], {"a": "b"})
    histogram.record(BUCKETED.buckets[-1] + 1)  # outside any span: no exemplar
    found = [e for p in points(reader, BUCKETED) for e in p.exemplars]
    assert [(e.value, e.span_id) for e in found] == [
        (BUCKETED.buckets[0], span.get_span_context().span_id)
    ]


def test_each_bucket_keeps_the_last_value_offered_to_it(provider):
    meter_provider, reader = provider
    histogram = meter_provider.get_meter("t").create_histogram(BUCKETED.name, unit=BUCKETED.unit)
    buckets = BUCKETED.buckets
    assert buckets is not None and len(buckets) >= 3
    low, high = buckets[0], (buckets[1] + buckets[2]) / 2
    tracer = TracerProvider(shutdown_on_exit=False).get_tracer("t")
    kept = {}
    for value in (low, high, low, high):
        with tracer.start_as_current_span("call") as span:
            histogram.record(value)
        kept[value] = span.get_span_context().span_id
    [point] = points(reader, BUCKETED)
    assert sorted((e.value, e.span_id) for e in point.exemplars) == sorted(kept.items())
