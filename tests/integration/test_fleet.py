"""A fleet of three replicas on one dataset, some SIGKILLed at random instants and restarted with
``--restore latest``: over one epoch the fleet acknowledges every prompt exactly once, and no
group id names two prompts across the fleet."""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest

from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc
from tests.integration.proc import ServeProcess

pytestmark = pytest.mark.process

PROMPTS = 45
REPLICAS = 3
GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)


class Replica:
    """One replica of the fleet: its own store, restarted after each kill."""

    def __init__(self, workdir: Path, index: int) -> None:
        self.workdir, self.index = workdir, index
        self.proc: ServeProcess | None = None
        self.listening = False
        """Started and listening: the killer strikes only then (not while it starts)."""
        self.lives = 0
        self.pending: list[tuple[str, list[str], int]] = []
        """Acks whose RPC died with the process: retried after the restart."""

    def ensure_running(self) -> pb_grpc.RolloutServiceStub:
        if self.proc is None or self.proc.proc.poll() is not None:
            self.listening = False
            if self.proc is not None:
                self.proc.kill()
            self.proc = ServeProcess.synthetic(
                self.workdir / f"ckpt-{self.index}",
                "--dataset",
                str(self.workdir / "prompts.jsonl"),
                "--epochs",
                "1",
                "--group-size",
                "2",
                "--checkpoint-interval",
                "0.25",
                "--restore",
                "latest",
                "--replica",
                str(self.index),
                "--replicas",
                str(REPLICAS),
                env={
                    "ROLLOUTD_ENGINE__SYNTHETIC__TOKENS_PER_S": "50",
                    "ROLLOUTD_ENGINE__MAX_TOKENS": "32",
                    "ROLLOUTD_LIMITS__MAX_IN_FLIGHT": "2",
                    "ROLLOUTD_LIMITS__BUFFER_CAPACITY": "4",
                    # a lease whose grant died with the process comes back this soon
                    "ROLLOUTD_LIMITS__LEASE_TIMEOUT_S": "8",
                },
                cwd=self.workdir,
                log_path=self.workdir / f"serve-{self.index}.log",
            )
            self.channel = grpc.insecure_channel(self.proc.wait_listening())
            self.stub = pb_grpc.RolloutServiceStub(self.channel)
            self.lives += 1
            self.listening = True
        return self.stub


def test_a_fleet_with_random_sigkills_acknowledges_every_prompt_once(tmp_path):
    (tmp_path / "prompts.jsonl").write_text(
        "".join(
            json.dumps({"id": f"q{i}", "prompt": f"what is {i}?"}) + "\n" for i in range(PROMPTS)
        )
    )
    fleet = [Replica(tmp_path, i) for i in range(REPLICAS)]
    acked: Counter[str] = Counter()
    ids: dict[int, set[str]] = {}
    step = 0
    rng = random.Random(3)
    kills = 0
    stop = threading.Event()

    def killer() -> None:
        nonlocal kills
        while not stop.wait(rng.uniform(0.3, 1.0)) and kills < 6:
            victim = rng.choice(fleet)
            if victim.listening and victim.proc is not None:
                victim.listening = False
                victim.proc.kill()
                kills += 1

    for r in fleet:
        r.ensure_running()
    threading.Thread(target=killer, daemon=True).start()
    deadline = time.monotonic() + 240
    try:
        while len(acked) < PROMPTS and time.monotonic() < deadline:
            for r in fleet:  # round-robin over the fleet; ack on the granting replica
                try:
                    stub = r.ensure_running()
                    while r.pending:
                        lease_id, keys, s = r.pending[0]
                        try:
                            stub.AckGroups(pb.AckGroupsRequest(lease_id=lease_id, trainer_step=s))
                            acked.update(keys)
                        except grpc.RpcError as exc:
                            # expired while its replica was down: its groups come back
                            if exc.code() != grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
                                raise
                        r.pending.pop(0)
                    f = stub.FetchGroups(pb.FetchGroupsRequest(max_groups=2, wait_ms=100))
                    if not f.lease_id:
                        continue
                    keys = [g.prompt_id for g in f.groups]
                    for g in f.groups:
                        ids.setdefault(g.group_id, set()).add(g.prompt_id)
                    again = [k for k in keys if acked[k]]
                    assert not again, f"acknowledged prompts delivered again: {again}"
                    step += 1
                    r.pending.append((f.lease_id, keys, step))
                    stub.AckGroups(pb.AckGroupsRequest(lease_id=f.lease_id, trainer_step=step))
                    r.pending.pop()
                    acked.update(keys)
                except grpc.RpcError as exc:
                    # NOT_FOUND for an ack would mean a lease lost in a restart: not tolerated
                    if exc.code() not in GONE:  # type: ignore[attr-defined]
                        raise
        stop.set()
        statuses = [r.ensure_running().GetStatus(pb.GetStatusRequest(), timeout=10) for r in fleet]
    finally:
        stop.set()
        for r in fleet:
            if r.proc is not None:
                r.proc.kill()
    twice = {k: n for k, n in acked.items() if n != 1}
    assert not twice, f"acknowledged more than once: {twice}"
    assert sorted(acked) == sorted(f"q{i}" for i in range(PROMPTS)), "prompts never acknowledged"
    assert kills >= 3 and sum(r.lives for r in fleet) >= REPLICAS + 3
    assert [(s.replica, s.replicas) for s in statuses] == [(i, REPLICAS) for i in range(REPLICAS)]
    assert all(s.dataset_exhausted for s in statuses)
    shared = {gid: p for gid, p in ids.items() if len(p) > 1}
    assert not shared, f"group ids naming several prompts across the fleet: {shared}"
