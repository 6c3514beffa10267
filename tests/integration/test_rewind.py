"""A trainer saves its checkpoint at step 5, goes on to step 10, crashes and restarts from step 5:
``Rewind(5)`` redelivers exactly the groups acked after step 5 — also when rolloutd itself was
restarted in between."""

from __future__ import annotations

import pytest

from rolloutd.client import RolloutClient
from tests.integration.proc import ServeProcess

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
