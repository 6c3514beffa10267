"""The composition root's lifecycle: an attempt whose caller goes away still finishes, shutdown's
final checkpoint follows the attempts in flight, an on-demand checkpoint during a periodic one
still finalizes its step, a background task that dies turns readiness off (and an unrecoverable
one stops the service with exit code 1), and a failed start shuts down what it started."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rolloutd.api.errors import STATUS, status_of
from rolloutd.checkpoint.manifest import Manifest
from rolloutd.checkpoint.reader import SnapshotNotFound
from rolloutd.config import load_config
from rolloutd.domain.engine import EngineDeadError, EngineError
from rolloutd.domain.errors import InvalidArgument, InvariantError, RestoreRefused, RolloutError
from rolloutd.domain.journal import JournaledAck
from rolloutd.domain.lifecycle import ServingState
from rolloutd.domain.report import Outcome, Trigger
from rolloutd.server import RolloutService
from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc


def service(tmp_path: Path, interval_s: float, **overrides: object) -> RolloutService:
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
            **overrides,
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
            deadline = time.monotonic() + 60  # the late attempt goes on and completes
            while time.monotonic() < deadline:
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


async def test_a_checkpoint_with_a_trainer_step_during_a_periodic_one_finalizes_the_step(
    tmp_path, monkeypatch
):
    s = service(tmp_path, interval_s=0.1)
    entered = slow_first_publish(s, monkeypatch, seconds=1.0)
    addresses = await s.start()
    try:
        async with grpc.aio.insecure_channel(addresses.grpc) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            fetched = await stub.FetchGroups(pb.FetchGroupsRequest(max_groups=2, wait_ms=5000))
            assert fetched.groups
            await stub.AckGroups(pb.AckGroupsRequest(lease_id=fetched.lease_id, trainer_step=3))
            assert await asyncio.to_thread(entered.wait, 10)  # the periodic attempt publishes
            assert s.checkpointer.last_attempt is None  # ... and has not finished yet
            response = await stub.Checkpoint(pb.CheckpointRequest(trainer_step=3), timeout=30)
            status = await stub.GetStatus(pb.GetStatusRequest(), timeout=10)
    finally:
        await s.shutdown()
    assert (response.outcome, response.reason) == (
        pb.CHECKPOINT_OUTCOME_COMPLETED,
        pb.CHECKPOINT_REASON_COMPLETED,
    ), response.message
    assert response.sequence == 2  # after the periodic one
    assert status.counters.finalized_groups == len(fetched.groups)


async def test_a_background_loop_that_raises_turns_readiness_off(tmp_path, monkeypatch):
    s = service(tmp_path, interval_s=0.05)

    def broken(manifest: Manifest) -> None:
        raise RuntimeError("the periodic loop meets a bug")

    monkeypatch.setattr(s.store, "publish", broken)
    addresses = await s.start()
    try:
        async with grpc.aio.insecure_channel(addresses.grpc) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            ready = health_pb2.HealthCheckRequest(service="rolloutd.v1.RolloutService")
            for _ in range(200):
                if (await health.Check(ready)).status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                await asyncio.sleep(0.05)
            stub = pb_grpc.RolloutServiceStub(channel)
            status = await stub.GetStatus(pb.GetStatusRequest(), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.FetchGroups(pb.FetchGroupsRequest(max_groups=1), timeout=10)
            reason = s.lifecycle.reason
    finally:
        await s.shutdown(final_checkpoint=False)
    assert status.state == pb.SERVING_STATE_NOT_READY
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "checkpoints ended: the periodic loop meets a bug" in reason


async def test_an_invariant_violation_in_a_background_loop_exits_non_zero(tmp_path, monkeypatch):
    s = service(tmp_path, interval_s=0.05)

    def violated(manifest: Manifest) -> None:
        raise InvariantError("a snapshot would lose rows")

    monkeypatch.setattr(s.store, "publish", violated)
    await s.start()
    code = await asyncio.wait_for(s.run_until_stopped(), 30)
    assert code == 1
    assert s.lifecycle.state is ServingState.DRAINING


async def test_an_engine_that_dies_while_idle_turns_not_ready_and_exits_non_zero(tmp_path):
    """Nothing asks the engine for anything (no dataset left, no trainer): its death is noticed
    all the same, through the engine's own ``check_alive``."""
    s = service(tmp_path, interval_s=0, **{"dataset.epochs": 1})
    addresses = await s.start()
    reasons: list[str | None] = []

    def dead() -> None:
        raise EngineDeadError("the engine process exited")

    s.engine.check_alive = dead  # type: ignore[method-assign]
    async with grpc.aio.insecure_channel(addresses.grpc) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        ready = health_pb2.HealthCheckRequest(service="rolloutd.v1.RolloutService")
        deadline = time.monotonic() + 30
        while (await health.Check(ready)).status == health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "still SERVING after the engine died"
            await asyncio.sleep(0.05)
        reasons.append(s.lifecycle.reason)
    code = await asyncio.wait_for(s.run_until_stopped(), 30)
    assert code == 1
    assert reasons == ["not ready: engine ended: the engine process exited"]


