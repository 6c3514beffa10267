"""Time the service spends frozen does not count against a lease, with a real process: a lease
granted before a SIGSTOP longer than the lease timeout is still acked after SIGCONT, its groups
go to nobody else, and a lease whose trainer really is gone still expires."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc
from tests.integration.proc import ServeProcess

pytestmark = pytest.mark.process

LEASE_TIMEOUT_S = 3.0
FROZEN_S = 6.0


def wait_for(predicate, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def test_a_lease_outlives_a_freeze_and_still_expires_when_its_trainer_is_gone(tmp_path):
    p = ServeProcess.synthetic(
        tmp_path / "ckpt",
        "--group-size",
        "2",
        "--checkpoint-interval",
        "0",
        env={
            "ROLLOUTD_LIMITS__LEASE_TIMEOUT_S": str(LEASE_TIMEOUT_S),
            "ROLLOUTD_ENGINE__MAX_TOKENS": "8",
        },
        cwd=tmp_path,
        log_path=tmp_path / "serve.log",
    )
    try:
        with grpc.insecure_channel(p.wait_listening()) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)

            def fetch() -> pb.FetchGroupsResponse:
                r = stub.FetchGroups(
                    pb.FetchGroupsRequest(max_groups=2, wait_ms=10_000), timeout=15
                )
                assert r.lease_id
                return r

            def requeued_groups() -> int:
                status = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
                return status.counters.requeued_groups

            first = fetch()
            os.kill(p.proc.pid, signal.SIGSTOP)  # a paused VM, a frozen node
            time.sleep(FROZEN_S)
            os.kill(p.proc.pid, signal.SIGCONT)
            ack = stub.AckGroups(
                pb.AckGroupsRequest(lease_id=first.lease_id, trainer_step=1), timeout=10
            )
            assert not ack.already_acked
            assert requeued_groups() == 0

            # a trainer that goes away for good: its lease expires after the timeout of running
            second = fetch()
            wait_for(lambda: requeued_groups() == len(second.groups))
            third = fetch()
    finally:
        p.kill()
    delivered_first = {g.group_id for g in first.groups}
    assert not delivered_first & {g.group_id for g in second.groups}
    assert not delivered_first & {g.group_id for g in third.groups}
    assert "did not run for" in p.output
