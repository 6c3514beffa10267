"""Tracer and meter providers, configured the OpenTelemetry way: explicit argument, then the
standard ``OTEL_*`` environment, then a default.

Honoured: ``OTEL_SDK_DISABLED``, ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER`` (comma lists of ``otlp``, ``console``,
``none``; ``prometheus`` is accepted for metrics and always on), ``OTEL_EXPORTER_OTLP_ENDPOINT``
and ``OTEL_EXPORTER_OTLP_PROTOCOL`` (``grpc``, ``http/protobuf``) with their per-signal
``_TRACES_`` / ``_METRICS_`` variants, ``OTEL_METRIC_EXPORT_INTERVAL`` (ms),
``OTEL_TRACES_SAMPLER`` (+ ``_ARG``); headers, TLS, compression, ``OTEL_EXPORTER_OTLP_TIMEOUT`` and
``OTEL_BSP_*`` are read by the SDK and exporters themselves.

Two deliberate defaults: the OTLP protocol defaults to ``grpc`` (as the Python SDK's ``otlp``
exporter does), and when neither an exporter nor any OTLP endpoint is configured nothing is
exported over OTLP (a laptop without a collector should not log export errors); the Prometheus
reader behind the admin app's ``/metrics`` is always there.

Nothing here sets the global providers: the service passes its providers explicitly, so tests
and embedded use never fight over process-wide state.
"""

from __future__ import annotations

import asyncio
import atexit
import enum
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import (
    SERVICE_INSTANCE_ID,
    SERVICE_NAME,
    SERVICE_VERSION,
    OTELResourceDetector,
    Resource,
)
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from prometheus_client import CollectorRegistry

from rolloutd import __version__
from rolloutd.telemetry import throttle
from rolloutd.telemetry.catalogue import CATALOGUE
from rolloutd.telemetry.observer import TelemetryObserver

logger = logging.getLogger(__name__)

DEFAULT_SERVICE_NAME = "rolloutd"
DEFAULT_METRIC_EXPORT_INTERVAL_S = 60.0
DEFAULT_LOG_INTERVAL_S = 60.0

KUBERNETES_ENV: Mapping[str, tuple[str, ...]] = {
    "k8s.pod.name": ("K8S_POD_NAME", "POD_NAME"),
    "k8s.namespace.name": ("K8S_NAMESPACE_NAME", "POD_NAMESPACE"),
    "k8s.node.name": ("K8S_NODE_NAME", "NODE_NAME"),
    "k8s.pod.uid": ("K8S_POD_UID", "POD_UID"),
}
"""Resource attribute <- downward-API environment variables, first one set wins."""


class Signal(enum.Enum):
    TRACES = "traces"
    METRICS = "metrics"


class ExporterName(enum.Enum):
    OTLP = "otlp"
    CONSOLE = "console"
    NONE = "none"
    PROMETHEUS = "prometheus"
    """Metrics only; the Prometheus reader is always on, so this adds nothing."""


class OtlpProtocol(enum.Enum):
    GRPC = "grpc"
    HTTP_PROTOBUF = "http/protobuf"


@dataclass(frozen=True)
class SignalExport:
    """Where one signal goes."""

    exporters: tuple[ExporterName, ...]
    protocol: OtlpProtocol
    endpoint: str | None
    """Full OTLP endpoint (with ``/v1/<signal>`` for HTTP); None: the exporter's default."""


@dataclass(frozen=True)
class TelemetrySettings:
    disabled: bool
    service_name: str
    traces: SignalExport
    metrics: SignalExport
    metric_export_interval_s: float
    export_timeout_s: float | None
    """None: the exporters' own (``OTEL_EXPORTER_OTLP_TIMEOUT``, 10 s)."""
    sampler: Sampler | None
    """None: ``OTEL_TRACES_SAMPLER``, read by the SDK (default parentbased_always_on)."""
    resource_attributes: Mapping[str, str] = field(default_factory=dict)
    """Explicit resource attributes; they win over ``OTEL_RESOURCE_ATTRIBUTES``."""
    log_interval_s: float = DEFAULT_LOG_INTERVAL_S
    """Export failures of one kind are logged at most once per interval."""


