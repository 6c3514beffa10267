from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Sequence

import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from prometheus_client import REGISTRY, generate_latest

from rolloutd import __version__
from rolloutd.telemetry.providers import (
    ExporterName,
    OtlpProtocol,
    Telemetry,
    resolve_settings,
    setup_telemetry,
)
from tests.telemetry.reports import (
    CHECKPOINT_STATE,
    ENGINE,
    STATUS,
    checkpoint_report,
    scripted_run,
)

pytestmark = pytest.mark.usefixtures("clean_env")


@pytest.fixture
def telemetry():
    made: list[Telemetry] = []

    def make(**kwargs) -> Telemetry:
        made.append(setup_telemetry(**kwargs))
        return made[-1]

    yield make
    for t in made:
        t.shutdown(timeout_s=2.0)


def test_defaults_export_nothing_over_otlp():
    settings = resolve_settings()
    assert settings.service_name == "rolloutd"
    assert settings.disabled is False
    assert settings.traces.exporters == settings.metrics.exporters == ()
    assert settings.traces.protocol is OtlpProtocol.GRPC
    assert settings.metric_export_interval_s == 60.0


def test_an_endpoint_alone_turns_otlp_on_with_per_signal_protocols_and_paths(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "http://metrics:4317")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "1500")
    settings = resolve_settings()
    assert settings.traces.exporters == (ExporterName.OTLP,)
    assert settings.traces.protocol is OtlpProtocol.HTTP_PROTOBUF
    assert settings.traces.endpoint == "http://collector:4318/v1/traces"
    assert settings.metrics.protocol is OtlpProtocol.GRPC
    assert settings.metrics.endpoint == "http://metrics:4317"
    assert settings.metric_export_interval_s == 1.5


def test_exporter_lists_from_the_environment(monkeypatch, caplog):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console, zipkin")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "prometheus")
    with caplog.at_level(logging.WARNING):
        settings = resolve_settings()
    assert settings.traces.exporters == (ExporterName.CONSOLE,)
    assert settings.metrics.exporters == ()
    assert "zipkin" in caplog.text

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert resolve_settings().traces.exporters == ()


def test_explicit_arguments_win_over_the_environment(monkeypatch):
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    settings = resolve_settings(
        service_name="explicit",
        otlp_endpoint="http://arg:4318",
        otlp_protocol=OtlpProtocol.HTTP_PROTOBUF,
        traces_exporters=[ExporterName.OTLP],
        metric_export_interval_s=2.0,
    )
    assert settings.service_name == "explicit"
    assert settings.traces.exporters == (ExporterName.OTLP,)
    assert settings.traces.endpoint == "http://arg:4318/v1/traces"
    assert settings.metrics.endpoint == "http://arg:4318/v1/metrics"
    assert settings.metric_export_interval_s == 2.0
    assert resolve_settings().service_name == "from-env"


def test_service_name_falls_back_to_resource_attributes(monkeypatch):
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-attrs,team=rl")
    assert resolve_settings().service_name == "from-attrs"


def test_resource_has_service_identity_and_kubernetes_attributes(monkeypatch, telemetry):
    monkeypatch.setenv("POD_NAME", "rolloutd-2")
    monkeypatch.setenv("POD_NAMESPACE", "rl")
    monkeypatch.setenv("NODE_NAME", "gpu-node-7")
    monkeypatch.setenv("K8S_NODE_NAME", "gpu-node-8")
    monkeypatch.setenv(
        "OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=prod,k8s.namespace.name=x"
    )
    t = telemetry(
        service_name="rolloutd-test", resource_attributes={"deployment.environment": "dev"}
    )
    attrs = t.resource.attributes
    assert attrs["service.name"] == "rolloutd-test"
    assert attrs["service.version"] == __version__
    assert attrs["service.instance.id"] == "rolloutd-2"
    assert attrs["k8s.pod.name"] == "rolloutd-2"
    assert attrs["k8s.node.name"] == "gpu-node-8"  # K8S_* first
    assert attrs["k8s.namespace.name"] == "x"  # OTEL_RESOURCE_ATTRIBUTES over the downward API
    assert attrs["deployment.environment"] == "dev"  # explicit over OTEL_RESOURCE_ATTRIBUTES
    assert attrs["telemetry.sdk.name"] == "opentelemetry"


