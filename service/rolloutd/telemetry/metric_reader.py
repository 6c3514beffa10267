"""One collection of the metrics for both ``/metrics`` and a push exporter (OTLP, console).

The SDK gives every metric reader a storage of its own, and every measurement is aggregated once
per reader: with the Prometheus reader of ``/metrics`` beside a ``PeriodicExportingMetricReader``
for OTLP, each histogram record of the per-request GenAI latencies was hashed, cleaned and
bucketed twice. That second aggregation was most of what telemetry cost the service per token
(``benchmarks/telemetry_overhead.py``: CPU per 1,000 committed tokens 1.07 of telemetry off).

:class:`~rolloutd.telemetry.otel_adapter.PrometheusExportingReader` is the Prometheus reader that
also pushes: a thread collects every ``interval_s`` and hands the result to the exporter, while a
scrape collects for the registry as before. Both read the same cumulative storage (the reader
overrides a private hook of the exporter's, so it lives in the OpenTelemetry adapter module).
It serves only exporters that want cumulative points and the default aggregations
(:func:`shares_collection`); any other preference
(``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE``, ``..._DEFAULT_HISTOGRAM_AGGREGATION``)
gets a reader of its own, as before.
"""

from __future__ import annotations

from rolloutd.telemetry.settings import env

_DEFAULTS = {
    "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE": "cumulative",
    "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION": "explicit_bucket_histogram",
}


def shares_collection() -> bool:
    """Whether push exporters want what ``/metrics`` collects: cumulative points, default
    aggregations (no environment variable asks otherwise)."""
    return all((env(name) or default).lower() == default for name, default in _DEFAULTS.items())