def _env(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def _protocol(signal: Signal, explicit: OtlpProtocol | None) -> OtlpProtocol:
    if explicit is not None:
        return explicit
    key = f"OTEL_EXPORTER_OTLP_{signal.name}_PROTOCOL"
    raw = _env(key) or _env("OTEL_EXPORTER_OTLP_PROTOCOL")
    if raw is None:
        return OtlpProtocol.GRPC
    try:
        return OtlpProtocol(raw)
    except ValueError:
        logger.warning("OTLP protocol %r is not grpc or http/protobuf; using grpc", raw)
        return OtlpProtocol.GRPC


def _endpoint(signal: Signal, protocol: OtlpProtocol, explicit_base: str | None) -> str | None:
    def from_base(base: str) -> str:
        if protocol is OtlpProtocol.GRPC:
            return base
        return f"{base.rstrip('/')}/v1/{signal.value}"

    if explicit_base is not None:
        return from_base(explicit_base)
    specific = _env(f"OTEL_EXPORTER_OTLP_{signal.name}_ENDPOINT")
    if specific is not None:
        return specific
    base = _env("OTEL_EXPORTER_OTLP_ENDPOINT")
    return None if base is None else from_base(base)


def _exporters(
    signal: Signal, explicit: Sequence[ExporterName] | None, endpoint_configured: bool
) -> tuple[ExporterName, ...]:
    if explicit is not None:
        names = tuple(explicit)
    elif (raw := _env(f"OTEL_{signal.name}_EXPORTER")) is not None:
        parsed: list[ExporterName] = []
        for part in (p.strip() for p in raw.split(",") if p.strip()):
            try:
                parsed.append(ExporterName(part))
            except ValueError:
                logger.warning(
                    "OTEL_%s_EXPORTER: unsupported exporter %r ignored", signal.name, part
                )
        names = tuple(parsed)
    else:
        names = (ExporterName.OTLP,) if endpoint_configured else ()
    if signal is Signal.TRACES and ExporterName.PROMETHEUS in names:
        logger.warning("OTEL_TRACES_EXPORTER: prometheus exports metrics only; ignored for traces")
    return tuple(n for n in names if n not in (ExporterName.NONE, ExporterName.PROMETHEUS))


def _signal(
    signal: Signal,
    exporters: Sequence[ExporterName] | None,
    protocol: OtlpProtocol | None,
    endpoint: str | None,
) -> SignalExport:
    resolved_protocol = _protocol(signal, protocol)
    resolved_endpoint = _endpoint(signal, resolved_protocol, endpoint)
    return SignalExport(
        _exporters(signal, exporters, resolved_endpoint is not None),
        resolved_protocol,
        resolved_endpoint,
    )


def _interval_s(explicit: float | None) -> float:
    if explicit is not None:
        return explicit
    raw = _env("OTEL_METRIC_EXPORT_INTERVAL")
    if raw is None:
        return DEFAULT_METRIC_EXPORT_INTERVAL_S
    try:
        interval_ms = float(raw)
    except ValueError:
        interval_ms = 0.0
    if interval_ms <= 0:
        logger.warning("OTEL_METRIC_EXPORT_INTERVAL=%r is not a positive number of ms", raw)
        return DEFAULT_METRIC_EXPORT_INTERVAL_S
    return interval_ms / 1000


def _service_name(explicit: str | None) -> str:
    if explicit is not None:
        return explicit
    if (name := _env("OTEL_SERVICE_NAME")) is not None:
        return name
    detected = OTELResourceDetector().detect().attributes.get(SERVICE_NAME)
    return str(detected) if detected else DEFAULT_SERVICE_NAME


def resolve_settings(
    *,
    disabled: bool = False,
    service_name: str | None = None,
    otlp_endpoint: str | None = None,
    otlp_protocol: OtlpProtocol | None = None,
    traces_exporters: Sequence[ExporterName] | None = None,
    metrics_exporters: Sequence[ExporterName] | None = None,
    metric_export_interval_s: float | None = None,
    export_timeout_s: float | None = None,
    sampler: Sampler | None = None,
    resource_attributes: Mapping[str, str] | None = None,
    log_interval_s: float | None = None,
) -> TelemetrySettings:
    """Each argument given wins over its environment variable, which wins over the default.

    ``disabled`` can only turn telemetry off: the SDK providers honour ``OTEL_SDK_DISABLED``
    themselves, so ``disabled=False`` does not override ``OTEL_SDK_DISABLED=true``.

    ``otlp_endpoint`` is a base URL like ``OTEL_EXPORTER_OTLP_ENDPOINT`` (``http://host:4317``);
    for http/protobuf the signal path is appended.
    """
    env_disabled = (_env("OTEL_SDK_DISABLED") or "").lower() == "true"
    return TelemetrySettings(
        disabled=disabled or env_disabled,
        service_name=_service_name(service_name),
        traces=_signal(Signal.TRACES, traces_exporters, otlp_protocol, otlp_endpoint),
        metrics=_signal(Signal.METRICS, metrics_exporters, otlp_protocol, otlp_endpoint),
        metric_export_interval_s=_interval_s(metric_export_interval_s),
        export_timeout_s=export_timeout_s,
        sampler=sampler,
        resource_attributes=dict(resource_attributes or {}),
        log_interval_s=DEFAULT_LOG_INTERVAL_S if log_interval_s is None else log_interval_s,
    )


def instance_id() -> str:
    """Stable for the life of the process; the pod name where there is one (a StatefulSet pod
    keeps its name across restarts, so its series continue)."""
    for name in KUBERNETES_ENV["k8s.pod.name"]:
        if (pod := _env(name)) is not None:
            return pod
    return f"{socket.gethostname()}-{os.getpid()}"


def build_resource(settings: TelemetrySettings) -> Resource:
    """The SDK's, then ours (version, instance, Kubernetes), overridden by
    ``OTEL_RESOURCE_ATTRIBUTES``, overridden by explicit attributes."""
    defaults: dict[str, str] = {SERVICE_VERSION: __version__, SERVICE_INSTANCE_ID: instance_id()}
    for attribute, names in KUBERNETES_ENV.items():
        value = next((v for n in names if (v := _env(n)) is not None), None)
        if value is not None:
            defaults[attribute] = value
    explicit = {**settings.resource_attributes, SERVICE_NAME: settings.service_name}
    return (
        Resource.create({})
        .merge(Resource(defaults))
        .merge(OTELResourceDetector().detect())
        .merge(Resource(explicit))
    )


def histogram_views() -> list[View]:
    """The catalogue's buckets: second-scale for seconds (the SDK default suits ms), small
    integers for policy versions."""
    return [
        View(
            instrument_name=instrument.name,
            aggregation=ExplicitBucketHistogramAggregation(instrument.buckets),
        )
        for instrument in CATALOGUE
        if instrument.buckets is not None
    ]


def _span_exporter(
    name: ExporterName, export: SignalExport, timeout_s: float | None
) -> SpanExporter:
    if name is ExporterName.CONSOLE:
        return ConsoleSpanExporter()
    if export.protocol is OtlpProtocol.GRPC:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=export.endpoint, timeout=timeout_s)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpSpanExporter,
    )

    return HttpSpanExporter(endpoint=export.endpoint, timeout=timeout_s)


