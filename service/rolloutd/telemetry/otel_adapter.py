"""The one module of rolloutd that uses members the OpenTelemetry packages keep private, for what
they offer no public API for. Nothing else in rolloutd touches a private member of theirs, and
``tests/telemetry/test_otel_adapter.py`` has a test for each of these that fails when an upgrade
moves or changes it.

- :class:`PrometheusExportingReader` overrides ``_receive_metrics`` of the Prometheus exporter's
  ``PrometheusMetricReader``: the SDK's ``MetricReader`` hook, documented as the method a
  reader subclass implements, through which each collection reaches the reader. It hands a
  collection made for a push to an exporter instead of the registry, so that ``/metrics`` and an
  OTLP exporter share one aggregation (:mod:`rolloutd.telemetry.metric_reader` says why). The
  SDK has no public way to give two destinations one reader's collections.
- :func:`sanitize_full_name`, :func:`sanitize_attribute` and :func:`map_unit` are the Prometheus
  exporter's naming rules, imported from its private ``_mapping`` module: it exposes no public
  way to ask for the name of a series. Asking a live exporter instead would need an SDK meter
  provider, which ``OTEL_SDK_DISABLED`` turns into a no-op one, while the docs generator and the
  dashboard's series need the names regardless (:mod:`rolloutd.telemetry.prometheus`).
- :data:`PRIVATE_EXPORT_LOGGERS` names the SDK's and exporters' private modules that log failed
  exports, so that :mod:`rolloutd.telemetry.throttle` can bound them: a logger filter sees only
  its own logger's records.

``pyproject.toml`` bounds ``opentelemetry-exporter-prometheus`` to the releases these were
checked against; raise the bound once the tests pass on a new release.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.exporter.prometheus._mapping import (
    map_unit,
    sanitize_attribute,
    sanitize_full_name,
)
from opentelemetry.sdk.metrics.export import MetricExporter, MetricsData
from prometheus_client import CollectorRegistry

__all__ = [
    "PRIVATE_EXPORT_LOGGERS",
    "PrometheusExportingReader",
    "map_unit",
    "sanitize_attribute",
    "sanitize_full_name",
]

logger = logging.getLogger(__name__)

PRIVATE_EXPORT_LOGGERS: tuple[str, ...] = (
    "opentelemetry.exporter.otlp.proto.http._common",
    "opentelemetry.sdk._shared_internal",
    "opentelemetry.sdk.metrics._internal",
    "opentelemetry.sdk.metrics._internal.export",
    "opentelemetry.sdk.metrics._internal.instrument",
)
"""Private modules on the export and callback paths, each logging through a logger of its own
name (the public modules' loggers are named in :mod:`rolloutd.telemetry.throttle`)."""


class PrometheusExportingReader(PrometheusMetricReader):
    """The ``/metrics`` reader, which also exports to ``exporter`` every ``interval_s``: a thread
    collects and hands the result to the exporter, while a scrape collects for the registry as
    before. Both read the same cumulative storage."""

    def __init__(
        self, registry: CollectorRegistry, exporter: MetricExporter, interval_s: float
    ) -> None:
        super().__init__(registry=registry)
        self._exporter = exporter
        self._interval_s = interval_s
        self._pushing = threading.local()
        """Set on the thread whose collection goes to the exporter, not to the registry."""
        self._push_lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="rolloutd-metric-export", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval_s):
            self._push()

    def _push(self, timeout_millis: float = 10_000) -> None:
        with self._push_lock:
            self._pushing.active = True
            try:
                self.collect(timeout_millis=timeout_millis)
            except Exception:  # a callback that raised or a collection that timed out
                logger.exception("metric collection for export failed; the next interval retries")
            finally:
                self._pushing.active = False

    def _receive_metrics(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> None:
        if getattr(self._pushing, "active", False):
            if metrics_data is not None:
                self._exporter.export(metrics_data, timeout_millis=timeout_millis)
            return
        super()._receive_metrics(metrics_data, timeout_millis, **kwargs)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        """Exports what was measured until now."""
        self._push(timeout_millis)
        return self._exporter.force_flush(timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        """A last export, then the exporter's shutdown."""
        if not self._stopped.is_set():
            self._stopped.set()
            self._thread.join(timeout_millis / 1000)
            self._push(timeout_millis)
        super().shutdown(timeout_millis=timeout_millis, **kwargs)
        self._exporter.shutdown(timeout_millis=timeout_millis)