def test_instance_id_without_kubernetes_is_host_and_pid(telemetry):
    t = telemetry()
    assert t.resource.attributes["service.instance.id"] == f"{socket.gethostname()}-{os.getpid()}"
    assert "k8s.pod.name" not in t.resource.attributes


def test_prometheus_reader_has_its_own_registry(telemetry):
    t = telemetry()
    scripted_run(t.observer())
    exposition = generate_latest(t.prometheus_registry).decode()
    assert "rolloutd_checkpoint_attempts_total{" in exposition
    assert 'service_name="rolloutd"' in exposition  # target_info
    assert "rolloutd_checkpoint_attempts_total" not in generate_latest(REGISTRY).decode()


def test_the_sampler_comes_from_the_environment_unless_given(monkeypatch, telemetry):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    provider = telemetry().tracer_provider
    assert isinstance(provider, SdkTracerProvider)
    assert provider.sampler.get_description() == "AlwaysOffSampler"
    explicit = telemetry(sampler=ALWAYS_OFF).tracer_provider
    assert isinstance(explicit, SdkTracerProvider)
    assert explicit.sampler is ALWAYS_OFF


@pytest.mark.parametrize("how", ["environment", "argument"])
def test_sdk_disabled_means_no_op_providers_and_no_rolloutd_series_on_metrics(
    how, monkeypatch, telemetry
):
    """OTEL_SDK_DISABLED=true is the specification's no-op SDK: no spans, no metrics measured,
    nothing exported. /metrics (the admin port's Prometheus registry) still answers, with no
    series of rolloutd's: its exposition is empty (with the vLLM engine, vLLM's own vllm:*
    families are added to it by the server, which vLLM records itself)."""
    if how == "environment":
        monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    t = telemetry(disabled=how == "argument")
    assert not t.enabled and not t.records_spans()
    assert isinstance(t.tracer_provider, trace.NoOpTracerProvider)
    assert isinstance(t.meter_provider, metrics.NoOpMeterProvider)
    observer = t.observer()
    observer.register_sources(lambda: ENGINE, "synthetic", lambda: STATUS, lambda: CHECKPOINT_STATE)
    scripted_run(observer)
    assert generate_latest(t.prometheus_registry) == b""
    assert list(t.prometheus_registry.collect()) == []
    assert t.force_flush(timeout_s=1.0)


def test_sdk_providers_are_built_when_enabled(telemetry):
    t = telemetry()
    assert t.enabled
    assert isinstance(t.tracer_provider, SdkTracerProvider)
    assert isinstance(t.meter_provider, SdkMeterProvider)


def test_spans_are_recorded_from_the_first_span_processor_on(telemetry):
    """What the server interceptor and the generation spans ask before they build a span (the
    provider's own tracers sample with the configured sampler throughout)."""
    t = telemetry()
    assert isinstance(t.tracer_provider, SdkTracerProvider)
    tracer = t.tracer_provider.get_tracer("test")
    assert not t.records_spans()
    t.tracer_provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    assert t.records_spans()
    assert tracer.start_span("kept").is_recording()
    assert not telemetry(disabled=True).records_spans()


class BlockingExporter(SpanExporter):
    """An exporter stuck on a collector that never answers, until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.entered.set()
        self.release.wait()
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self.release.set()


def test_recording_never_waits_for_a_stuck_exporter_and_shutdown_is_bounded(telemetry):
    t = telemetry()
    assert isinstance(t.tracer_provider, SdkTracerProvider)
    exporter = BlockingExporter()
    t.tracer_provider.add_span_processor(BatchSpanProcessor(exporter, max_export_batch_size=1))
    observer = t.observer()
    try:
        observer.checkpoint_attempted(checkpoint_report())
        assert exporter.entered.wait(10), "the exporter thread never started exporting"

        def record_many() -> None:
            for _ in range(200):
                observer.checkpoint_attempted(checkpoint_report())

        recorder = threading.Thread(target=record_many)
        recorder.start()
        recorder.join(30)
        assert not recorder.is_alive(), "recording waited for the exporter"

        t.shutdown(timeout_s=0.2)  # the exporter is still stuck: shutdown gives up, not hangs
        t.shutdown(timeout_s=0.2)
    finally:
        exporter.release.set()