def _metric_exporter(
    name: ExporterName, export: SignalExport, timeout_s: float | None
) -> MetricExporter:
    if name is ExporterName.CONSOLE:
        return ConsoleMetricExporter()
    if export.protocol is OtlpProtocol.GRPC:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter(endpoint=export.endpoint, timeout=timeout_s)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
        OTLPMetricExporter as HttpMetricExporter,
    )

    return HttpMetricExporter(endpoint=export.endpoint, timeout=timeout_s)


class _ScrapeOnlyMeterProvider(SdkMeterProvider):
    """The SDK meter provider feeding the admin port's Prometheus registry alone.

    It stays live under ``OTEL_SDK_DISABLED``: the SDK reads that variable itself and would hand
    out no-op meters, while the README promises /metrics on the admin port always. Nothing it
    records leaves the process.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._disabled = False


@dataclass(frozen=True)
class _SdkProviders:
    tracer: _TracerProvider
    meter: SdkMeterProvider


class Telemetry:
    """The providers of one service, its Prometheus registry, and their orderly shutdown.

    ``shutdown`` flushes both providers within a time bound and is idempotent; it blocks, so
    from the event loop use ``await telemetry.aclose()``. With the SDK disabled the providers
    are the API's no-op ones, except the meter provider behind /metrics.
    """

    def __init__(
        self,
        settings: TelemetrySettings,
        prometheus_registry: CollectorRegistry,
        resource: Resource,
        sdk: _SdkProviders | None,
        meter: metrics.MeterProvider | None = None,
    ):
        """``meter``: without the SDK, the provider behind /metrics (else a no-op one)."""
        self.settings = settings
        self.prometheus_registry = prometheus_registry
        self.resource = resource
        self._sdk = sdk
        self.tracer_provider: trace.TracerProvider = (
            trace.NoOpTracerProvider() if sdk is None else sdk.tracer
        )
        self.meter_provider: metrics.MeterProvider = (
            (meter or metrics.NoOpMeterProvider()) if sdk is None else sdk.meter
        )
        self._lock = threading.Lock()
        self._closed = False
        atexit.register(self.shutdown)

    @property
    def enabled(self) -> bool:
        return self._sdk is not None

    def records_spans(self) -> bool:
        """Whether a span started now could be recorded: false with the SDK disabled and
        until a span processor is added (no trace exporter configured)."""
        return self._sdk is not None and self._sdk.tracer.records_spans

    def observer(self) -> TelemetryObserver:
        """A new observer over these providers; build one per service (a second one would
        register every observable callback twice)."""
        return TelemetryObserver(self.tracer_provider, self.meter_provider)

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        """Exports what is pending; False when it did not finish within ``timeout_s``."""
        sdk = self._sdk
        if sdk is None:
            return True
        millis = int(timeout_s * 1000)
        return _within(
            timeout_s,
            {
                "span flush": lambda: sdk.tracer.force_flush(millis),
                "metric flush": lambda: sdk.meter.force_flush(millis),
            },
        )

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Flushes and stops both providers, side by side; returns after at most ``timeout_s``
        even when a collector does not answer (what is left is abandoned on daemon threads)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.shutdown)
        sdk = self._sdk
        if sdk is None:
            return
        _within(
            timeout_s,
            {
                "span shutdown": sdk.tracer.shutdown,
                "metric shutdown": lambda: sdk.meter.shutdown(timeout_millis=timeout_s * 1000),
            },
        )

    async def aclose(self, timeout_s: float = 5.0) -> None:
        await asyncio.to_thread(self.shutdown, timeout_s)


def _within(timeout_s: float, work: Mapping[str, Callable[[], object]]) -> bool:
    """Runs each piece of work on its own daemon thread; True when all finished in time."""
    deadline = time.monotonic() + timeout_s
    pending: dict[str, threading.Event] = {}
    for what, run in work.items():
        pending[what] = threading.Event()
        threading.Thread(
            target=_guarded,
            args=(what, run, pending[what]),
            name=f"rolloutd-telemetry-{what.replace(' ', '-')}",
            daemon=True,
        ).start()
    late = [
        what
        for what, done in pending.items()
        if not done.wait(max(0.0, deadline - time.monotonic()))
    ]
    if late:
        logger.warning(
            "telemetry %s did not finish within %.1f s; abandoned", ", ".join(late), timeout_s
        )
    return not late


def _guarded(what: str, run: Callable[[], object], done: threading.Event) -> None:
    try:
        run()
    except Exception:
        # Telemetry must never break the host, least of all while it shuts down.
        logger.exception("telemetry %s failed", what)
    finally:
        done.set()


def setup_telemetry(
    *,
    disabled: bool = False,
    service_name: str | None = None,
    otlp_endpoint: str | None = None,
    otlp_protocol: OtlpProtocol | None = None,
    traces_exporters: Sequence[ExporterName] | None = None,
    metrics_exporters: Sequence[ExporterName] | None = None,
    metric_export_interval_s: float | None = None,
    export_timeout_s: float | None = None,
    sampler: Sampler | None = None,
    resource_attributes: Mapping[str, str] | None = None,
    log_interval_s: float | None = None,
) -> Telemetry:
    """Builds the service's providers; see :func:`resolve_settings` for the arguments."""
    settings = resolve_settings(
        disabled=disabled,
        service_name=service_name,
        otlp_endpoint=otlp_endpoint,
        otlp_protocol=otlp_protocol,
        traces_exporters=traces_exporters,
        metrics_exporters=metrics_exporters,
        metric_export_interval_s=metric_export_interval_s,
        export_timeout_s=export_timeout_s,
        sampler=sampler,
        resource_attributes=resource_attributes,
        log_interval_s=log_interval_s,
    )
    return build_telemetry(settings)


