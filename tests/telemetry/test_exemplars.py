"""The catalogue histograms' exemplar reservoir keeps what the SDK's aligned-bucket reservoir
keeps: the last value offered in each bucket, with its span and the attributes the point does
not have; and the service's meter provider uses it for every histogram with buckets."""

from __future__ import annotations

import random

import pytest
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.metrics import AlignedHistogramBucketExemplarReservoir, MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from rolloutd.telemetry.catalogue import CATALOGUE
from rolloutd.telemetry.exemplars import LastInBucket
from rolloutd.telemetry.providers import histogram_views

pytestmark = pytest.mark.usefixtures("clean_env")

BOUNDARIES = [0.0, 0.005, 0.01, 0.05, 0.1, 1.0, 10.0]


def in_span(span_id: int) -> Context:
    context = SpanContext(0xABC, span_id, is_remote=False, trace_flags=TraceFlags(1))
    return trace.set_span_in_context(NonRecordingSpan(context))


def exemplars(reservoir, point: dict) -> list[tuple]:
    return [
        (e.filtered_attributes, e.value, e.time_unix_nano, e.span_id, e.trace_id)
        for e in reservoir.collect(point)
    ]


def test_it_keeps_what_the_sdks_aligned_reservoir_keeps():
    ours, sdk = LastInBucket(BOUNDARIES), AlignedHistogramBucketExemplarReservoir(BOUNDARIES)
    rng = random.Random(7)
    values = [*BOUNDARIES, -1.0, 20.0, *(rng.uniform(-0.5, 12.0) for _ in range(200))]
    for collection in range(3):
        for i, value in enumerate(values[: 60 * (collection + 1)]):
            attributes = {"rpc.method": "FetchGroups", "extra": i} if i % 3 else None
            for reservoir in (ours, sdk):
                reservoir.offer(value, 1_000 + i, attributes, in_span(i + 1))
        point = {"rpc.method": "FetchGroups"}
        kept = exemplars(ours, point)
        assert kept == exemplars(sdk, point)
        assert len(kept) == len(BOUNDARIES) + 1  # every bucket, the overflow one included
    assert exemplars(ours, {}) == exemplars(sdk, {}) == []  # a collection starts them anew


def test_every_histogram_with_buckets_samples_exemplars_through_it():
    views = histogram_views()
    assert len(views) == sum(1 for i in CATALOGUE if i.buckets is not None) > 0
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], views=views, shutdown_on_exit=False)
    instrument = next(i for i in CATALOGUE if i.buckets is not None)
    name = instrument.name
    histogram = provider.get_meter("t").create_histogram(name, unit=instrument.unit)
    tracer = TracerProvider(shutdown_on_exit=False).get_tracer("t")
    with tracer.start_as_current_span("call") as span:
        histogram.record(instrument.buckets[0], {"a": "b"})
    histogram.record(instrument.buckets[-1] + 1)  # outside any span: no exemplar
    [metric] = [
        m
        for rm in reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == name
    ]
    points = list(metric.data.data_points)
    found = [e for p in points for e in p.exemplars]
    assert [(e.value, e.span_id) for e in found] == [
        (instrument.buckets[0], span.get_span_context().span_id)
    ]
    provider.shutdown()


def test_a_value_offered_outside_any_span_carries_no_span():
    """(Only a filter other than the default trace-based one offers such values. The SDK's
    reservoir would keep the span of the bucket's previous value.)"""
    reservoir = LastInBucket(BOUNDARIES)
    reservoir.offer(0.5, 1, None, in_span(9))
    reservoir.offer(0.6, 2, None, Context())
    assert exemplars(reservoir, {}) == [(None, 0.6, 2, None, None)]
