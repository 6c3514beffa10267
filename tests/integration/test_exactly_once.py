"""Exactly-once across restarts, with the real CLI killed by SIGKILL (synthetic engine): a lease
held across a restart, a submission followed by a crash, an ack before the first snapshot, and
group ids over several crash/restore cycles."""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest

from rolloutd.checkpoint.inspect import main as checkpoints
from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc
from tests.integration.proc import ServeProcess
from tests.waiting import until

pytestmark = pytest.mark.process

PROMPTS = 16
ENV = {
    "ROLLOUTD_ENGINE__SYNTHETIC__TOKENS_PER_S": "300",
    "ROLLOUTD_ENGINE__MAX_TOKENS": "32",
    "ROLLOUTD_LIMITS__MAX_IN_FLIGHT": "2",
    "ROLLOUTD_LIMITS__BUFFER_CAPACITY": "6",
}


def dataset(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "prompt": f"what is {i}?"}) + "\n" for i in range(PROMPTS)
        )
    )
    return path


def serve(tmp_path: Path, interval: str = "0", *extra: str) -> ServeProcess:
    return ServeProcess.synthetic(
        tmp_path / "ckpt",
        "--dataset",
        str(dataset(tmp_path)),
        "--epochs",
        "1",
        "--group-size",
        "2",
        "--checkpoint-interval",
        interval,
        "--restore",
        "latest",
        *extra,
        env=ENV,
        cwd=tmp_path,
        log_path=tmp_path / "serve.log",
    )


def stub_of(channel: grpc.Channel) -> pb_grpc.RolloutServiceStub:
    return pb_grpc.RolloutServiceStub(channel)


def drain(stub: pb_grpc.RolloutServiceStub, step: int, *, within_s: float = 60.0) -> list[str]:
    """Fetches and acks until the epoch is over (leases held elsewhere aside); the prompt ids
    delivered, in order."""
    delivered: list[str] = []
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        r = stub.FetchGroups(pb.FetchGroupsRequest(max_groups=4, wait_ms=300), timeout=10)
        if r.lease_id:
            delivered += [g.prompt_id for g in r.groups]
            stub.AckGroups(pb.AckGroupsRequest(lease_id=r.lease_id, trainer_step=step), timeout=10)
            continue
        s = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
        if s.dataset_exhausted and s.buffer.generating + s.buffer.committed == 0:
            return delivered
    raise AssertionError(f"the epoch did not end in {within_s}s; delivered {delivered}")


def more_admitted_and_snapshotted(
    stub: pb_grpc.RolloutServiceStub, leased: int, interval: str, seen: int
) -> bool:
    """More than ``leased`` groups admitted and, with snapshots, one begun after the snapshot
    ``seen`` ended (``seen`` may have been under way when the lease was granted)."""
    status = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
    snapshotted = interval == "0" or status.last_checkpoint.sequence > seen + 1
    return status.counters.admitted_groups > leased and snapshotted


@pytest.mark.parametrize("interval", ["0", "0.2"], ids=["journal-only", "with-snapshots"])
def test_a_lease_held_across_a_restart_acks_and_is_never_delivered_again(tmp_path, interval):
    p = serve(tmp_path, interval)
    with grpc.insecure_channel(p.wait_listening()) as channel:
        lease = stub_of(channel).FetchGroups(
            pb.FetchGroupsRequest(max_groups=3, wait_ms=10_000), timeout=15
        )
        assert lease.lease_id
        # The kill comes once more groups were admitted, and (with snapshots) once a snapshot
        # holds the lease: the restart must take it from there.
        stub = stub_of(channel)
        seen = stub.GetStatus(pb.GetStatusRequest(), timeout=10).last_checkpoint.sequence
        until(
            "more groups admitted, and a snapshot begun after the lease",
            lambda: more_admitted_and_snapshotted(stub, len(lease.groups), interval, seen),
        )
    p.kill()
    held = [g.prompt_id for g in lease.groups]

    q = serve(tmp_path, interval)
    try:
        with grpc.insecure_channel(q.wait_listening()) as channel:
            stub = stub_of(channel)
            others = drain(stub, 2)  # the held lease's groups go to nobody else meanwhile
            ack = stub.AckGroups(
                pb.AckGroupsRequest(lease_id=lease.lease_id, trainer_step=1), timeout=10
            )
            assert ack.acked_groups == len(held) and not ack.already_acked
            others += drain(stub, 3)
    finally:
        q.terminate()
    assert not set(held) & set(others), "groups of a live lease were delivered to another fetch"
    assert sorted(held + others) == sorted(f"q{i}" for i in range(PROMPTS))


