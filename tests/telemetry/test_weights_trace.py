"""A trainer's PushWeights shows the update's phase tree in the trainer's own trace, exported by
the real service over OTLP to a receiver on a local socket; a refused push is an ERROR span."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from rolloutd.client import RolloutClient
from rolloutd.config import load_config
from rolloutd.domain.weights import WeightsPhase
from rolloutd.server import RolloutService
from rolloutd.telemetry.interceptors import client_interceptors
from rolloutd.telemetry.providers import OtlpProtocol, setup_telemetry
from rolloutd.telemetry.weights import WEIGHTS_SPAN, WeightsAttr
from tests.telemetry.otlp_receiver import OtlpReceiver, attributes
from tests.weights.helpers import SHAPES, write_model

SERVICE = "rolloutd-weights-trace"
PUSH_RPC = "rolloutd.v1.RolloutService/PushWeights"


async def test_a_push_is_a_phase_tree_in_the_trainers_trace(span_exporter, tmp_path: Path):
    trainer_provider, trainer_spans = span_exporter
    receiver = OtlpReceiver().start()
    try:
        telemetry = setup_telemetry(
            service_name=SERVICE,
            otlp_endpoint=receiver.endpoint("grpc"),
            otlp_protocol=OtlpProtocol.GRPC,
        )
        model = write_model(tmp_path / "served", seed=0)
        config = load_config(
            overrides={
                "engine.kind": "synthetic",
                "engine.model": str(model),
                "grpc.host": "127.0.0.1",
                "grpc.port": 0,
                "http.enabled": False,
                "checkpoint.dir": str(tmp_path / "checkpoints"),
                "checkpoint.interval_s": 0,
                "weights.staging_dir": str(tmp_path / "staging"),
            },
            environ={},
        )
        service = RolloutService(config, telemetry=telemetry)
        addresses = await service.start()
        good = write_model(tmp_path / "good", seed=1)
        bad = write_model(tmp_path / "bad", seed=1, shapes={**SHAPES, "norm.weight": (3,)})
        tracer = trainer_provider.get_tracer("trainer")
        client = RolloutClient(
            addresses.grpc, interceptors=client_interceptors(trainer_provider), retries=0
        )
        try:
            with tracer.start_as_current_span("trainer.sync_weights") as step:
                await asyncio.to_thread(client.push_weights, 1, good)
                with pytest.raises(grpc.RpcError):
                    await asyncio.to_thread(client.push_weights, 2, bad)
        finally:
            client.close()
            await service.shutdown()  # flushes the service's telemetry
        spans = receiver.spans(SERVICE)
    finally:
        receiver.stop()

    trace_id = step.get_span_context().trace_id.to_bytes(16, "big")
    client_calls = [s for s in trainer_spans.get_finished_spans() if s.name == PUSH_RPC]
    assert len(client_calls) == 2
    servers = {s.span_id: s for s in spans if s.name == PUSH_RPC}
    roots = [s for s in spans if s.name == WEIGHTS_SPAN]
    assert len(roots) == 2
    for root in roots:
        assert root.trace_id == trace_id, "the update is not in the trainer's trace"
        assert root.parent_span_id in servers, "the update is not under the PushWeights span"
    loaded, refused = sorted(roots, key=lambda s: attributes(s.attributes)[WeightsAttr.VERSION])
    assert attributes(loaded.attributes)[WeightsAttr.OUTCOME] == "loaded"
    assert attributes(loaded.attributes)[WeightsAttr.BYTES] == sum(
        p.stat().st_size for p in good.glob("*.safetensors")
    )
    children = sorted(
        (s for s in spans if s.parent_span_id == loaded.span_id),
        key=lambda s: s.start_time_unix_nano,
    )
    assert [s.name for s in children] == [
        f"{WEIGHTS_SPAN}.{p.value}" for p in WeightsPhase if p is not WeightsPhase.DECODE
    ]
    for child in children:
        assert loaded.start_time_unix_nano <= child.start_time_unix_nano
        assert child.end_time_unix_nano <= loaded.end_time_unix_nano
    assert attributes(refused.attributes)[WeightsAttr.OUTCOME] == "refused"
    assert refused.status.code == Status.STATUS_CODE_ERROR
    assert "norm.weight" in refused.status.message
    assert [s.name for s in spans if s.parent_span_id == refused.span_id] == [
        f"{WEIGHTS_SPAN}.transfer",
        f"{WEIGHTS_SPAN}.verify",
    ]
