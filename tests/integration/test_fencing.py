"""One writer per store, with real processes: a second ``serve`` on a live store exits non-zero
naming the holder; a holder frozen with SIGSTOP is taken over after the lock timeout; thawed, it
turns not-ready and publishes nothing; the store verifies, and the new holder restores after a
SIGKILL. On a local directory and on S3 (moto's server)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
import uuid

import grpc
import pytest

from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc
from tests.conftest import BUCKET
from tests.integration.proc import ServeProcess

pytestmark = pytest.mark.process

LOCK_TIMEOUT_S = 2.0


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def store(request, tmp_path) -> tuple[str, dict[str, str], list[str]]:
    """The store's URL, the service's environment and the CLI's options that reach it."""
    if request.param == "local":
        return str(tmp_path / "ckpt"), {}, []
    options = request.getfixturevalue("s3_options")
    return (
        f"s3://{BUCKET}/{uuid.uuid4().hex}",
        {"ROLLOUTD_CHECKPOINT__STORAGE_OPTIONS": json.dumps(options)},
        [arg for k, v in options.items() for arg in ("--storage-option", f"{k}={v}")],
    )


def serve(tmp_path, store, name: str, lock_timeout_s: float = LOCK_TIMEOUT_S) -> ServeProcess:
    url, env, _ = store
    return ServeProcess.synthetic(
        url,
        "--checkpoint-interval",
        "0.2",
        "--group-size",
        "2",
        env={
            **env,
            "ROLLOUTD_CHECKPOINT__LOCK_TIMEOUT_S": str(lock_timeout_s),
            "ROLLOUTD_ENGINE__MAX_TOKENS": "32",
            "OTEL_SDK_DISABLED": "false",  # periodic_attempts reads its /metrics
        },
        cwd=tmp_path,
        log_path=tmp_path / f"{name}.log",
    )


def status(address: str) -> pb.GetStatusResponse:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.RolloutServiceStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10)


def fetch_and_ack(address: str, step: int) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.RolloutServiceStub(channel)
        r = stub.FetchGroups(pb.FetchGroupsRequest(max_groups=2, wait_ms=10_000), timeout=15)
        assert r.lease_id
        stub.AckGroups(pb.AckGroupsRequest(lease_id=r.lease_id, trainer_step=step), timeout=10)


def completed(p: ServeProcess) -> int:
    return len(re.findall(r"checkpoint \d+ completed in", p.output))


def periodic_attempts(p: ServeProcess) -> float:
    """The periodic checkpoint attempts ``p`` has made, whatever their outcome (its /metrics)."""
    assert p.http is not None
    with urllib.request.urlopen(f"http://{p.http}/metrics", timeout=10) as response:
        scrape = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in scrape.splitlines()
        if line.startswith("rolloutd_checkpoint_attempts_total{") and 'trigger="periodic"' in line
    )


def wait_for(predicate, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def test_one_writer_per_store_and_a_returning_holder_is_fenced(tmp_path, store):
    a = serve(tmp_path, store, "a")
    b = c = None
    try:
        a_address = a.wait_listening()
        fetch_and_ack(a_address, 1)
        wait_for(lambda: completed(a) >= 1)

        # 1. a second serve on the live store fails fast, naming the holder
        started = time.monotonic()
        refused = serve(tmp_path, store, "refused")
        assert refused.proc.wait(60) != 0
        assert time.monotonic() - started < 30
        assert f"pid {a.proc.pid} since " in refused.output, refused.output

        # 2. a frozen holder is taken over once its claim lapses, by a replacement started at once
        os.kill(a.proc.pid, signal.SIGSTOP)
        b = serve(tmp_path, store, "b")
        b_address = b.wait_listening()
        assert "took over the store from" in b.output
        fetch_and_ack(b_address, 2)
        wait_for(lambda: completed(b) >= 1)

        # 3. thawed, the old holder is fenced: not ready, says why, publishes nothing
        before = completed(a)
        os.kill(a.proc.pid, signal.SIGCONT)
        wait_for(lambda: status(a_address).state == pb.SERVING_STATE_NOT_READY)
        wait_for(lambda: "fenced: another process took over the store" in a.output)
        fenced_at = periodic_attempts(a)
        wait_for(lambda: periodic_attempts(a) >= fenced_at + 3)  # the old holder's come and go
        assert completed(a) == before, "a fenced holder published a snapshot"
        assert a.terminate() == 0
        assert "Traceback" not in a.output, a.output
        fetch_and_ack(b_address, 3)
        wait_for(lambda: completed(b) >= 2)

        # 4. the store verifies, and the new holder restores after a SIGKILL
        b.kill()
        url, _, cli_options = store
        verified = subprocess.run(
            [
                str(ServeProcess.python_bin("rolloutd")),
                "checkpoints",
                "verify",
                "--dir",
                url,
                *cli_options,
            ],
            capture_output=True,
            text=True,
        )
        assert verified.returncode == 0, verified.stdout + verified.stderr
        c = serve(tmp_path, store, "c")
        c_address = c.wait_listening()
        assert "restored snapshot" in c.output
        assert status(c_address).counters.acked_groups >= 3
    finally:
        for p in (a, b, c):
            if p is not None and p.proc.poll() is None:
                os.kill(p.proc.pid, signal.SIGCONT)
                p.kill()


def test_a_replacement_started_beside_a_frozen_holder_waits_and_takes_over(tmp_path):
    """As a StatefulSet does when a node stops answering: the holder is frozen (SIGSTOP) and its
    replacement starts on the same store at once, with the default claim wait. It says it waits,
    and takes over when the claim lapses, instead of exiting into a crash loop. A second writer
    started beside the live replacement still exits non-zero, naming it."""
    store = (str(tmp_path / "ckpt"), {}, [])
    # long enough that the claim is still fresh once the replacement's interpreter has started
    lock_timeout_s = 10.0
    a = serve(tmp_path, store, "a", lock_timeout_s)
    b = None
    try:
        a.wait_listening()
        os.kill(a.proc.pid, signal.SIGSTOP)
        frozen = time.monotonic()
        b = serve(tmp_path, store, "b", lock_timeout_s)
        b_address = b.wait_listening()
        took_s = time.monotonic() - frozen
        assert "waiting" in b.output and "for that claim to lapse" in b.output, b.output
        assert f"took over the store from host {socket.gethostname()} pid {a.proc.pid}" in b.output
        print(f"replacement took over {took_s:.1f}s after the holder froze")
        fetch_and_ack(b_address, 1)
        wait_for(lambda: completed(b) >= 1)

        second = serve(tmp_path, store, "second", lock_timeout_s)
        assert second.proc.wait(60) != 0
        assert f"pid {b.proc.pid} since " in second.output, second.output
        assert b.proc.poll() is None
    finally:
        for p in (a, b):
            if p is not None and p.proc.poll() is None:
                os.kill(p.proc.pid, signal.SIGCONT)
                p.kill()
