"""The places where rolloutd reaches past the OpenTelemetry SDK's public surface: two kept here,
and one in :mod:`rolloutd.telemetry.light_spans`.

- :class:`ScrapeOnlyMeterProvider` clears the meter provider's private ``_disabled`` flag, which
  the SDK sets from ``OTEL_SDK_DISABLED`` in its constructor with no argument to override it.
- :class:`GatedTracerProvider` sets the ``sampler`` of each SDK ``Tracer`` it hands out: the SDK
  copies the provider's sampler into every tracer, and offers no way to give tracers a sampler
  other than the provider's own (which must stay the configured one).
- :class:`~rolloutd.telemetry.light_spans.LightSpan` is a ``ReadableSpan`` that sets the fields
  ``ReadableSpan``'s properties read (``_name``, ``_context``, ``_parent``, ``_kind``,
  ``_attributes``, ``_events``, ``_links``, ``_status``, ``_start_time``, ``_end_time``,
  ``_resource``, ``_instrumentation_info``, ``_instrumentation_scope``) itself, as the SDK's own
  span does, so that ending a span hands the processors the span itself, not a copy.

``pyproject.toml`` pins ``opentelemetry-sdk`` (and the exporter) to the minor versions these were
checked against; ``tests/telemetry/test_otel_sdk.py`` fails when an upgrade moves any of them.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import SpanProcessor, Tracer, TracerProvider

from rolloutd.telemetry.sampling import UntilProcessed


class ScrapeOnlyMeterProvider(MeterProvider):
    """The SDK meter provider feeding the admin port's Prometheus registry alone.

    It stays live under ``OTEL_SDK_DISABLED``: the SDK reads that variable itself and would hand
    out no-op meters, while the README promises /metrics on the admin port always. Nothing it
    records leaves the process.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._disabled = False


class GatedTracerProvider(TracerProvider):
    """The SDK provider whose tracers record spans from the first span processor on
    (``sampler`` stays the configured one; its tracers sample through :class:`UntilProcessed`)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gate = UntilProcessed(self.sampler)

    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        tracer = super().get_tracer(*args, **kwargs)
        if isinstance(tracer, Tracer):
            tracer.sampler = self.gate
        return tracer

    def add_span_processor(self, span_processor: SpanProcessor) -> None:
        super().add_span_processor(span_processor)
        self.gate.processed = True

    @property
    def records_spans(self) -> bool:
        """False while every span is dropped for want of a processor."""
        return self.gate.processed
