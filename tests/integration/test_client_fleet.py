"""The Python client over a fleet, against real services: a fetch returns as soon as any replica
has groups, strands no lease, and backs off from an endpoint that fails (probing it later)."""

from __future__ import annotations

import json
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from rolloutd.client import RolloutClient
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc
from tests.integration.proc import ServeProcess

pytestmark = pytest.mark.process


def replica(tmp_path: Path, index: int, prompts: int, tokens_per_s: str) -> ServeProcess:
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "prompt": f"what is {i}?"}) + "\n" for i in range(prompts)
        )
    )
    return ServeProcess.synthetic(
        tmp_path / f"ckpt-{index}",
        "--dataset",
        str(dataset),
        "--epochs",
        "1",
        "--group-size",
        "2",
        "--replica",
        str(index),
        "--replicas",
        "2",
        env={
            "ROLLOUTD_ENGINE__SYNTHETIC__TOKENS_PER_S": tokens_per_s,
            "ROLLOUTD_ENGINE__MAX_TOKENS": "32",
        },
        cwd=tmp_path,
        log_path=tmp_path / f"serve-{index}.log",
    )


class Unavailable(pb_grpc.RolloutServiceServicer):
    """An endpoint that is up but cannot serve (draining, failed): it counts the fetches it gets."""

    def __init__(self) -> None:
        self.fetches = 0

    def FetchGroups(self, request, context):
        self.fetches += 1
        context.abort(grpc.StatusCode.UNAVAILABLE, "draining")


@pytest.fixture
def unavailable():
    servicer = Unavailable()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_RolloutServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(None)


def test_a_fetch_returns_the_first_lease_of_any_replica(tmp_path):
    # replica 1 of 2 on a one-prompt dataset owns nothing; replica 0's group takes a while
    empty, slow = replica(tmp_path, 1, 1, "300"), replica(tmp_path, 0, 1, "20")
    try:
        endpoints = [slow.wait_listening(), empty.wait_listening()]
        with RolloutClient(endpoints, interceptors=[]) as client:
            lease = client.fetch(max_groups=1, wait_ms=30_000)
            assert lease is not None, "the replica that filled while another was waited on"
            assert lease.endpoint == endpoints[0]
            assert [g.prompt_id for g in lease.groups] == ["q0"]
            assert client.ack(lease, 1).acked_groups == 1
    finally:
        empty.terminate()
        slow.terminate()


def test_fetches_over_a_fleet_strand_no_lease(tmp_path):
    """Calls still waiting when another replica answered bring their leases back later: every
    prompt of the epoch arrives, none twice, although no lease expires during the test."""
    fleet = [replica(tmp_path, i, 12, "400") for i in range(2)]
    try:
        endpoints = [p.wait_listening() for p in fleet]
        delivered: list[str] = []
        with RolloutClient(endpoints, interceptors=[]) as client:
            deadline = time.monotonic() + 90
            while len(delivered) < 12 and time.monotonic() < deadline:
                lease = client.fetch(max_groups=1, wait_ms=2000)
                if lease is not None:
                    delivered += [g.prompt_id for g in lease.groups]
                    client.ack(lease, 1)
        assert sorted(delivered) == sorted(f"q{i}" for i in range(12))
    finally:
        for p in fleet:
            p.terminate()


def test_a_failing_endpoint_is_backed_off_and_probed_again_later(tmp_path, unavailable):
    address, servicer = unavailable
    live = replica(tmp_path, 0, 24, "2000")
    try:
        endpoints = [address, live.wait_listening()]
        with RolloutClient(endpoints, interceptors=[], backoff_s=0.5, max_backoff_s=2) as client:
            got = 0
            for _ in range(8):
                lease = client.fetch(max_groups=1, wait_ms=5000)
                assert lease is not None and lease.endpoint == endpoints[1]
                client.ack(lease, 1)
                got += 1
            asked = servicer.fetches
            assert 1 <= asked < got  # not asked (and waited on) at every fetch
            threading.Event().wait(3.5)  # longer than the longest backoff
            assert client.fetch(max_groups=1, wait_ms=5000) is not None
            assert servicer.fetches > asked  # probed again
    finally:
        live.terminate()
