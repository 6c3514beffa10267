"""Tracer and meter providers built from :mod:`~rolloutd.telemetry.settings` (explicit argument,
then the standard ``OTEL_*`` environment, then a default), the service's resource, and their
bounded shutdown.

Nothing here sets the global providers: the service passes its providers explicitly, so tests
and embedded use never fight over process-wide state.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

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
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import Sampler
from prometheus_client import CollectorRegistry

from rolloutd import __version__
from rolloutd.telemetry import throttle
from rolloutd.telemetry.catalogue import CATALOGUE
from rolloutd.telemetry.metric_reader import shares_collection
from rolloutd.telemetry.observer import TelemetryObserver
from rolloutd.telemetry.otel_adapter import PrometheusExportingReader
from rolloutd.telemetry.settings import (
    ExporterName,
    OtlpProtocol,
    SignalExport,
    TelemetrySettings,
    env,
    resolve_settings,
)
from rolloutd.telemetry.tracer_provider import ServiceTracerProvider

logger = logging.getLogger(__name__)

KUBERNETES_ENV: Mapping[str, tuple[str, ...]] = {
    "k8s.pod.name": ("K8S_POD_NAME", "POD_NAME"),
    "k8s.namespace.name": ("K8S_NAMESPACE_NAME", "POD_NAMESPACE"),
    "k8s.node.name": ("K8S_NODE_NAME", "NODE_NAME"),
    "k8s.pod.uid": ("K8S_POD_UID", "POD_UID"),
}
"""Resource attribute <- downward-API environment variables, first one set wins."""


def instance_id() -> str:
    """Stable for the life of the process; the pod name where there is one (a StatefulSet pod
    keeps its name across restarts, so its series continue)."""
    for name in KUBERNETES_ENV["k8s.pod.name"]:
        if (pod := env(name)) is not None:
            return pod
    return f"{socket.gethostname()}-{os.getpid()}"


def build_resource(settings: TelemetrySettings) -> Resource:
    """The SDK's, then ours (version, instance, Kubernetes), overridden by
    ``OTEL_RESOURCE_ATTRIBUTES``, overridden by explicit attributes."""
    defaults: dict[str, str] = {SERVICE_VERSION: __version__, SERVICE_INSTANCE_ID: instance_id()}
    for attribute, names in KUBERNETES_ENV.items():
        value = next((v for n in names if (v := env(n)) is not None), None)
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
    integers for policy versions. Their exemplars are the SDK's: its default reservoir for
    explicit-bucket histograms keeps the last value offered in each bucket, and its exemplar
    filter (``OTEL_METRICS_EXEMPLAR_FILTER``, trace-based by default) decides what is offered."""
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


@dataclass(frozen=True)
class _SdkProviders:
    tracer: ServiceTracerProvider
    meter: SdkMeterProvider
    readers: tuple[MetricReader, ...]


class Telemetry:
    """The providers of one service, its Prometheus registry, and their orderly shutdown.

    ``shutdown`` flushes both providers within a time bound and is idempotent; it blocks, so
    from the event loop use ``await telemetry.aclose()``. With the SDK disabled
    (``OTEL_SDK_DISABLED``) both providers are the API's no-op ones, as the specification
    says: no span is recorded and no metric measured, so the Prometheus registry behind
    ``/metrics`` holds no instrument of rolloutd's.
    """

    def __init__(
        self,
        settings: TelemetrySettings,
        prometheus_registry: CollectorRegistry,
        resource: Resource,
        sdk: _SdkProviders | None,
    ):
        self.settings = settings
        self.prometheus_registry = prometheus_registry
        self.resource = resource
        self._sdk = sdk
        self.tracer_provider: trace.TracerProvider = (
            trace.NoOpTracerProvider() if sdk is None else sdk.tracer
        )
        self.meter_provider: metrics.MeterProvider = (
            metrics.NoOpMeterProvider() if sdk is None else sdk.meter
        )
        self._lock = threading.Lock()
        self._closed = False
        atexit.register(self.shutdown)

    @property
    def enabled(self) -> bool:
        return self._sdk is not None

    @property
    def metric_readers(self) -> tuple[MetricReader, ...]:
        """The meter provider's readers: the one behind ``/metrics`` first (which also pushes to
        the first exporter when it can, :mod:`~rolloutd.telemetry.metric_reader`), then one
        periodic reader per other exporter; none with the SDK disabled."""
        return () if self._sdk is None else self._sdk.readers

    def records_spans(self) -> bool:
        """Whether a span started now could be recorded: false with the SDK disabled and
        until a span processor is added (no trace exporter configured)."""
        return self._sdk is not None and self._sdk.tracer.has_span_processor

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
    announce: bool = True,
) -> Telemetry:
    """Builds the service's providers; see :func:`resolve_settings` for the arguments.
    ``announce=False`` logs the one line that says what is exported only when something is."""
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
    return build_telemetry(settings, announce=announce)


