"""Telemetry of the real service: a trainer's ``Checkpoint`` call as one trace through an in-process
service, and the real CLI exporting over OTLP, serving ``/metrics`` and surviving a dead collector."""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families

from rolloutd.client import RolloutClient
from rolloutd.config import Config, load_config
from rolloutd.domain.report import CheckpointPhase, RecoveryState, RestorePhase, SizePart
from rolloutd.server import RolloutService
from rolloutd.telemetry import catalogue as cat
from rolloutd.telemetry.catalogue import CATALOGUE, Instrument
from rolloutd.telemetry.generation import GENERATE_SPAN, GroupAttr
from rolloutd.telemetry.interceptors import client_interceptors
from rolloutd.telemetry.providers import Telemetry, setup_telemetry
from rolloutd.telemetry.spans import CheckpointAttr, RestoreAttr
from rolloutd.telemetry.weights import WEIGHTS_SPAN, WeightsAttr
from rolloutd.trainer import STEP_ATTR, STEP_SPAN
from tests.deploy.prometheus_names import family_name, series_names
from tests.integration.proc import ServeProcess
from tests.integration.trainer_harness import Trainer
from tests.telemetry.otlp_receiver import OtlpReceiver, attributes

pytestmark = pytest.mark.usefixtures("clean_env")

CHECKPOINT_RPC = "rolloutd.v1.RolloutService/Checkpoint"
FETCH_RPC = "rolloutd.v1.RolloutService/FetchGroups"
CHECKPOINT_PHASES = sorted(f"rolloutd.checkpoint.{p.value}" for p in CheckpointPhase)
RESTORE_PHASES = sorted(f"rolloutd.restore.{p.value}" for p in RestorePhase)
PROTOCOLS = {"grpc": "grpc", "http": "http/protobuf"}


def may_lack_data(instrument: Instrument, blocked_mutations: int) -> bool:
    """Instruments that can have no data point after a run that started on an empty store,
    committed, leased and acked groups and completed at least two checkpoints.

    Five: a mutation waits on the barrier only when it arrives during a checkpoint's exclusive
    hold (microseconds), so the wait histogram has data exactly when the blocked counter (which
    starts at zero for every kind) counted something; such a run updates no weights, so the
    weight update durations, pauses and delta densities have none, and the trainers' pace per
    policy version (measured at a version change) is not known yet; a start that finds nothing to
    restore records no restore; it has no verifier, so nothing records rewards or scoring
    times; and it runs no episodes, so no environment step is timed. Every other histogram is
    recorded by such a run, counters start at zero, synchronous gauges are set by every
    completed checkpoint, and the observable ones report from start-up.
    """
    if instrument in (
        cat.WEIGHTS_UPDATE_DURATION,
        cat.WEIGHTS_PAUSE,
        cat.WEIGHTS_DELTA_DENSITY,
        cat.ADMISSION_CONSUMED_PER_VERSION,
        cat.RESTORE_DURATION,
        cat.SAMPLE_REWARD,
        cat.GROUP_SCORE_DURATION,
        cat.EPISODE_STEP_DURATION,
    ):
        return True
    return instrument is cat.MUTATION_WAIT and blocked_mutations == 0


def serve_args(checkpoint_dir: Path, interval_s: float) -> list[str]:
    return [
        "--engine", "synthetic",
        "--grpc-port", "0",
        "--http-port", "0",
        "--group-size", "3",
        "--max-tokens", "32",
        "--checkpoint-dir", str(checkpoint_dir),
        "--checkpoint-interval", str(interval_s),
        "--restore", "latest",
    ]  # fmt: skip


# --- in process: one trace from the trainer's span down to the checkpoint phases -------------------


def service_config(tmp_path: Path) -> Config:
    return load_config(
        overrides={
            "engine.kind": "synthetic",
            "grpc.host": "127.0.0.1",
            "grpc.port": 0,
            "http.enabled": False,
            "checkpoint.dir": str(tmp_path / "checkpoints"),
            "checkpoint.interval_s": 0,
            "restore": "none",
            "group_size": 4,
            "limits.max_in_flight": 4,
            "limits.buffer_capacity": 16,
        },
        environ={},
    )


