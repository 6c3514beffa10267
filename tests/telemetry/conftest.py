from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rolloutd.telemetry import throttle
from rolloutd.telemetry.providers import histogram_views

_ENV_PREFIXES = ("OTEL_", "K8S_", "POD_")
_ENV_NAMES = ("NODE_NAME",)


@pytest.fixture(autouse=True)
def fresh_log_throttle() -> None:
    """Each test sees its own first telemetry error, whatever ran before."""
    throttle.SHARED.reset()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No OTEL_* or downward-API variables (the session default disables the SDK)."""
    for name in list(os.environ):
        if name.startswith(_ENV_PREFIXES) or name in _ENV_NAMES:
            monkeypatch.delenv(name)


@pytest.fixture
def span_exporter(clean_env: None) -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


@pytest.fixture
def metric_reader(clean_env: None) -> Iterator[tuple[MeterProvider, InMemoryMetricReader]]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    yield provider, reader
    provider.shutdown()


@pytest.fixture
def viewed_metric_reader(clean_env: None) -> Iterator[tuple[MeterProvider, InMemoryMetricReader]]:
    """Like the service's provider: the catalogue's histogram views."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(
        metric_readers=[reader], views=histogram_views(), shutdown_on_exit=False
    )
    yield provider, reader
    provider.shutdown()
