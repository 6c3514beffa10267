"""A full or read-only checkpoint directory (a real tmpfs, remounted): failed/io_error attempts
with bounded retries, then not-ready, never a crash; when the disk recovers, the next snapshot
holds everything and the service is ready again."""

from __future__ import annotations

import json
import subprocess
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc
from tests.integration.proc import ServeProcess

pytestmark = pytest.mark.process


@pytest.fixture
def tmpfs(tmp_path):
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")

    def remount(options: str) -> None:
        """A read-only remount fails (EBUSY) while a file on the disk is open to write. Between
        checkpoints only the journal's file stays open (a test closes it with a checkpoint);
        others are open briefly (a claim renewal, a line of dashboard history), so the remount
        is tried again until they are closed."""
        deadline = time.monotonic() + 30
        while True:
            r = subprocess.run(
                ["mount", "-o", f"remount,{options}", str(mount_point)],
                capture_output=True,
                text=True,
            )
            if r.returncode == 0:
                return
            busy = "busy" in r.stderr.lower()
            assert busy and time.monotonic() < deadline, f"remount,{options}: {r.stderr.strip()}"
            time.sleep(0.05)

    yield mount_point, remount
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def health(channel, name):
    return (
        health_pb2_grpc.HealthStub(channel)
        .Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        .status
    )


def wait_for(predicate, within_s=30.0):
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def attempts(p: ServeProcess, outcome_reason: str) -> int:
    return p.output.count(f"checkpoint {outcome_reason}")


def test_a_failing_disk_makes_the_service_not_ready_and_it_recovers(tmp_path, tmpfs):
    """A full disk (a store read-only from the start cannot even be claimed: the next test)."""
    disk, remount = tmpfs
    p = ServeProcess.synthetic(
        disk / "ckpt",
        "--checkpoint-interval",
        "0.2",
        "--group-size",
        "4",
        env={
            "ROLLOUTD_CHECKPOINT__MAX_CONSECUTIVE_FAILURES": "3",
            "ROLLOUTD_ENGINE__MAX_TOKENS": "256",
        },
        cwd=tmp_path,
    )
    address = p.wait_listening()
    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            ready = "rolloutd.v1.RolloutService"
            wait_for(lambda: health(channel, ready) == health_pb2.HealthCheckResponse.NOT_SERVING)
            # The log reaches the test through a pipe and a reader thread, possibly after the
            # health change it led to: wait for the line rather than read it at once.
            wait_for(lambda: attempts(p, "failed (io_error)") >= 3, within_s=10)
            assert (
                health(channel, "") == health_pb2.HealthCheckResponse.SERVING
            )  # alive: no restart loop
            status = stub.GetStatus(pb.GetStatusRequest(), timeout=5)
            assert status.state == pb.SERVING_STATE_NOT_READY
            assert status.last_checkpoint.reason == pb.CHECKPOINT_REASON_IO_ERROR
            assert status.last_checkpoint.consecutive_failures >= 3
            with pytest.raises(grpc.RpcError) as info:
                stub.FetchGroups(pb.FetchGroupsRequest(max_groups=1), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            held = status.buffer.committed + status.buffer.generating

            remount("rw,size=64m")
            wait_for(lambda: health(channel, ready) == health_pb2.HealthCheckResponse.SERVING)
            assert p.proc.poll() is None
        assert p.terminate() == 0
    finally:
        if p.proc.poll() is None:
            p.kill()
    listed = subprocess.run(
        [str(p.python_bin("rolloutd")), "checkpoints", "verify", "--dir", str(disk / "ckpt")],
        capture_output=True,
        text=True,
    )
    assert listed.returncode == 0, listed.stdout + listed.stderr
    q = ServeProcess.synthetic(
        disk / "ckpt",
        "--checkpoint-interval",
        "0",
        "--group-size",
        "4",
        env={"ROLLOUTD_ENGINE__MAX_TOKENS": "256"},
        cwd=tmp_path,
    )
    q.wait_listening()
    try:
        restored = [
            json.loads(line.split("groups ", 1)[1].split(", siblings")[0].replace("'", '"'))
            for line in q.output.splitlines()
            if "restored snapshot" in line and "groups " in line  # not the ready line
        ]
        assert restored, q.output
        assert (
            sum(restored[0].values()) >= held
        )  # what was held while the disk failed is in the snapshot
    finally:
        q.terminate()


def test_a_store_that_cannot_be_claimed_at_start_holds_readiness_off_until_it_can(tmp_path, tmpfs):
    disk, remount = tmpfs
    remount("ro")
    p = ServeProcess.synthetic(
        disk / "ckpt",
        "--checkpoint-interval",
        "0.2",
        env={"ROLLOUTD_CHECKPOINT__LOCK_TIMEOUT_S": "1.5"},
        cwd=tmp_path,
    )
    address = p.wait_listening()
    try:
        with grpc.insecure_channel(address) as channel:
            ready = "rolloutd.v1.RolloutService"
            assert health(channel, ready) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert "cannot claim the store" in p.output
            stub = pb_grpc.RolloutServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.FetchGroups(pb.FetchGroupsRequest(max_groups=1), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            remount("rw,size=64m")
            wait_for(lambda: health(channel, ready) == health_pb2.HealthCheckResponse.SERVING)
            r = stub.FetchGroups(pb.FetchGroupsRequest(max_groups=1, wait_ms=10_000), timeout=15)
            assert r.lease_id
        assert p.terminate() == 0
    finally:
        if p.proc.poll() is None:
            p.kill()
