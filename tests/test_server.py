"""The composition root's checkpoint lifecycle: an attempt whose caller goes away still finishes,
and shutdown's final checkpoint follows the attempts in flight."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from rolloutd.checkpoint.format import Manifest
from rolloutd.config import load_config
from rolloutd.domain.report import Outcome, Trigger
from rolloutd.server import RolloutService
from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc


def service(tmp_path: Path, interval_s: float) -> RolloutService:
    config = load_config(
        overrides={
            "engine.kind": "synthetic",
            "grpc.host": "127.0.0.1",
            "grpc.port": 0,
            "grpc.grace_s": 0,
            "http.enabled": False,
            "checkpoint.dir": str(tmp_path / "checkpoints"),
            "checkpoint.interval_s": interval_s,
            "restore": "none",
        },
        environ={},
    )
    return RolloutService(config)


def slow_first_publish(
    service: RolloutService, monkeypatch: pytest.MonkeyPatch, seconds: float
) -> threading.Event:
    """The store's first publication waits ``seconds`` on its worker thread; the event is set
    when it starts waiting."""
    publish: Callable[[Manifest], object] = service.store.publish
    entered = threading.Event()

    def slow(manifest: Manifest) -> object:
        if not entered.is_set():
            entered.set()
            time.sleep(seconds)
        return publish(manifest)

    monkeypatch.setattr(service.store, "publish", slow)
    return entered


def sequences(service: RolloutService) -> list[int]:
    return sorted(m.sequence for m in service.store.list())


async def test_a_checkpoint_call_past_its_deadline_still_completes(tmp_path, monkeypatch):
    s = service(tmp_path, interval_s=0)
    slow_first_publish(s, monkeypatch, seconds=0.5)
    addresses = await s.start()
    try:
        async with grpc.aio.insecure_channel(addresses.grpc) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await stub.Checkpoint(pb.CheckpointRequest(tag="late"), timeout=0.2)
            assert late.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            for _ in range(200):  # the late attempt goes on and completes
                status = await stub.GetStatus(pb.GetStatusRequest(), timeout=10)
                if status.last_checkpoint.sequence == 1:
                    break
                await asyncio.sleep(0.05)
            after = await stub.Checkpoint(pb.CheckpointRequest(tag="after"), timeout=10)
    finally:
        await s.shutdown()
    assert after.outcome == pb.CHECKPOINT_OUTCOME_COMPLETED, after.message
    assert after.sequence == 2
    assert sequences(s) == [1, 2, 3]  # late, after, final
    assert s.checkpointer.last_attempt is not None
    assert s.checkpointer.last_attempt.outcome is Outcome.COMPLETED


async def test_shutdown_during_a_periodic_checkpoint_follows_it(tmp_path, monkeypatch):
    s = service(tmp_path, interval_s=0.1)
    entered = slow_first_publish(s, monkeypatch, seconds=0.5)
    await s.start()
    assert await asyncio.to_thread(entered.wait, 10)
    await s.shutdown()
    final = s.checkpointer.last_attempt
    assert final is not None and final.trigger is Trigger.SHUTDOWN
    assert final.outcome is Outcome.COMPLETED, final.error
    assert final.sequence == 2
    assert sequences(s)[-2:] == [1, 2]