def test_prompts_accepted_just_before_a_sigkill_are_delivered_once(tmp_path):
    p = serve(tmp_path)
    submitted = [f"s{i}" for i in range(12)]
    with grpc.insecure_channel(p.wait_listening()) as channel:
        r = stub_of(channel).SubmitPrompts(
            pb.SubmitPromptsRequest(
                prompts=[pb.Prompt(prompt_id=i, text=f"submitted {i}") for i in submitted]
            ),
            timeout=10,
        )
        assert r.accepted == len(submitted)
    p.kill()  # right after it returned: no snapshot holds them

    q = serve(tmp_path)
    try:
        with grpc.insecure_channel(q.wait_listening()) as channel:
            stub = stub_of(channel)
            again = stub.SubmitPrompts(
                pb.SubmitPromptsRequest(prompts=[pb.Prompt(prompt_id="s0", text="submitted s0")]),
                timeout=10,
            )
            assert again.duplicates == 1  # idempotent by prompt id across the restart
            delivered = drain(stub, 1)
    finally:
        q.terminate()
    counts = Counter(d for d in delivered if d.startswith("s"))
    assert counts == Counter(submitted), counts


def test_submissions_admitted_long_ago_stay_idempotent_after_a_sigkill(tmp_path):
    """Prompts in a snapshot's submissions pieces (some admitted and acked before it) and
    prompts only the journal holds: after a SIGKILL each is still known by id and delivered
    once in all."""
    early = [pb.Prompt(prompt_id=f"s{i}", text=f"submitted {i}") for i in range(40)]
    late = [pb.Prompt(prompt_id=f"t{i}", text=f"late {i}") for i in range(5)]
    p = serve(tmp_path)
    acked: list[str] = []
    with grpc.insecure_channel(p.wait_listening()) as channel:
        stub = stub_of(channel)
        assert stub.SubmitPrompts(pb.SubmitPromptsRequest(prompts=early), timeout=10).accepted == 40
        while len(acked) < 6:  # submitted prompts go first
            r = stub.FetchGroups(pb.FetchGroupsRequest(max_groups=4, wait_ms=10_000), timeout=15)
            acked += [g.prompt_id for g in r.groups]
            stub.AckGroups(pb.AckGroupsRequest(lease_id=r.lease_id, trainer_step=1), timeout=10)
        c = stub.Checkpoint(pb.CheckpointRequest(), timeout=30)
        assert c.sequence > 0
        assert stub.SubmitPrompts(pb.SubmitPromptsRequest(prompts=late), timeout=10).accepted == 5
    p.kill()  # the late prompts are in the journal only
    assert {a for a in acked if a.startswith("s")} >= {"s0", "s1"}

    q = serve(tmp_path)
    try:
        with grpc.insecure_channel(q.wait_listening()) as channel:
            stub = stub_of(channel)
            again = stub.SubmitPrompts(
                pb.SubmitPromptsRequest(prompts=[early[0], early[39], late[4]]), timeout=10
            )
            assert (again.accepted, again.duplicates) == (0, 3)
            with pytest.raises(grpc.RpcError) as refused:
                stub.SubmitPrompts(
                    pb.SubmitPromptsRequest(prompts=[pb.Prompt(prompt_id="s0", text="other")]),
                    timeout=10,
                )
            # a conflict with what was accepted (tests/api/test_contract.py)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "'s0'" in refused.value.details()
            delivered = drain(stub, 2)
    finally:
        q.terminate()
    counts = Counter(d for d in acked + delivered if d[0] in "st")
    assert counts == Counter(x.prompt_id for x in early + late), counts
    store = tmp_path / "ckpt"
    assert any((store / "submissions").iterdir())
    assert checkpoints(["verify", "--dir", str(store)]) == 0
    sampler = json.loads(max((store / "sidecars").iterdir()).read_bytes())["sampler"]
    assert "submitted" not in sampler and sampler["submitted_len"] == 45  # a count, not prompts


