"""The SDK members that :mod:`rolloutd.telemetry.otel_sdk` overrides are still there and still do
what the overrides rely on; an upgrade of opentelemetry-sdk that moves one fails here first."""

from __future__ import annotations

import inspect
import json

import pytest
from opentelemetry.metrics import NoOpMeter
from opentelemetry.sdk.metrics import Meter, MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, Tracer, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import SpanKind

from rolloutd.telemetry.light_spans import LightTracer
from rolloutd.telemetry.otel_sdk import GatedTracerProvider, ScrapeOnlyMeterProvider
from rolloutd.telemetry.sampling import UntilProcessed

pytestmark = pytest.mark.usefixtures("clean_env")


def test_the_sdk_still_disables_meter_providers_through_the_private_flag(monkeypatch):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    stock = MeterProvider(shutdown_on_exit=False)
    assert stock._disabled is True  # the member ScrapeOnlyMeterProvider clears
    assert isinstance(stock.get_meter("x"), NoOpMeter)


def test_the_scrape_only_provider_records_under_otel_sdk_disabled(monkeypatch):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    reader = InMemoryMetricReader()
    provider = ScrapeOnlyMeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    try:
        meter = provider.get_meter("x")
        assert isinstance(meter, Meter)
        meter.create_counter("probe").add(3)
        data = reader.get_metrics_data()
        assert data is not None
        [resource] = data.resource_metrics
        [scope] = resource.scope_metrics
        [metric] = scope.metrics
        assert metric.name == "probe"
    finally:
        provider.shutdown()


def test_sdk_tracers_copy_the_providers_sampler_into_a_public_attribute():
    """What GatedTracerProvider relies on: each tracer holds the sampler it samples with in
    ``sampler``, set from the provider's in ``get_tracer``."""
    assert "sampler" in inspect.signature(Tracer.__init__).parameters
    provider = TracerProvider(sampler=ALWAYS_ON, shutdown_on_exit=False)
    tracer = provider.get_tracer("x")
    assert isinstance(tracer, Tracer)
    assert tracer.sampler is ALWAYS_ON


def test_the_gated_provider_samples_through_the_gate_and_keeps_the_configured_sampler():
    provider = GatedTracerProvider(sampler=ALWAYS_ON, shutdown_on_exit=False)
    tracer = provider.get_tracer("x")
    assert isinstance(tracer, Tracer)
    assert isinstance(tracer.sampler, UntilProcessed) and tracer.sampler is provider.gate
    assert provider.sampler is ALWAYS_ON
    assert not provider.records_spans
    assert not tracer.start_span("dropped").is_recording()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    assert provider.records_spans
    tracer.start_span("kept").end()
    assert [s.name for s in exporter.get_finished_spans()] == ["kept"]
    provider.shutdown()


def test_a_readable_span_holds_the_fields_a_light_span_sets():
    """LightSpan sets ReadableSpan's fields itself (otel_sdk.py): every field a ReadableSpan's
    constructor sets is one a light span has, and the stock console exporter's JSON of a light
    span reads them."""
    stock = set(vars(ReadableSpan("probe")))
    provider = TracerProvider(shutdown_on_exit=False)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    span = LightTracer(provider.get_tracer("t")).start("probe", None, SpanKind.SERVER, {"n": 1})
    span.end(end_time=span.start_time + 5)  # type: ignore[attr-defined]
    assert stock <= set(vars(span)), stock - set(vars(span))
    [finished] = exporter.get_finished_spans()
    assert finished is span
    described = json.loads(finished.to_json())
    assert (described["name"], described["kind"], described["attributes"]) == (
        "probe",
        "SpanKind.SERVER",
        {"n": 1},
    )
    assert described["status"] == {"status_code": "UNSET"}
