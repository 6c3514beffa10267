import asyncio
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rolloutd.config import ConfigError
from rolloutd.server import RolloutService
from rolloutd.v1 import rollout_pb2 as pb
from tests.api.conftest import service_config


async def test_fetch_returns_whole_groups_with_token_ids_and_a_lease(serve):
    _, stub = await serve(group_size=3)
    r = await stub.FetchGroups(pb.FetchGroupsRequest(max_groups=2, wait_ms=5000, consumer="t"))
    assert r.lease_id and 1 <= len(r.groups) <= 2
    for g in r.groups:
        assert len(g.samples) == 3
        assert sorted(s.index for s in g.samples) == [0, 1, 2]
        for s in g.samples:
            assert len(s.token_ids) > 0 and len(s.logprobs) == len(s.token_ids)
        assert g.source == pb.PROMPT_SOURCE_DATASET
        assert "answer" in g.metadata.fields
    ack = await stub.AckGroups(pb.AckGroupsRequest(lease_id=r.lease_id, trainer_step=1))
    assert ack.acked_groups == len(r.groups) and not ack.already_acked
    again = await stub.AckGroups(pb.AckGroupsRequest(lease_id=r.lease_id, trainer_step=1))
    assert again.already_acked
    t = (await stub.GetStatus(pb.GetStatusRequest())).tokens
    assert t.delivered == sum(len(s.token_ids) for g in r.groups for s in g.samples)
    fates = (t.delivered, t.evicted, t.dropped, t.regenerated, t.failed, t.buffered)
    assert sum(fates) == t.generated and t.goodput == pytest.approx(t.delivered / t.generated)


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (pb.FetchGroupsRequest(max_groups=0), "max_groups"),
        (pb.FetchGroupsRequest(max_groups=-3), "max_groups"),
        (pb.FetchGroupsRequest(max_groups=2**40), "max_groups"),
        (pb.FetchGroupsRequest(max_groups=1, wait_ms=-1), "wait_ms"),
    ],
)
async def test_malformed_fetch_is_invalid_argument_naming_the_field(serve, request_, field):
    _, stub = await serve()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.FetchGroups(request_)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()


