"""A damaged journal, found by the real service after a SIGKILL: a record cut in half at the tail
is discarded and reported, and reported as lost when it was acknowledged; a changed byte before
whole records refuses the start with what to do, and `rolloutd checkpoints repair-journal` is a
way out that works."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import grpc
import pytest

from rolloutd.checkpoint.journal_frames import scan
from rolloutd.client import RolloutClient
from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc
from tests.integration.proc import ServeProcess

pytestmark = pytest.mark.process

ARGS = ("--group-size", "2", "--checkpoint-interval", "0", "--restore", "latest")


def serve(tmp_path: Path) -> ServeProcess:
    return ServeProcess.synthetic(tmp_path / "ckpt", *ARGS, cwd=tmp_path)


def journal_files(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "ckpt" / "journal").glob("*.jsonl"))


def acknowledged(tmp_path: Path) -> int:
    mark = tmp_path / "ckpt" / "journal" / "acknowledged"
    return int(mark.read_bytes().split()[0]) if mark.exists() else 0


def checkpoints(*args: str) -> subprocess.CompletedProcess[str]:
    rolloutd = str(ServeProcess.python_bin("rolloutd"))
    return subprocess.run([rolloutd, "checkpoints", *args], capture_output=True, text=True)


def wait_for(predicate, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_an_acknowledged_record_cut_in_half_is_reported_on_restart(tmp_path):
    p = serve(tmp_path)
    try:
        with RolloutClient(p.wait_listening(), interceptors=[]) as client:
            lease = client.fetch(max_groups=2, wait_ms=5000)
            assert lease is not None
            client.ack(lease, 1)
        [newest] = journal_files(tmp_path)
        last = scan(newest.read_bytes()).entries[-1]
        assert last.record["lease_id"] == lease.lease_id  # the ack is the last record
        wait_for(lambda: acknowledged(tmp_path) == last.position)
    finally:
        p.kill()
    data = newest.read_bytes()
    start = data.rindex(b"\n", 0, len(data) - 1) + 1
    newest.write_bytes(data[: start + (len(data) - start) // 2])  # the ack cut in half

    verified = checkpoints("verify", "--dir", str(tmp_path / "ckpt"))
    assert verified.returncode == 1
    assert f"positions {last.position} to {last.position} were acknowledged" in verified.stdout

    q = serve(tmp_path)
    try:
        with RolloutClient(q.wait_listening(), interceptors=[]) as client:
            half = f"{(len(data) - start) // 2} bytes at offset {start}"
            assert f"journal/{newest.name}: {half} hold no whole record (cut short" in q.output
            assert "discarded, a torn tail" in q.output
            lost = f"positions {last.position} to {last.position} were acknowledged"
            assert f"the journal lost acknowledged records: {lost}" in q.output
            again = pb.AckGroupsRequest(lease_id=lease.lease_id, trainer_step=1)
            with grpc.insecure_channel(q.grpc) as channel:
                acked = pb_grpc.RolloutServiceStub(channel).AckGroups(again, timeout=10)
            assert not acked.already_acked  # the lost ack the report warned of
    finally:
        q.terminate()


def test_a_changed_byte_in_the_first_record_refuses_the_start_until_repaired(tmp_path):
    p = serve(tmp_path)
    try:
        with RolloutClient(p.wait_listening(), interceptors=[]) as client:
            for step in (1, 2, 3):
                lease = client.fetch(max_groups=2, wait_ms=5000)
                assert lease is not None
                client.ack(lease, step)
    finally:
        p.kill()
    first = journal_files(tmp_path)[0]
    data = bytearray(first.read_bytes())
    data[30] ^= 0x01  # inside the first record's payload
    first.write_bytes(bytes(data))

    refused = serve(tmp_path)
    assert refused.proc.wait(60) == 1
    assert f"the journal is damaged: journal/{first.name}:" in refused.output
    assert "at offset 0 hold no whole record (checksum" in refused.output
    assert "rolloutd checkpoints repair-journal --dir" in refused.output
    assert "check that the path exists" not in refused.output

    store = str(tmp_path / "ckpt")
    assert checkpoints("verify", "--dir", store).returncode == 1
    repaired = checkpoints("repair-journal", "--dir", store)
    assert repaired.returncode == 0, repaired.stderr
    assert f"moved aside to journal-damaged/: journal/{first.name}" in repaired.stdout
    assert (tmp_path / "ckpt" / "journal-damaged" / first.name).exists()
    assert checkpoints("verify", "--dir", store).returncode == 0

    q = serve(tmp_path)
    try:
        with RolloutClient(q.wait_listening(), interceptors=[]) as client:
            assert client.fetch(max_groups=2, wait_ms=5000) is not None
    finally:
        q.terminate()
