"""The SDK member that :mod:`rolloutd.telemetry.otel_sdk` overrides is still there and still does
what the override relies on; an upgrade of opentelemetry-sdk that moves one fails here first."""

from __future__ import annotations

import pytest
from opentelemetry.metrics import NoOpMeter
from opentelemetry.sdk.metrics import Meter, MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from rolloutd.telemetry.otel_sdk import ScrapeOnlyMeterProvider

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