@pytest.fixture
def service_telemetry() -> Iterator[tuple[Telemetry, InMemorySpanExporter]]:
    """The service's own providers (no OTLP), its finished spans kept in memory."""
    telemetry = setup_telemetry(
        service_name="rolloutd-e2e", traces_exporters=(), metrics_exporters=()
    )
    assert isinstance(telemetry.tracer_provider, SdkTracerProvider), "telemetry is disabled"
    exporter = InMemorySpanExporter()
    telemetry.tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield telemetry, exporter
    telemetry.shutdown()


async def test_a_trainer_checkpoint_call_is_one_trace_down_to_the_phases(
    tmp_path, service_telemetry, span_exporter
):
    telemetry, server_exporter = service_telemetry
    trainer_provider, trainer_exporter = span_exporter
    service = RolloutService(service_config(tmp_path), telemetry=telemetry)
    addresses = await service.start()
    client = RolloutClient(addresses.grpc, interceptors=client_interceptors(trainer_provider))
    try:
        lease = await asyncio.to_thread(client.fetch, 2, 10_000)
        assert lease is not None
        await asyncio.to_thread(client.ack, lease, 1)
        # More groups stay leased over the checkpoint: however slowly the engine refills the
        # buffer, at least their samples are live in the snapshot.
        held = await asyncio.to_thread(client.fetch, 2, 10_000)
        assert held is not None
        tracer = trainer_provider.get_tracer("trainer")
        with tracer.start_as_current_span("trainer.save_checkpoint") as step:
            [reply] = (await asyncio.to_thread(client.checkpoint, 1, "step-1")).values()
    finally:
        client.close()
        await service.shutdown()

    trace_id = step.get_span_context().trace_id
    spans = [
        s
        for s in (*trainer_exporter.get_finished_spans(), *server_exporter.get_finished_spans())
        if s.context is not None and s.context.trace_id == trace_id
    ]
    by_id = {s.context.span_id: s for s in spans if s.context is not None}

    def parent(span: ReadableSpan) -> ReadableSpan:
        assert span.parent is not None, f"{span.name} is a root"
        return by_id[span.parent.span_id]

    [client_span] = [s for s in spans if s.kind is SpanKind.CLIENT]
    [server_span] = [s for s in spans if s.kind is SpanKind.SERVER]
    [root] = [s for s in spans if s.name == "rolloutd.checkpoint"]
    phases = [s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id]
    assert len(spans) == 4 + len(CheckpointPhase), [s.name for s in spans]
    assert client_span.name == server_span.name == CHECKPOINT_RPC
    assert parent(client_span).name == "trainer.save_checkpoint"
    assert parent(server_span) is client_span
    assert parent(root) is server_span
    assert sorted(p.name for p in phases) == CHECKPOINT_PHASES
    for phase in phases:
        assert root.start_time <= phase.start_time <= phase.end_time <= root.end_time

    attrs = dict(root.attributes or {})
    assert attrs[CheckpointAttr.TRIGGER] == "on_demand"
    assert attrs[CheckpointAttr.OUTCOME] == attrs[CheckpointAttr.REASON] == "completed"
    assert attrs[CheckpointAttr.SEQUENCE] == reply.sequence == 1
    assert attrs[CheckpointAttr.TAG] == "step-1"
    assert attrs[CheckpointAttr.TRAINER_STEP] == 1
    # The first snapshot of the service: everything live in it is new in it, the held lease too.
    held_samples = sum(len(group.samples) for group in held.groups)
    assert held_samples >= 4
    assert (
        attrs[f"{CheckpointAttr.ROWS}.live"] == attrs[f"{CheckpointAttr.ROWS}.new"] >= held_samples
    )
    assert attrs[f"{CheckpointAttr.ROWS}.removed"] == 0, "no earlier snapshot had rows to remove"
    assert 0 < attrs[f"{CheckpointAttr.BYTES}.sidecar"] < attrs[f"{CheckpointAttr.BYTES}.total"]
    assert attrs[f"{CheckpointAttr.BYTES}.total"] == sum(
        attrs.get(f"{CheckpointAttr.BYTES}.{part.value}", 0)
        for part in SizePart
        if part is not SizePart.TOTAL
    )


