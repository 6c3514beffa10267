"""Telemetry settings, resolved the OpenTelemetry way: explicit argument, then the standard
``OTEL_*`` environment, then a default.

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
reader behind the admin app's ``/metrics`` is there whenever the SDK is enabled.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector
from opentelemetry.sdk.trace.sampling import Sampler

logger = logging.getLogger(__name__)

DEFAULT_SERVICE_NAME = "rolloutd"
DEFAULT_METRIC_EXPORT_INTERVAL_S = 60.0
DEFAULT_LOG_INTERVAL_S = 60.0


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


def env(name: str) -> str | None:
    """The variable's value; None when it is unset or blank."""
    value = os.environ.get(name, "").strip()
    return value or None


def _protocol(signal: Signal, explicit: OtlpProtocol | None) -> OtlpProtocol:
    if explicit is not None:
        return explicit
    key = f"OTEL_EXPORTER_OTLP_{signal.name}_PROTOCOL"
    raw = env(key) or env("OTEL_EXPORTER_OTLP_PROTOCOL")
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
    specific = env(f"OTEL_EXPORTER_OTLP_{signal.name}_ENDPOINT")
    if specific is not None:
        return specific
    base = env("OTEL_EXPORTER_OTLP_ENDPOINT")
    return None if base is None else from_base(base)


def _exporters(
    signal: Signal, explicit: Sequence[ExporterName] | None, endpoint_configured: bool
) -> tuple[ExporterName, ...]:
    if explicit is not None:
        names = tuple(explicit)
    elif (raw := env(f"OTEL_{signal.name}_EXPORTER")) is not None:
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
    raw = env("OTEL_METRIC_EXPORT_INTERVAL")
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
    if (name := env("OTEL_SERVICE_NAME")) is not None:
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
    env_disabled = (env("OTEL_SDK_DISABLED") or "").lower() == "true"
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