def test_an_ack_before_the_first_snapshot_holds_after_a_sigkill(tmp_path):
    p = serve(tmp_path)  # --checkpoint-interval 0: no snapshot until shutdown
    with grpc.insecure_channel(p.wait_listening()) as channel:
        stub = stub_of(channel)
        lease = stub.FetchGroups(pb.FetchGroupsRequest(max_groups=3, wait_ms=10_000), timeout=15)
        stub.AckGroups(pb.AckGroupsRequest(lease_id=lease.lease_id, trainer_step=1), timeout=10)
    p.kill()
    assert not (tmp_path / "ckpt" / "manifests").exists() or not any(
        (tmp_path / "ckpt" / "manifests").iterdir()
    )

    q = serve(tmp_path)
    try:
        with grpc.insecure_channel(q.wait_listening()) as channel:
            stub = stub_of(channel)
            again = stub.AckGroups(
                pb.AckGroupsRequest(lease_id=lease.lease_id, trainer_step=1), timeout=10
            )
            assert again.already_acked  # the ack held, and acks again idempotently
            delivered = drain(stub, 2)
    finally:
        q.terminate()
    acked = [g.prompt_id for g in lease.groups]
    assert not set(acked) & set(delivered), "acknowledged prompts delivered again"
    assert sorted(acked + delivered) == sorted(f"q{i}" for i in range(PROMPTS))
    assert "starting fresh" not in (tmp_path / "serve.log").read_text()


def test_no_group_id_names_two_prompts_over_several_sigkill_cycles(tmp_path):
    rng = random.Random(11)
    names: dict[int, set[str]] = {}
    for life in range(4):
        p = serve(tmp_path)  # no periodic snapshots: a crash loses all since the last one
        try:
            with grpc.insecure_channel(p.wait_listening()) as channel:
                stub = stub_of(channel)
                # submitted prompts go first: after a crash they would take the ids of the
                # groups admitted since the snapshot, if those were issued again
                fresh = [pb.Prompt(prompt_id=f"s{life}-{i}", text=f"s{life}") for i in range(2)]
                stub.SubmitPrompts(pb.SubmitPromptsRequest(prompts=fresh), timeout=10)
                deadline = time.monotonic() + rng.uniform(0.5, 1.5)
                while time.monotonic() < deadline:
                    r = stub.FetchGroups(pb.FetchGroupsRequest(max_groups=2, wait_ms=300))
                    for g in r.groups:
                        names.setdefault(g.group_id, set()).add(g.prompt_id)
                    if r.lease_id and rng.random() < 0.5:
                        stub.AckGroups(
                            pb.AckGroupsRequest(lease_id=r.lease_id, trainer_step=life + 1)
                        )
                    if life == 1 and len(names) > 8:
                        stub.Checkpoint(pb.CheckpointRequest(), timeout=30)
                s = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
        finally:
            p.kill()
        assert s.counters.admitted_groups > 0
    reused = {gid: prompts for gid, prompts in names.items() if len(prompts) > 1}
    assert not reused, f"group ids that named several prompts: {reused}"
    assert len(names) >= 4
