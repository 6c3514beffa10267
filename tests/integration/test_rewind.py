"""A trainer saves its checkpoint at step 5, goes on to step 10, crashes and restarts from step 5:
``Rewind(5)`` redelivers exactly the groups acked after step 5 — also when rolloutd itself was
restarted in between."""

from __future__ import annotations

import grpc
import pytest

from rolloutd.client import RolloutClient
from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc
from tests.integration.proc import ServeProcess
from tests.integration.test_disk_faults import tmpfs  # noqa: F401 (a fixture)

pytestmark = pytest.mark.process


def serve(tmp_path) -> ServeProcess:
    return ServeProcess.synthetic(
        tmp_path / "ckpt",
        "--group-size",
        "2",
        "--checkpoint-interval",
        "0",
        env={"ROLLOUTD_LIMITS__REWIND_WINDOW": "20"},
        cwd=tmp_path,
    )


@pytest.mark.parametrize(
    "restart_service", [False, True], ids=["same-service", "service-restarted"]
)
def test_rewind_redelivers_exactly_the_groups_acked_after_the_step(tmp_path, restart_service):
    p = serve(tmp_path)
    address = p.wait_listening()
    acked_at: dict[int, list[int]] = {}
    with RolloutClient(address, interceptors=[]) as client:
        for step in range(1, 11):
            lease = client.fetch(max_groups=2, wait_ms=5000)
            assert lease is not None
            client.ack(lease, step)
            acked_at[step] = [g.group_id for g in lease.groups]
            if step == 5:
                [saved] = client.checkpoint(trainer_step=5, tag="trainer-step-5").values()
                assert saved.sequence > 0
    if restart_service:
        assert p.terminate() == 0
        p = serve(tmp_path)
        address = p.wait_listening()
    try:
        with RolloutClient(address, interceptors=[]) as client:
            [rewound] = client.rewind(5).values()
            after = sorted(g for step in range(6, 11) for g in acked_at[step])
            assert rewound.redelivered_groups == len(after)
            redelivered = []
            while len(redelivered) < len(after):
                lease = client.fetch(max_groups=len(after) - len(redelivered), wait_ms=2000)
                assert lease is not None
                redelivered += [g.group_id for g in lease.groups]
                client.ack(lease, 6)
            assert sorted(redelivered) == after  # first come the rewound groups, and only they
            before = {g for step in range(1, 6) for g in acked_at[step]}
            assert not before & set(redelivered)
    finally:
        p.terminate()


def ack_steps(client: RolloutClient, steps: range) -> dict[int, list[int]]:
    """One lease acked at each step; the groups acked at each."""
    acked_at = {}
    for step in steps:
        lease = client.fetch(max_groups=2, wait_ms=5000)
        assert lease is not None
        client.ack(lease, step)
        acked_at[step] = [g.group_id for g in lease.groups]
    return acked_at


@pytest.mark.parametrize("snapshot_after", [11, 15], ids=["acks-journaled", "acks-in-snapshot"])
def test_a_rewind_survives_a_sigkill_before_the_next_checkpoint(tmp_path, snapshot_after):
    """Acks at steps 1-15 (the window of 8 finalizes those <= 7), a snapshot after step
    ``snapshot_after``, ``Rewind(12)``, SIGKILL: the restarted service delivers the rewound groups
    again, first."""
    env = {"ROLLOUTD_LIMITS__REWIND_WINDOW": "8"}
    args = ("--group-size", "2", "--checkpoint-interval", "0", "--restore", "latest")
    p = ServeProcess.synthetic(tmp_path / "ckpt", *args, env=env, cwd=tmp_path)
    with RolloutClient(p.wait_listening(), interceptors=[]) as client:
        acked_at = ack_steps(client, range(1, snapshot_after + 1))
        [saved] = client.checkpoint().values()
        assert saved.sequence > 0
        acked_at |= ack_steps(client, range(snapshot_after + 1, 16))
        [rewound] = client.rewind(12).values()
    after = sorted(g for step in (13, 14, 15) for g in acked_at[step])
    assert rewound.redelivered_groups == len(after) == 6
    p.kill()

    q = ServeProcess.synthetic(tmp_path / "ckpt", *args, env=env, cwd=tmp_path)
    try:
        with RolloutClient(q.wait_listening(), interceptors=[]) as client:
            lease = client.fetch(max_groups=len(after), wait_ms=5000)
            assert lease is not None
            assert sorted(g.group_id for g in lease.groups) == after
            assert not client.ack(lease, 13).already_acked
    finally:
        q.terminate()


def test_a_rewind_that_cannot_be_made_durable_is_unavailable(tmp_path, tmpfs):  # noqa: F811
    disk, remount = tmpfs
    # A small buffer, so that the snapshot fits on the 256 KiB disk however many groups a slow
    # machine generates before it is taken: a snapshot that does not fit leaves the journal's
    # file open, and then the disk cannot be remounted read-only.
    env = {"ROLLOUTD_LIMITS__BUFFER_CAPACITY": "8", "ROLLOUTD_LIMITS__MAX_IN_FLIGHT": "4"}
    p = ServeProcess.synthetic(
        disk / "ckpt", "--group-size", "2", "--checkpoint-interval", "0", env=env, cwd=tmp_path
    )
    try:
        with RolloutClient(p.wait_listening(), interceptors=[]) as client:
            acked_at = ack_steps(client, range(1, 4))
            # closes the journal's file: a disk with a file open to write cannot be remounted
            # read-only
            [made] = client.checkpoint().values()
            assert made.outcome == pb.CHECKPOINT_OUTCOME_COMPLETED, p.output
        remount("ro")
        with grpc.insecure_channel(p.grpc) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.Rewind(pb.RewindRequest(trainer_step=1), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "durable" in (info.value.details() or "")
            status = stub.GetStatus(pb.GetStatusRequest(), timeout=5)
            # nothing was rewound (a fetch leases one or two groups, whatever was ready)
            assert status.buffer.acked == sum(map(len, acked_at.values()))
    finally:
        remount("rw")
        p.kill()
