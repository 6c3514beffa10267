"""A real service whose buffer holds more committed rows than a seal takes (synthetic engine,
SIGKILL): the rows delivered from the sealed Arrow batches, written to a snapshot from them and
restored from it are the rows generated."""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import pytest

from rolloutd.domain.buffer import SEAL_HELD_ROWS
from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc
from tests.integration.proc import ServeProcess

pytestmark = pytest.mark.process

GROUP_SIZE = 8
PROMPTS = 2304
ENV = {
    "ROLLOUTD_ENGINE__SYNTHETIC__TOKENS_PER_S": "0",
    "ROLLOUTD_ENGINE__MAX_TOKENS": "8",
    "ROLLOUTD_LIMITS__MAX_IN_FLIGHT": "64",
    "ROLLOUTD_LIMITS__BUFFER_CAPACITY": str(PROMPTS),
    "ROLLOUTD_LIMITS__LEASE_TIMEOUT_S": "1",
    # the buffer fills with no trainer: staleness gating would stop at what one could consume
    "ROLLOUTD_LIMITS__STALENESS_GATING": "false",
}


def serve(tmp_path: Path) -> ServeProcess:
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"id": f"q{i}", "prompt": f"{i} + {i}?"}) + "\n" for i in range(PROMPTS))
    )
    return ServeProcess.synthetic(
        tmp_path / "ckpt",
        "--dataset",
        str(path),
        "--epochs",
        "1",
        "--group-size",
        str(GROUP_SIZE),
        "--checkpoint-interval",
        "0",
        "--restore",
        "latest",
        env=ENV,
        cwd=tmp_path,
        log_path=tmp_path / "serve.log",
    )


def fetch_all(stub: pb_grpc.RolloutServiceStub) -> dict[int, tuple[str, list[bytes]]]:
    """Every buffered group, leased and not acked: group id -> (prompt id, each sample's bytes)."""
    got: dict[int, tuple[str, list[bytes]]] = {}
    deadline = time.monotonic() + 60
    while len(got) < PROMPTS and time.monotonic() < deadline:
        r = stub.FetchGroups(pb.FetchGroupsRequest(max_groups=256, wait_ms=1000), timeout=15)
        for g in r.groups:
            got[g.group_id] = (g.prompt_id, [s.SerializeToString() for s in g.samples])
    assert len(got) == PROMPTS, f"fetched {len(got)} of {PROMPTS} groups"
    return got


def test_sealed_rows_are_delivered_and_restored_as_generated(tmp_path):
    assert PROMPTS * GROUP_SIZE > SEAL_HELD_ROWS  # the buffer seals its oldest rows as it fills
    p = serve(tmp_path)
    try:
        with grpc.insecure_channel(p.wait_listening()) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            deadline = time.monotonic() + 60
            while stub.GetStatus(pb.GetStatusRequest(), timeout=10).buffer.committed < PROMPTS:
                assert time.monotonic() < deadline, "the buffer did not fill"
                time.sleep(0.1)
            before = fetch_all(stub)
            done = stub.Checkpoint(pb.CheckpointRequest(), timeout=60)
            assert done.rows_written == PROMPTS * GROUP_SIZE
    finally:
        p.kill()

    q = serve(tmp_path)
    try:
        with grpc.insecure_channel(q.wait_listening()) as channel:
            after = fetch_all(pb_grpc.RolloutServiceStub(channel))  # once the leases expire
    finally:
        q.terminate()
    assert after == before
    for _, samples in before.values():
        assert len(samples) == GROUP_SIZE