async def test_a_trainer_fetch_links_the_generation_spans_of_the_groups_it_received(
    tmp_path, service_telemetry, span_exporter
):
    telemetry, server_exporter = service_telemetry
    trainer_provider, trainer_exporter = span_exporter
    service = RolloutService(service_config(tmp_path), telemetry=telemetry)
    addresses = await service.start()
    client = RolloutClient(addresses.grpc, interceptors=client_interceptors(trainer_provider))
    try:
        with trainer_provider.get_tracer("trainer").start_as_current_span("trainer.step") as step:
            lease = await asyncio.to_thread(client.fetch, 3, 10_000)
        assert lease is not None
    finally:
        client.close()
        await service.shutdown()

    received = {g.group_id for g in lease.groups}
    server_spans = server_exporter.get_finished_spans()
    generated = {
        dict(s.attributes or {})[GroupAttr.ID]: s.context
        for s in server_spans
        if s.name == GENERATE_SPAN and s.context is not None
    }
    assert received <= generated.keys()
    [fetch] = [s for s in server_spans if s.name == FETCH_RPC]
    [client_span] = [s for s in trainer_exporter.get_finished_spans() if s.kind is SpanKind.CLIENT]
    assert fetch.parent is not None and fetch.parent.span_id == client_span.context.span_id
    assert client_span.parent is not None
    assert client_span.parent.span_id == step.get_span_context().span_id
    assert fetch.context.trace_id == step.get_span_context().trace_id
    linked = {dict(link.attributes or {})[GroupAttr.ID]: link.context for link in fetch.links}
    assert linked.keys() == received
    for group_id, context in linked.items():
        assert (context.trace_id, context.span_id) == (
            generated[group_id].trace_id,
            generated[group_id].span_id,
        )


async def test_update_weights_is_a_span_of_pause_load_resume_under_the_rpc(
    tmp_path, service_telemetry
):
    telemetry, exporter = service_telemetry
    service = RolloutService(service_config(tmp_path), telemetry=telemetry)
    addresses = await service.start()
    client = RolloutClient(addresses.grpc)
    (tmp_path / "weights-v1").mkdir()  # the synthetic engine loads nothing, but the path must exist
    try:
        await asyncio.to_thread(client.update_weights, 1, str(tmp_path / "weights-v1"))
    finally:
        client.close()
        await service.shutdown()
    spans = exporter.get_finished_spans()
    [root] = [s for s in spans if s.name == WEIGHTS_SPAN]
    assert root.parent is not None
    [rpc] = [s for s in spans if s.context.span_id == root.parent.span_id]
    assert rpc.name == "rolloutd.v1.RolloutService/UpdateWeights" and rpc.kind is SpanKind.SERVER
    phases = sorted(
        (s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id),
        key=lambda s: s.start_time,
    )
    in_engine = [s for s in phases if s.name.rsplit(".", 1)[1] in ENGINE_PHASES]
    assert [s.name for s in in_engine] == [f"{WEIGHTS_SPAN}.{p}" for p in ENGINE_PHASES]
    assert root.start_time <= phases[0].start_time and phases[-1].end_time <= root.end_time
    for before, after in itertools.pairwise(phases):
        assert before.end_time <= after.start_time
    assert dict(root.attributes or {})[WeightsAttr.VERSION] == 1


ENGINE_PHASES = ("pause", "load", "resume")
"""The phases of an update that happen inside the engine, while generation is stopped."""


# --- the real CLI: OTLP export, the admin port, a dead collector --------------------------------


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    yield r
    r.stop()


