"""Per-RPC metrics and the delivery counters, read from a real service's /metrics registry."""

from __future__ import annotations

import grpc
import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rolloutd.v1 import rollout_pb2 as pb
from tests.waiting import eventually


@pytest.fixture(autouse=True)
def sdk_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite disables the SDK (the no-op SDK measures nothing); these services measure."""
    monkeypatch.setenv("OTEL_SDK_DISABLED", "false")


def _samples(service) -> dict[tuple[str, frozenset], float]:
    text = generate_latest(service.telemetry.prometheus_registry).decode()
    return {
        (
            s.name,
            frozenset((k, v) for k, v in s.labels.items() if not k.startswith("otel_")),
        ): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_every_rpc_is_timed_by_method_and_status_code(serve):
    service, stub = await serve()
    await stub.FetchGroups(pb.FetchGroupsRequest(max_groups=1, wait_ms=5000))
    with pytest.raises(grpc.aio.AioRpcError):
        await stub.FetchGroups(pb.FetchGroupsRequest(max_groups=0))
    await stub.GetStatus(pb.GetStatusRequest())
    samples = _samples(service)

    def count(method: str, code: grpc.StatusCode) -> float:
        labels = frozenset(
            {"rpc_method": method, "rpc_grpc_status_code": str(code.value[0])}.items()
        )
        return samples.get(("rpc_server_duration_seconds_count", labels), 0)

    assert count("FetchGroups", grpc.StatusCode.OK) == 1
    assert count("FetchGroups", grpc.StatusCode.INVALID_ARGUMENT) == 1
    assert count("GetStatus", grpc.StatusCode.OK) == 1


async def test_lease_expiries_requeues_and_pending_prompts_are_metrics(serve):
    service, stub = await serve(
        **{"limits.lease_timeout_s": 0.2, "limits.max_in_flight": 1, "limits.buffer_capacity": 1}
    )
    lease = await stub.FetchGroups(pb.FetchGroupsRequest(max_groups=1, wait_ms=5000))
    assert lease.groups
    prompts = [pb.Prompt(prompt_id=f"s{i}", text=f"say {i}") for i in range(3)]
    await stub.SubmitPrompts(pb.SubmitPromptsRequest(prompts=prompts))
    expired = ("rolloutd_leases_expired_total", frozenset())
    requeued = ("rolloutd_groups_requeued_total", frozenset())
    pending = ("rolloutd_prompts_pending", frozenset())

    async def scraped() -> tuple[dict[tuple[str, frozenset], float], pb.GetStatusResponse] | None:
        """The scrape once it shows the expiry and the status's pending prompts (the gauges'
        snapshot is refreshed once a second)."""
        status = await stub.GetStatus(pb.GetStatusRequest())
        samples = _samples(service)
        shown = (
            samples.get(expired, 0) >= 1
            and samples.get(requeued, 0) >= len(lease.groups)
            and samples.get(pending) == status.pending_prompts
        )
        return (samples, status) if shown else None

    samples, status = await eventually("the expired lease and pending prompts scraped", scraped)
    assert samples[expired] >= 1
    assert samples[requeued] >= len(lease.groups)
    assert samples[pending] == status.pending_prompts > 0
