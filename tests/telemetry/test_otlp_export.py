"""Real OTLP export, over gRPC and over HTTP, to a receiver on a local socket."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterator

import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from prometheus_client import generate_latest

from rolloutd.domain.report import CheckpointPhase, RestorePhase
from rolloutd.telemetry.catalogue import CATALOGUE, SECONDS_BUCKETS
from rolloutd.telemetry.providers import OtlpProtocol, setup_telemetry
from tests.telemetry.otlp_receiver import OtlpReceiver, attributes
from tests.telemetry.reports import (
    CHECKPOINT_STATE,
    ENGINE,
    STATUS,
    checkpoint_report,
    scripted_run,
)

pytestmark = pytest.mark.usefixtures("clean_env")

PROTOCOLS = {"grpc": OtlpProtocol.GRPC, "http": OtlpProtocol.HTTP_PROTOBUF}


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    yield r
    r.stop()


def children_of(root: Span, spans: list[Span]) -> dict[str, Span]:
    return {s.name: s for s in spans if s.parent_span_id == root.span_id}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_span_trees_and_catalogue_metrics_arrive_under_the_service_name(
    protocol, receiver, monkeypatch
):
    monkeypatch.setenv("OTEL_SERVICE_NAME", f"rolloutd-it-{protocol}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint(protocol))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", PROTOCOLS[protocol].value)
    telemetry = setup_telemetry()
    observer = telemetry.observer()
    observer.register_sources(lambda: ENGINE, "synthetic", lambda: STATUS, lambda: CHECKPOINT_STATE)
    scripted_run(observer)
    telemetry.shutdown(timeout_s=20)

    spans = receiver.spans(f"rolloutd-it-{protocol}")
    roots = [s for s in spans if s.name == "rolloutd.checkpoint"]
    assert len(roots) == 4
    completed = [
        r for r in roots if attributes(r.attributes)["rolloutd.checkpoint.outcome"] == "completed"
    ]
    assert len(completed) == 2
    for root in completed:
        assert sorted(children_of(root, spans)) == sorted(
            f"rolloutd.checkpoint.{p.value}" for p in CheckpointPhase
        )
        assert attributes(root.attributes)["rolloutd.checkpoint.bytes.total"] == 4608
    [failed] = [
        r for r in roots if attributes(r.attributes)["rolloutd.checkpoint.outcome"] == "failed"
    ]
    assert failed.status.code == Status.STATUS_CODE_ERROR
    assert children_of(failed, spans)["rolloutd.checkpoint.buffer_save"].status.code == (
        Status.STATUS_CODE_ERROR
    )

    [restore] = [s for s in spans if s.name == "rolloutd.restore"]
    assert sorted(children_of(restore, spans)) == sorted(
        f"rolloutd.restore.{p.value}" for p in RestorePhase
    )
    assert [e.name for e in restore.events] == ["rolloutd.restore.snapshot_skipped"]
    assert attributes(restore.attributes)["rolloutd.restore.groups.unfinished"] == 3

    metrics = receiver.metrics(f"rolloutd-it-{protocol}")
    assert sorted(metrics) == sorted(i.name for i in CATALOGUE)
    duration = metrics["rolloutd.checkpoint.duration"]
    assert duration.unit == "s"
    assert tuple(duration.histogram.data_points[0].explicit_bounds) == SECONDS_BUCKETS


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_an_unreachable_collector_is_logged_at_a_bounded_rate(protocol, monkeypatch, caplog):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    telemetry = setup_telemetry(
        service_name="rolloutd-down",
        otlp_endpoint=f"http://127.0.0.1:{closed_port()}",
        otlp_protocol=PROTOCOLS[protocol],
        metric_export_interval_s=0.1,
        export_timeout_s=0.3,
        log_interval_s=60.0,
    )
    observer = telemetry.observer()
    with caplog.at_level(logging.DEBUG, logger="opentelemetry"):
        for _ in range(20):  # ~2 s: about 20 metric and 20 span exports, every one failing
            for _ in range(10):
                observer.checkpoint_attempted(checkpoint_report())
            await asyncio.sleep(0.1)
        await telemetry.aclose(timeout_s=2.0)

    export_errors = [
        r
        for r in caplog.records
        if r.name.startswith("opentelemetry") and r.levelno >= logging.WARNING
    ]
    assert export_errors, "the failing exports were not logged at all"
    kinds = {(r.name, r.levelno, r.msg) for r in export_errors}
    assert len(export_errors) <= len(kinds) + 1, [r.getMessage() for r in export_errors]
    assert len(kinds) <= 6, kinds


@pytest.mark.parametrize(
    ("preference", "readers", "exported"),
    [(None, 1, [3, 8]), ("delta", 2, [3, 5])],
    ids=["cumulative: one collection", "delta: a reader of its own"],
)
def test_metrics_pushed_over_otlp_and_scraped_come_from_one_aggregation(
    preference, readers, exported, receiver, monkeypatch
):
    """Every measurement is aggregated once per metric reader: /metrics and an OTLP exporter that
    wants the same cumulative points share one, an exporter that wants deltas gets its own."""
    monkeypatch.setenv("OTEL_SERVICE_NAME", "rolloutd-one-reader")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint("grpc"))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "3600000")  # pushes only when flushed
    if preference:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", preference)
    telemetry = setup_telemetry()
    all_readers = telemetry.metric_readers
    assert len(all_readers) == readers
    # a scrape-only reader keeps what a flush collects for the next scrape: flush the others
    pushing = [r for r in all_readers if type(r) is not PrometheusMetricReader]
    counter = telemetry.meter_provider.get_meter("test").create_counter("test.items")
    pushed = []
    for n in (3, 5):
        counter.add(n)
        assert all(r.force_flush(10_000) for r in pushing)
        [point] = receiver.metrics("rolloutd-one-reader")["test.items"].sum.data_points
        pushed.append(point.as_int)
    scraped = generate_latest(telemetry.prometheus_registry).decode()
    telemetry.shutdown(timeout_s=20)
    assert pushed == exported
    [total] = [line for line in scraped.splitlines() if line.startswith("test_items_total{")]
    assert total.endswith(" 8.0")  # a scrape sees every measurement, pushed or not
