"""Each private member of the OpenTelemetry packages that :mod:`rolloutd.telemetry.otel_adapter`
uses is still there and still does what the adapter relies on; an upgrade that moves or changes
one fails here first."""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Sequence

import opentelemetry.exporter.prometheus as exporter_module
import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader, _mapping
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
from prometheus_client import CollectorRegistry, generate_latest

from rolloutd.telemetry import otel_adapter
from rolloutd.telemetry.otel_adapter import PRIVATE_EXPORT_LOGGERS, PrometheusExportingReader

pytestmark = pytest.mark.usefixtures("clean_env")


class Received(MetricExporter):
    """An exporter that keeps what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[MetricsData] = []

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: object
    ) -> MetricExportResult:
        self.batches.append(metrics_data)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: object) -> None:
        pass


def sums(batch: MetricsData) -> dict[str, Sequence[float]]:
    return {
        m.name: [p.value for p in m.data.data_points]  # type: ignore[union-attr]
        for rm in batch.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    }


def test_the_prometheus_reader_still_receives_every_collection_through_receive_metrics():
    """What PrometheusExportingReader relies on: the stock reader implements the SDK's
    ``_receive_metrics`` hook, ``collect`` hands it each collection, and a scrape of the registry
    goes through it too; one override then splits pushes from scrapes over one storage."""
    assert "_receive_metrics" in vars(PrometheusMetricReader)
    assert list(inspect.signature(PrometheusMetricReader._receive_metrics).parameters)[:3] == [
        "self",
        "metrics_data",
        "timeout_millis",
    ]
    registry, received = CollectorRegistry(), Received()
    reader = PrometheusExportingReader(registry, received, interval_s=3600)
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    try:
        counter = provider.get_meter("t").create_counter("probe.items")
        counter.add(3)
        assert reader.force_flush()
        counter.add(5)
        scraped = generate_latest(registry).decode()
    finally:
        provider.shutdown()
    assert [sums(b)["probe.items"] for b in received.batches[:1]] == [[3]]
    assert sums(received.batches[-1])["probe.items"] == [8]  # the last export, at shutdown
    [total] = [line for line in scraped.splitlines() if line.startswith("probe_items_total{")]
    assert total.endswith(" 8.0")  # the scrape saw every measurement, from the same storage


def test_the_readers_own_members_are_none_of_the_stock_readers():
    """A release that gave the stock reader a member of the same name would be overwritten by
    (or overwrite) the subclass's."""
    stock = PrometheusMetricReader(registry=CollectorRegistry())
    ours = PrometheusExportingReader(CollectorRegistry(), Received(), interval_s=3600)
    try:
        added = set(vars(ours)) - set(vars(stock))
        assert added == {
            "_exporter",
            "_interval_s",
            "_pushing",
            "_push_lock",
            "_stopped",
            "_thread",
        }
        for name in ("_run", "_push"):
            assert not any(name in vars(c) for c in PrometheusMetricReader.__mro__), name
    finally:
        ours.shutdown()


NAMING = ("sanitize_full_name", "sanitize_attribute", "map_unit")


def test_the_naming_functions_keep_their_signature():
    for name in NAMING:
        parameters = list(inspect.signature(getattr(_mapping, name)).parameters.values())
        assert len(parameters) == 1, name
        assert parameters[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, name
        assert getattr(otel_adapter, name) is getattr(_mapping, name), name


def test_the_exporter_names_series_with_the_same_functions():
    """Were the exporter to switch to other rules, ours would drift from its series."""
    for name in NAMING:
        assert getattr(exporter_module, name) is getattr(_mapping, name), name


@pytest.mark.parametrize("name", PRIVATE_EXPORT_LOGGERS)
def test_each_private_export_logger_is_a_module_logging_under_its_own_name(name):
    module = importlib.import_module(name)
    loggers = [v for v in vars(module).values() if isinstance(v, logging.Logger)]
    assert any(logger.name == name for logger in loggers), name