@pytest.fixture
def processes() -> Iterator[list[ServeProcess]]:
    """Started processes; any still running at the end is killed."""
    started: list[ServeProcess] = []
    yield started
    for p in started:
        if p.proc.poll() is None:
            p.kill()


def children(root: Span, spans: list[Span]) -> list[Span]:
    return [s for s in spans if s.trace_id == root.trace_id and s.parent_span_id == root.span_id]


def has_data(metric: Metric) -> bool:
    kind = metric.WhichOneof("data")
    return kind is not None and len(getattr(metric, kind).data_points) > 0


def blocked_mutations(metrics: dict[str, Metric]) -> int:
    blocked = metrics.get(cat.MUTATION_BLOCKED.name)
    return 0 if blocked is None else sum(p.as_int for p in blocked.sum.data_points)


TRAINER_SERVICE = "rolloutd-e2e-trainer"


def run_traced_trainer(address: str, env: dict[str, str], cwd: Path) -> str:
    """``rolloutd trainer`` for two steps, its traces exported like the service's; its output."""
    result = subprocess.run(
        [sys.executable, "-m", "rolloutd.cli", "trainer", "--target", address,
         "--steps", "2", "--groups-per-step", "2", "--ready-timeout-s", "60"],
        capture_output=True, text=True, timeout=120, cwd=cwd,
        env={**os.environ, **env, "OTEL_SERVICE_NAME": TRAINER_SERVICE},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


def assert_trainer_steps_lead_to_generation(
    receiver: OtlpReceiver, service_spans: list[Span], output: str
) -> None:
    """Each step of ``rolloutd trainer`` is a span whose fetches' server spans (in the service)
    link the generation spans of the groups they leased."""
    trainer_spans = receiver.spans(TRAINER_SERVICE)
    steps = {s.span_id: s for s in trainer_spans if s.name == STEP_SPAN}
    assert sorted(attributes(s.attributes).get(STEP_ATTR) for s in steps.values()) == [1, 2], output
    fetch_clients = {
        s.span_id: s for s in trainer_spans if s.kind == Span.SPAN_KIND_CLIENT
        and s.name == FETCH_RPC and s.parent_span_id in steps
    }  # fmt: skip
    fetches = [s for s in service_spans if s.parent_span_id in fetch_clients]
    assert fetches and all(s.name == FETCH_RPC for s in fetches)
    generation = {
        attributes(s.attributes)[GroupAttr.ID]: s for s in service_spans if s.name == GENERATE_SPAN
    }
    linked = [link for fetch in fetches for link in fetch.links]
    assert len(linked) >= 4  # two steps of two groups; an empty fetch links nothing
    for link in linked:
        target = generation[attributes(link.attributes)[GroupAttr.ID]]
        assert (link.trace_id, link.span_id) == (target.trace_id, target.span_id)


@pytest.mark.process
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_cli_exports_span_trees_and_the_catalogue_over_otlp(
    protocol, receiver, processes, tmp_path
):
    service_name = f"rolloutd-e2e-{protocol}"
    env = {
        "OTEL_SDK_DISABLED": "false",
        "OTEL_SERVICE_NAME": service_name,
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint(protocol),
        "OTEL_EXPORTER_OTLP_PROTOCOL": PROTOCOLS[protocol],
        "OTEL_METRIC_EXPORT_INTERVAL": "300",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    trainer = Trainer(checkpoint_every=20)  # room for periodic checkpoints between its own
    for run in range(2):  # the second run restores what the first one's final checkpoint saved
        p = ServeProcess(serve_args(tmp_path / "ckpt", 0.5), env=env, cwd=tmp_path)
        processes.append(p)
        # Each run takes its own Checkpoint at step 20 or 40, however slowly it gets there.
        address = p.wait_listening()
        trainer.run(address, seconds=2.0, through_step=20 * (run + 1))
        if run == 0 and protocol == "grpc":
            traced = run_traced_trainer(address, env, tmp_path)
        assert p.terminate() == 0, p.output
        assert "final checkpoint failed" not in p.output
    assert trainer.delivered > 0

    spans = receiver.spans(service_name)
    checkpoints = [s for s in spans if s.name == "rolloutd.checkpoint"]
    completed = [
        s for s in checkpoints if attributes(s.attributes)[CheckpointAttr.OUTCOME] == "completed"
    ]
    assert {attributes(s.attributes)[CheckpointAttr.TRIGGER] for s in completed} == {
        "periodic",
        "on_demand",
        "shutdown",
    }
    for root in completed:
        assert sorted(s.name for s in children(root, spans)) == CHECKPOINT_PHASES
        attrs = attributes(root.attributes)
        assert attrs[CheckpointAttr.REASON] == "completed"
        assert attrs[CheckpointAttr.SEQUENCE] >= 1
        assert attrs[f"{CheckpointAttr.BYTES}.total"] > 0
        assert f"{CheckpointAttr.ROWS}.live" in attrs
    on_demand = [
        s for s in completed if attributes(s.attributes)[CheckpointAttr.TRIGGER] == "on_demand"
    ]
    assert all(attributes(s.attributes)[CheckpointAttr.TAG].startswith("step-") for s in on_demand)
    # An on-demand checkpoint is a child of the Checkpoint RPC's server span.
    servers = {s.span_id: s for s in spans if s.kind == Span.SPAN_KIND_SERVER}
    assert all(servers[s.parent_span_id].name == CHECKPOINT_RPC for s in on_demand)

    if protocol == "grpc":
        assert_trainer_steps_lead_to_generation(receiver, spans, traced)

    restores = [s for s in spans if s.name == "rolloutd.restore"]
    assert len(restores) == 2  # the first run found nothing to restore
    [restored] = [s for s in restores if RestoreAttr.SEQUENCE in attributes(s.attributes)]
    assert sorted(s.name for s in children(restored, spans)) == RESTORE_PHASES
    restore_attrs = attributes(restored.attributes)
    assert restore_attrs[RestoreAttr.OUTCOME] == "completed"
    assert {f"{RestoreAttr.GROUPS}.{state.value}" for state in RecoveryState} <= set(restore_attrs)
    first_final = min(
        (s for s in completed if attributes(s.attributes)[CheckpointAttr.TRIGGER] == "shutdown"),
        key=lambda s: s.start_time_unix_nano,
    )
    # The second run restored what the first run's final checkpoint wrote.
    assert first_final.end_time_unix_nano < restored.start_time_unix_nano
    assert (
        restore_attrs[RestoreAttr.SEQUENCE]
        == attributes(first_final.attributes)[CheckpointAttr.SEQUENCE]
    )

    metrics = receiver.metrics(service_name)
    blocked = blocked_mutations(metrics)
    required = {i.name for i in CATALOGUE if not may_lack_data(i, blocked)}
    assert required <= {name for name, m in metrics.items() if has_data(m)}
    assert set(metrics) <= {i.name for i in CATALOGUE}
    assert metrics[cat.COMMITTED_GROUPS.name].sum.data_points[0].as_int > 0
    restore_phases = {
        attributes(point.attributes)["phase"]
        for point in metrics[cat.RESTORE_DURATION.name].histogram.data_points
    }
    assert restore_phases == {*(p.value for p in RestorePhase), "total"}

    with receiver.received.lock:
        resources = [
            *(rs.resource for r in receiver.received.traces for rs in r.resource_spans),
            *(rm.resource for r in receiver.received.metrics for rm in r.resource_metrics),
        ]
    names = {attributes(r.attributes)["service.name"] for r in resources}
    assert names == {service_name, *([TRAINER_SERVICE] if protocol == "grpc" else [])}
    instances = {
        attributes(r.attributes)["service.instance.id"]
        for r in resources
        if attributes(r.attributes)["service.name"] == service_name
    }
    assert len(instances) == 2  # one per process


def metric_series(exposition: str) -> set[str]:
    return {
        sample.name
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
    }


@pytest.mark.process
def test_the_admin_port_of_a_running_cli(processes, tmp_path):
    # No periodic checkpoints: the on-demand one below must not find another in progress.
    p = ServeProcess(
        serve_args(tmp_path / "ckpt", 0), env={"OTEL_SDK_DISABLED": "false"}, cwd=tmp_path
    )
    processes.append(p)
    grpc_address = p.wait_listening()
    with httpx.Client(base_url=f"http://{p.http}", timeout=30) as http:
        assert http.get("/readyz").json() == {"ready": True, "reason": ""}
        Trainer().run(grpc_address, seconds=1.5)  # with a Checkpoint call every 4 steps

        status = http.get("/v1/status")
        assert status.status_code == 200
        body = status.json()
        assert body["state"] == "serving"  # the admin JSON shape: lower case, numbers
        assert body["counters"]["committed_groups"] > 0

        before = body["last_checkpoint"]["sequence"]
        created = http.post("/v1/checkpoints", json={"tag": "admin"})
        assert created.status_code == 200, created.text
        result = created.json()
        assert (result["outcome"], result["trigger"]) == ("completed", "on_demand")
        assert result["sequence"] > before
        listed = http.get("/v1/checkpoints").json()
        assert listed[0]["sequence"] == result["sequence"] and listed[0]["tag"] == "admin"

        readyz = http.get("/readyz")
        assert readyz.status_code == 200
        scraped = http.get("/metrics")
    assert scraped.status_code == 200
    assert p.terminate() == 0, p.output

    series = metric_series(scraped.text)
    blocked = sum(
        sample.value
        for family in text_string_to_metric_families(scraped.text)
        for sample in family.samples
        if sample.name in series_names(cat.MUTATION_BLOCKED)
    )
    missing = {
        i.name: sorted(series_names(i) - series)
        for i in CATALOGUE
        if not series_names(i) <= series and not may_lack_data(i, int(blocked))
    }
    assert not missing, missing
    # Histograms in seconds carry the catalogue's buckets, not the SDK's millisecond ones.
    for instrument in CATALOGUE:
        if instrument.buckets is None or not series_names(instrument) <= series:
            continue
        bounds = {
            float(sample.labels["le"])
            for family in text_string_to_metric_families(scraped.text)
            for sample in family.samples
            if sample.name == f"{family_name(instrument)}_bucket"
        }
        assert bounds == {*instrument.buckets, math.inf}, instrument.name


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


EXPORT_ERROR = re.compile(
    r"^\S+ \S+ (?:WARNING|ERROR|CRITICAL) (?P<logger>opentelemetry\.\S+|rolloutd\.telemetry\.\S+): "
)
"""A telemetry warning or error in the CLI's log format (``asctime levelname name: message``)."""


@pytest.mark.process
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_dead_collector_neither_stops_the_service_nor_floods_its_log(
    protocol, processes, tmp_path
):
    p = ServeProcess(
        serve_args(tmp_path / "ckpt", 0.5),
        env={
            "OTEL_SDK_DISABLED": "false",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{closed_port()}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": PROTOCOLS[protocol],
            "OTEL_METRIC_EXPORT_INTERVAL": "100",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "0.3",  # seconds: each export gives up quickly
        },
        cwd=tmp_path,
    )
    processes.append(p)
    trainer = Trainer()
    address = p.wait_listening()
    trainer.run(address, seconds=3.0)  # exports fail several times a second meanwhile
    while trainer.delivered < 10:  # however slowly the machine serves
        trainer.run(address, seconds=0.5)
    assert p.terminate(timeout=30) == 0, p.output
    assert "stopped in" in p.output

    errors = [line for line in p.lines if EXPORT_ERROR.match(line)]
    assert errors, "the failed exports were not logged"
    # Metrics and spans were exported, and gave up, several times a second for several seconds:
    # logged one by one (as the HTTP exporter does on its own) that is dozens of lines. Each kind
    # is logged at most once a minute.
    kinds = {m["logger"] for line in errors if (m := EXPORT_ERROR.match(line))}
    assert len(errors) <= 8, "".join(errors)
    assert len(kinds) <= 6, kinds