TRAINER_SERVICE_NAME = "rolloutd-trainer"


def trainer_tracing() -> Telemetry:
    """The tracer provider of ``rolloutd trainer``, from the standard ``OTEL_*`` environment
    (``service.name`` ``rolloutd-trainer`` unless ``OTEL_SERVICE_NAME`` says otherwise; no
    metrics), set as the global one: its steps are spans, and the client's calls in them carry
    their context to the service. Shut it down when the trainer ends."""
    telemetry = setup_telemetry(
        service_name=None if env("OTEL_SERVICE_NAME") else TRAINER_SERVICE_NAME,
        metrics_exporters=(),
        announce=False,  # a trainer that exports nothing keeps its stderr for its own errors
    )
    if telemetry.enabled:
        trace.set_tracer_provider(telemetry.tracer_provider)
    return telemetry


def build_telemetry(settings: TelemetrySettings, *, announce: bool = True) -> Telemetry:
    registry = CollectorRegistry()
    if settings.disabled:
        logger.info(
            "OpenTelemetry SDK disabled (OTEL_SDK_DISABLED): no spans, no metrics; "
            "/metrics serves no rolloutd series"
        )
        return Telemetry(settings, registry, Resource.get_empty(), sdk=None)
    throttle.install(settings.log_interval_s)
    resource = build_resource(settings)

    tracer_provider = ServiceTracerProvider(
        resource=resource, sampler=settings.sampler, shutdown_on_exit=False
    )
    for name in settings.traces.exporters:
        exporter = _span_exporter(name, settings.traces, settings.export_timeout_s)
        tracer_provider.add_span_processor(BatchSpanProcessor(exporter))

    readers = _metric_readers(settings, registry)
    meter_provider = SdkMeterProvider(
        resource=resource,
        metric_readers=readers,
        views=histogram_views(),
        shutdown_on_exit=False,
    )
    # Exporter modules imported above register their loggers only now.
    throttle.install(settings.log_interval_s)
    exports = bool(settings.traces.exporters or settings.metrics.exporters)
    logger.log(
        logging.INFO if announce or exports else logging.DEBUG,
        "telemetry: service.name=%s traces=%s metrics=%s (+prometheus)",
        settings.service_name,
        _describe(settings.traces),
        _describe(settings.metrics),
    )
    return Telemetry(
        settings, registry, resource, _SdkProviders(tracer_provider, meter_provider, tuple(readers))
    )


def _metric_readers(settings: TelemetrySettings, registry: CollectorRegistry) -> list[MetricReader]:
    """The ``/metrics`` reader, which also pushes to the first exporter when that exporter wants
    what a scrape collects (metric_reader.py: one aggregation per measurement, not one per
    reader); other exporters get a periodic reader of their own."""
    exporters = [
        _metric_exporter(name, settings.metrics, settings.export_timeout_s)
        for name in settings.metrics.exporters
    ]
    interval_s = settings.metric_export_interval_s

    def periodic(exporter: MetricExporter) -> MetricReader:
        return PeriodicExportingMetricReader(exporter, export_interval_millis=interval_s * 1000)

    if exporters and shares_collection():
        first, *rest = exporters
        return [PrometheusExportingReader(registry, first, interval_s), *map(periodic, rest)]
    return [PrometheusMetricReader(registry=registry), *map(periodic, exporters)]


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
