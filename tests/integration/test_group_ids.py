"""Group ids are unique for the life of a store, also across a SIGKILL: a group acked after the
last snapshot keeps its id to itself after the restart (a trainer dedupes and accounts by id)."""

from __future__ import annotations

import pytest

from rolloutd.client import RolloutClient
from tests.integration.proc import ServeProcess

pytestmark = pytest.mark.process


def serve(tmp_path, restore: str) -> ServeProcess:
    return ServeProcess.synthetic(
        tmp_path / "ckpt",
        "--group-size",
        "2",
        "--checkpoint-interval",
        "0",
        "--restore",
        restore,
        env={"ROLLOUTD_LIMITS__BUFFER_CAPACITY": "4", "ROLLOUTD_LIMITS__MAX_IN_FLIGHT": "2"},
        cwd=tmp_path,
    )


def test_ids_of_groups_acked_after_the_snapshot_are_not_issued_again(tmp_path):
    p = serve(tmp_path, "none")
    acked: dict[int, str] = {}
    with RolloutClient(p.wait_listening(), interceptors=[]) as client:
        for step in range(1, 7):
            lease = client.fetch(max_groups=2, wait_ms=5000)
            assert lease is not None
            client.ack(lease, step)
            acked.update({g.group_id: g.prompt_id for g in lease.groups})
            if step == 2:
                client.checkpoint(trainer_step=2)
    p.kill()  # the acks of steps 3-6 are durable (journaled) but in no snapshot
    p = serve(tmp_path, "latest")
    try:
        with RolloutClient(p.wait_listening(), interceptors=[]) as client:
            fresh: dict[int, str] = {}
            while len(fresh) < 8:
                lease = client.fetch(max_groups=2, wait_ms=5000)
                assert lease is not None
                fresh.update({g.group_id: g.prompt_id for g in lease.groups})
                client.ack(lease, 7)
        reused = {g: (acked[g], fresh[g]) for g in fresh.keys() & acked.keys()}
        assert not reused, f"group ids issued again after the restart (acked prompt, new): {reused}"
    finally:
        p.terminate()