def build_telemetry(settings: TelemetrySettings) -> Telemetry:
    registry = CollectorRegistry()
    if settings.disabled:
        logger.info(
            "OpenTelemetry SDK disabled (OTEL_SDK_DISABLED): no traces, nothing exported; "
            "/metrics stays on"
        )
        scrape_only = _ScrapeOnlyMeterProvider(
            metric_readers=[PrometheusMetricReader(registry=registry)],
            views=histogram_views(),
            shutdown_on_exit=False,
        )
        return Telemetry(settings, registry, Resource.get_empty(), sdk=None, meter=scrape_only)
    throttle.install(settings.log_interval_s)
    resource = build_resource(settings)

    tracer_provider = _TracerProvider(
        resource=resource, sampler=settings.sampler, shutdown_on_exit=False
    )
    for name in settings.traces.exporters:
        exporter = _span_exporter(name, settings.traces, settings.export_timeout_s)
        tracer_provider.add_span_processor(BatchSpanProcessor(exporter))

    readers: list[MetricReader] = [PrometheusMetricReader(registry=registry)]
    for name in settings.metrics.exporters:
        readers.append(
            PeriodicExportingMetricReader(
                _metric_exporter(name, settings.metrics, settings.export_timeout_s),
                export_interval_millis=settings.metric_export_interval_s * 1000,
            )
        )
    meter_provider = SdkMeterProvider(
        resource=resource,
        metric_readers=readers,
        views=histogram_views(),
        shutdown_on_exit=False,
    )
    # Exporter modules imported above register their loggers only now.
    throttle.install(settings.log_interval_s)
    logger.info(
        "telemetry: service.name=%s traces=%s metrics=%s (+prometheus)",
        settings.service_name,
        _describe(settings.traces),
        _describe(settings.metrics),
    )
    return Telemetry(settings, registry, resource, _SdkProviders(tracer_provider, meter_provider))


