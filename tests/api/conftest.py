from __future__ import annotations

import grpc
import pytest

from rolloutd.config import load_config
from rolloutd.server import RolloutService
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc


def service_config(tmp_path, **overrides):
    base = {
        "engine.kind": "synthetic",
        "grpc.host": "127.0.0.1",
        "grpc.port": 0,
        "http.port": 0,
        "http.host": "127.0.0.1",
        "checkpoint.dir": str(tmp_path / "checkpoints"),
        "checkpoint.interval_s": 0,
        "group_size": 4,
        "limits.max_in_flight": 4,
        "limits.buffer_capacity": 16,
    }
    base.update(overrides)
    return load_config(overrides=base, environ={})


@pytest.fixture
async def serve(tmp_path):
    """Starts a real service on port 0; yields a factory returning (service, stub)."""
    running: list[tuple[RolloutService, grpc.aio.Channel]] = []

    async def start(**overrides):
        service = RolloutService(service_config(tmp_path, **overrides))
        addresses = await service.start()
        channel = grpc.aio.insecure_channel(addresses.grpc)
        running.append((service, channel))
        return service, pb_grpc.RolloutServiceStub(channel)

    yield start
    for service, channel in running:
        await channel.close()
        await service.shutdown()