async def test_unknown_lease_is_not_found_and_empty_lease_invalid(serve):
    _, stub = await serve()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.AckGroups(pb.AckGroupsRequest(lease_id="nope", trainer_step=1))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.AckGroups(pb.AckGroupsRequest(lease_id="", trainer_step=1))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_submitted_prompts_are_served_first_and_bad_ones_refused(serve):
    _, stub = await serve(
        **{
            "limits.max_in_flight": 1,
            "limits.buffer_capacity": 1,
            "engine.synthetic.tokens_per_s": 200,
        }
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.SubmitPrompts(
            pb.SubmitPromptsRequest(prompts=[pb.Prompt(prompt_id="a", text="  ")])
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompts[0].text" in info.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.SubmitPrompts(pb.SubmitPromptsRequest(prompts=[pb.Prompt(text="hi")]))
    assert "prompt_id" in info.value.details()
    p = pb.Prompt(prompt_id="mine", text="What is 2+2?")
    p.metadata.update({"answer": 4})
    r = await stub.SubmitPrompts(pb.SubmitPromptsRequest(prompts=[p, p]))
    assert (r.accepted, r.duplicates) == (1, 1)
    seen = []
    for _ in range(3):
        f = await stub.FetchGroups(pb.FetchGroupsRequest(max_groups=1, wait_ms=5000))
        seen.extend(f.groups)
        await stub.AckGroups(pb.AckGroupsRequest(lease_id=f.lease_id, trainer_step=1))
    mine = [g for g in seen if g.prompt_id == "mine"]
    assert mine and mine[0].source == pb.PROMPT_SOURCE_SUBMITTED
    assert mine[0].metadata.fields["answer"].number_value == 4


async def test_backpressure_on_submit_is_resource_exhausted(serve):
    _, stub = await serve(**{"limits.max_pending_prompts": 2})
    prompts = [pb.Prompt(prompt_id=str(i), text="q") for i in range(3)]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.SubmitPrompts(pb.SubmitPromptsRequest(prompts=prompts))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_status_and_health(serve):
    service, stub = await serve()
    status = await stub.GetStatus(pb.GetStatusRequest())
    assert status.state == pb.SERVING_STATE_SERVING
    assert status.engine == "synthetic" and status.group_size == 4
    assert status.buffer.capacity == 16
    channel = grpc.aio.insecure_channel(service.addresses.grpc)
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", "rolloutd.v1.RolloutService"):
        r = await health.Check(health_pb2.HealthCheckRequest(service=name))
        assert r.status == health_pb2.HealthCheckResponse.SERVING
    await channel.close()


async def test_bearer_token_required_on_mutating_calls(serve):
    # with a token, every interface may be bound
    _service, stub = await serve(**{"auth.token": "s3cret", "grpc.host": "0.0.0.0"})
    for wrong in ((), (("authorization", "Bearer nope"),), (("authorization", "s3cret"),)):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.FetchGroups(pb.FetchGroupsRequest(max_groups=1), metadata=wrong)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for scheme in ("Bearer", "bearer", "BEARER"):  # RFC 9110: the scheme in any case
        r = await stub.FetchGroups(
            pb.FetchGroupsRequest(max_groups=1, wait_ms=3000),
            metadata=(("authorization", f"{scheme} s3cret"),),
        )
        assert r.lease_id
    await stub.GetStatus(pb.GetStatusRequest())  # read-only: no token needed


def test_a_public_bind_without_a_token_is_refused_before_anything_starts(tmp_path):
    for key in ("grpc.host", "http.host"):
        config = service_config(tmp_path, **{key: "0.0.0.0"})
        with pytest.raises(ConfigError) as info:
            RolloutService(config)
        message = str(info.value)
        assert message.startswith(f"config key '{key}': {key} 0.0.0.0")
        assert "ROLLOUTD_AUTH__TOKEN" in message and "auth.allow_unauthenticated" in message
    assert not (tmp_path / "checkpoints").exists()


async def test_an_explicit_opt_out_serves_without_a_token_and_says_so(serve, caplog):
    with caplog.at_level(logging.WARNING, logger="rolloutd.server"):
        _service, stub = await serve(**{"grpc.host": "0.0.0.0", "auth.allow_unauthenticated": True})
    assert "grpc.host 0.0.0.0: serving without authentication" in caplog.text
    assert (await stub.FetchGroups(pb.FetchGroupsRequest(max_groups=1, wait_ms=3000))).lease_id


async def test_update_weights_bumps_version_and_new_samples_carry_it(serve, tmp_path):
    _, stub = await serve()
    w1 = str(tmp_path)  # the synthetic engine loads nothing, but the path must exist
    r = await stub.UpdateWeights(pb.UpdateWeightsRequest(version=1, weights_path=w1))
    assert r.policy_version == 1
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.UpdateWeights(pb.UpdateWeightsRequest(version=1, weights_path=w1))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    versions = set()
    for _ in range(6):
        f = await stub.FetchGroups(pb.FetchGroupsRequest(max_groups=4, wait_ms=3000))
        versions |= {s.policy_version for g in f.groups for s in g.samples if g.policy_version == 1}
        await stub.AckGroups(pb.AckGroupsRequest(lease_id=f.lease_id, trainer_step=1))
    assert versions == {1}


async def test_liveness_stays_serving_while_readiness_follows_the_state(serve):
    service, _ = await serve()
    channel = grpc.aio.insecure_channel(service.addresses.grpc)
    health = health_pb2_grpc.HealthStub(channel)

    async def check(name):
        return (await health.Check(health_pb2.HealthCheckRequest(service=name))).status

    await service.lifecycle.block("test", "held off by the test")
    assert await check("rolloutd.v1.RolloutService") == health_pb2.HealthCheckResponse.NOT_SERVING
    assert await check("") == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await pb_stub(channel).FetchGroups(pb.FetchGroupsRequest(max_groups=1))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    await service.lifecycle.unblock("test")
    assert await check("rolloutd.v1.RolloutService") == health_pb2.HealthCheckResponse.SERVING
    await channel.close()


def pb_stub(channel):
    from rolloutd.v1 import rollout_pb2_grpc

    return rollout_pb2_grpc.RolloutServiceStub(channel)


@pytest.mark.parametrize("tag", ["5", "007", "latest", "none"])
async def test_a_tag_that_reads_as_a_sequence_or_keyword_is_refused(serve, tag):
    """--restore and `checkpoints show` read digits as a sequence: such a tag would be unreachable."""
    service, stub = await serve()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Checkpoint(pb.CheckpointRequest(tag=tag))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tag" in info.value.details()
    assert service.store.sequences() == []
    ok = await stub.Checkpoint(pb.CheckpointRequest(tag="step-5"))
    assert ok.outcome == pb.CHECKPOINT_OUTCOME_COMPLETED


async def test_not_ready_refuses_new_work_but_takes_acks_rewinds_and_checkpoints(serve):
    service, stub = await serve()
    r = await stub.FetchGroups(pb.FetchGroupsRequest(max_groups=1, wait_ms=5000))
    await service.lifecycle.block("test", "held off by the test")
    for new_work in (
        stub.FetchGroups(pb.FetchGroupsRequest(max_groups=1)),
        stub.SubmitPrompts(pb.SubmitPromptsRequest(prompts=[pb.Prompt(prompt_id="x", text="x")])),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await new_work
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "not_ready" in info.value.details()
    ack = await stub.AckGroups(pb.AckGroupsRequest(lease_id=r.lease_id, trainer_step=1))
    assert ack.acked_groups == 1
    await stub.Rewind(pb.RewindRequest(trainer_step=0))
    c = await stub.Checkpoint(pb.CheckpointRequest(trainer_step=0))
    assert c.outcome == pb.CHECKPOINT_OUTCOME_COMPLETED


async def test_a_fetch_waiting_when_the_drain_begins_is_unavailable(serve):
    service, stub = await serve(**{"limits.max_in_flight": 1, "limits.buffer_capacity": 1})
    first = await stub.FetchGroups(pb.FetchGroupsRequest(max_groups=1, wait_ms=5000))
    assert first.lease_id  # the buffer is full now: the next fetch waits
    fetchable = service.controller.rooms.wakeups.fetchable
    wait_for_ready = fetchable.wait_for
    fetch_waits = asyncio.Event()

    async def watched_wait_for(predicate):
        fetch_waits.set()
        return await wait_for_ready(predicate)

    fetchable.wait_for = watched_wait_for  # type: ignore[method-assign]
    waiting = asyncio.ensure_future(
        stub.FetchGroups(pb.FetchGroupsRequest(max_groups=1, wait_ms=30_000))
    )
    await asyncio.wait_for(fetch_waits.wait(), 30)  # the fetch reached the server and waits
    assert not waiting.done()
    await service.controller.begin_drain()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(waiting, 5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "draining" in info.value.details()
