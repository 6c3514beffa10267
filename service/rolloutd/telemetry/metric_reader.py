"""One collection of the metrics for both ``/metrics`` and a push exporter (OTLP, console).

The SDK gives every metric reader a storage of its own, and every measurement is aggregated once
per reader: with the Prometheus reader of ``/metrics`` beside a ``PeriodicExportingMetricReader``
for OTLP, each histogram record of the per-request GenAI latencies was hashed, cleaned and
bucketed twice. That second aggregation was most of what telemetry cost the service per token
(``benchmarks/telemetry_overhead.py``: CPU per 1,000 committed tokens 1.07 of telemetry off).

:class:`PrometheusExportingReader` is the Prometheus reader that also pushes: a thread collects
every ``interval_s`` and hands the result to the exporter, while a scrape collects for the
registry as before. Both read the same cumulative storage. It serves only exporters that want
cumulative points and the default aggregations (:func:`shares_collection`); any other preference
(``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE``, ``..._DEFAULT_HISTOGRAM_AGGREGATION``)
gets a reader of its own, as before.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics.export import MetricExporter, MetricsData
from prometheus_client import CollectorRegistry

from rolloutd.telemetry.settings import env

logger = logging.getLogger(__name__)

_DEFAULTS = {
    "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE": "cumulative",
    "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION": "explicit_bucket_histogram",
}


def shares_collection() -> bool:
    """Whether push exporters want what ``/metrics`` collects: cumulative points, default
    aggregations (no environment variable asks otherwise)."""
    return all((env(name) or default).lower() == default for name, default in _DEFAULTS.items())


class PrometheusExportingReader(PrometheusMetricReader):
    """The ``/metrics`` reader, which also exports to ``exporter`` every ``interval_s``."""

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
