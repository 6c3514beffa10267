"""The place where rolloutd reaches past the OpenTelemetry SDK's public surface.

- :class:`ScrapeOnlyMeterProvider` clears the meter provider's private ``_disabled`` flag, which
  the SDK sets from ``OTEL_SDK_DISABLED`` in its constructor with no argument to override it.

``pyproject.toml`` pins ``opentelemetry-sdk`` (and the exporter) to the minor versions this was
checked against; ``tests/telemetry/test_otel_sdk.py`` fails when an upgrade moves it.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.metrics import MeterProvider


class ScrapeOnlyMeterProvider(MeterProvider):
    """The SDK meter provider feeding the admin port's Prometheus registry alone.

    It stays live under ``OTEL_SDK_DISABLED``: the SDK reads that variable itself and would hand
    out no-op meters, while the README promises /metrics on the admin port always. Nothing it
    records leaves the process.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._disabled = False