class _UntilProcessed(Sampler):
    """The configured sampler once spans have somewhere to go; until then every span is
    dropped (a non-recording span that still carries the trace context). With no trace exporter
    configured each RPC would otherwise build and end a span that no processor receives."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.processed = False

    def should_sample(self, *args: Any, **kwargs: Any) -> SamplingResult:
        if self.processed:
            return self.sampler.should_sample(*args, **kwargs)
        return SamplingResult(Decision.DROP)

    def get_description(self) -> str:
        return f"UntilProcessed{{{self.sampler.get_description()}}}"


class _TracerProvider(SdkTracerProvider):
    """The SDK provider whose tracers record spans from the first span processor on
    (``sampler`` stays the configured one; its tracers sample through :class:`_UntilProcessed`)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._gate = _UntilProcessed(self.sampler)

    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        tracer = super().get_tracer(*args, **kwargs)
        if isinstance(tracer, SdkTracer):
            tracer.sampler = self._gate
        return tracer

    def add_span_processor(self, span_processor: SpanProcessor) -> None:
        super().add_span_processor(span_processor)
        self._gate.processed = True

    @property
    def records_spans(self) -> bool:
        """False while every span is dropped for want of a processor."""
        return self._gate.processed


def _describe(export: SignalExport) -> str:
    if not export.exporters:
        return "none"
    parts = []
    for name in export.exporters:
        if name is ExporterName.OTLP:
            parts.append(f"otlp/{export.protocol.value}@{export.endpoint or 'default'}")
        else:
            parts.append(name.value)
    return ",".join(parts)