async def test_a_failed_start_shuts_down_what_it_started(tmp_path):
    first = service(tmp_path, interval_s=0)
    await first.start()
    await first.shutdown()  # leaves snapshot 1, taken with group_size 4
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    second = service(tmp_path, interval_s=0, group_size=2, restore="latest", **{"grpc.port": port})
    with pytest.raises(RestoreRefused, match="group_size"):
        await second.start()
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))  # the gRPC server let its port go
    assert second.lifecycle.state is ServingState.DRAINING
    assert sequences(second) == [1]  # no final checkpoint hides the snapshot it refused


async def test_a_restore_target_that_does_not_exist_fails_before_the_engine_starts(
    tmp_path, monkeypatch
):
    s = service(tmp_path, interval_s=0, restore="step-999")
    started: list[bool] = []

    async def start() -> None:
        started.append(True)

    monkeypatch.setattr(s.engine, "start", start)
    with pytest.raises(SnapshotNotFound, match="step-999"):
        await s.start()
    assert started == []


async def test_the_ready_line_says_what_the_start_restored(tmp_path, caplog):
    caplog.set_level("INFO", logger="rolloutd.server")
    first = service(tmp_path, interval_s=0, restore="latest")
    await first.start()
    await first.shutdown()
    second = service(tmp_path, interval_s=0, restore="latest")
    await second.start()
    await second.shutdown()
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ready: ")]
    assert len(ready) == 2, ready
    assert "started fresh: no snapshot in" in ready[0] and "--restore none" in ready[0]
    assert "restored snapshot 1 from" in ready[1] and "--restore none starts fresh" in ready[1]
    assert "dashboard off" in ready[1]


def test_every_domain_and_engine_error_has_a_status():
    def subclasses(cls: type) -> set[type]:
        return {cls} | {s for sub in cls.__subclasses__() for s in subclasses(sub)}

    errors = subclasses(RolloutError) - {RolloutError} | {EngineError, EngineDeadError}
    assert {e: status_of(e("f", "x") if issubclass(e, InvalidArgument) else e("x")) for e in errors}
    assert STATUS[EngineError] is grpc.StatusCode.INVALID_ARGUMENT
    assert STATUS[EngineDeadError] is grpc.StatusCode.UNAVAILABLE


async def test_acks_of_earlier_leases_are_taken_while_failed_checkpoints_hold_readiness_off(
    tmp_path, monkeypatch
):
    """Not ready stops new work only: refusing the ack would let the lease expire and its
    groups be delivered twice. The journal is writable; only publishing snapshots fails."""
    s = service(tmp_path, interval_s=0.05, **{"checkpoint.max_consecutive_failures": 2})
    publish = s.store.publish
    failing = True

    def unpublishable(manifest: Manifest) -> None:
        if failing:
            raise OSError(28, "No space left on device")
        publish(manifest)

    monkeypatch.setattr(s.store, "publish", unpublishable)
    addresses = await s.start()
    try:
        async with grpc.aio.insecure_channel(addresses.grpc) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            lease = await stub.FetchGroups(pb.FetchGroupsRequest(max_groups=2, wait_ms=10_000))
            assert lease.lease_id
            for _ in range(200):
                if not s.lifecycle.state.ready:
                    break
                await asyncio.sleep(0.05)
            assert s.lifecycle.state is ServingState.NOT_READY
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.FetchGroups(pb.FetchGroupsRequest(max_groups=1), timeout=10)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
            ack = await stub.AckGroups(
                pb.AckGroupsRequest(lease_id=lease.lease_id, trainer_step=1), timeout=10
            )
            assert ack.acked_groups == len(lease.groups) and not ack.already_acked
            failing = False
    finally:
        await s.shutdown()
    acked = [
        e.record.lease_id for e in s.store.journal.events_after(0) if isinstance(e, JournaledAck)
    ]
    assert lease.lease_id in acked  # durable
