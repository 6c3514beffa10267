"""The API contract as a client sees it: metadata delivered exactly, conflicting repeats refused,
invalid prompts refused, reflection v1, an honest synthetic engine."""

from __future__ import annotations

import json

import grpc
import pytest
from google.protobuf import struct_pb2

from rolloutd.v1 import rollout_pb2 as pb
from tests.waiting import eventually

METADATA = {"big": 12345678901234567890, "answer": 12, "ratio": 0.5, "tags": ["a", 1]}


async def _fetch_all(stub, n: int) -> list[pb.Group]:
    groups: list[pb.Group] = []
    while len(groups) < n:
        r = await stub.FetchGroups(pb.FetchGroupsRequest(max_groups=n, wait_ms=5000))
        groups.extend(r.groups)
    return groups


@pytest.mark.parametrize("metadata", [METADATA, "just a string", 7])
async def test_dataset_metadata_arrives_exactly(serve, tmp_path, metadata):
    dataset = tmp_path / "d.jsonl"
    dataset.write_text(json.dumps({"id": "q0", "prompt": "2+2?", "metadata": metadata}) + "\n")
    _, stub = await serve(**{"dataset.path": str(dataset), "dataset.epochs": 1})
    [group] = await _fetch_all(stub, 1)
    assert json.loads(group.metadata_json) == metadata
    assert type(json.loads(group.metadata_json)) is type(metadata)


async def test_submitted_metadata_arrives_exactly(serve):
    _, stub = await serve(**{"dataset.epochs": 1, "dataset.path": None})
    raw = json.dumps(METADATA)
    prompt = pb.Prompt(prompt_id="s1", text="say 1", metadata_json=raw)
    assert (await stub.SubmitPrompts(pb.SubmitPromptsRequest(prompts=[prompt]))).accepted == 1
    for _ in range(50):
        groups = await _fetch_all(stub, 1)
        found = [g for g in groups if g.prompt_id == "s1"]
        if found:
            break
    assert json.loads(found[0].metadata_json) == METADATA


async def test_bad_metadata_json_is_invalid(serve):
    _, stub = await serve()
    for prompt in (
        pb.Prompt(prompt_id="x", text="t", metadata_json="{not json"),
        pb.Prompt(prompt_id="y", text="t", metadata_json="{}", metadata=struct_pb2.Struct()),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.SubmitPrompts(pb.SubmitPromptsRequest(prompts=[prompt]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "metadata" in info.value.details()


async def test_a_repeated_ack_with_another_step_is_a_conflict(serve):
    _, stub = await serve()
    lease = await stub.FetchGroups(pb.FetchGroupsRequest(max_groups=1, wait_ms=5000))
    await stub.AckGroups(pb.AckGroupsRequest(lease_id=lease.lease_id, trainer_step=3))
    again = await stub.AckGroups(pb.AckGroupsRequest(lease_id=lease.lease_id, trainer_step=3))
    assert again.already_acked
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.AckGroups(pb.AckGroupsRequest(lease_id=lease.lease_id, trainer_step=4))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "trainer_step 3" in info.value.details() and "4" in info.value.details()


async def test_a_resubmission_with_other_content_is_a_conflict(serve):
    _, stub = await serve()
    first = pb.Prompt(prompt_id="p", text="what is 1+1?", metadata_json='{"answer": 2}')
    await stub.SubmitPrompts(pb.SubmitPromptsRequest(prompts=[first]))
    same = await stub.SubmitPrompts(pb.SubmitPromptsRequest(prompts=[first]))
    assert same.duplicates == 1
    for changed in (
        pb.Prompt(prompt_id="p", text="what is 1+2?", metadata_json='{"answer": 2}'),
        pb.Prompt(prompt_id="p", text="what is 1+1?", metadata_json='{"answer": 3}'),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.SubmitPrompts(pb.SubmitPromptsRequest(prompts=[changed]))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "'p'" in info.value.details()


@pytest.mark.parametrize(
    ("prompt", "field"),
    [
        (
            pb.Prompt(
                prompt_id="a", text="hi", messages=[pb.ChatMessage(role="user", content="hi")]
            ),
            "prompts[0]",
        ),
        (
            pb.Prompt(prompt_id="b", messages=[pb.ChatMessage(role="wizard", content="hi")]),
            "prompts[0].messages[0].role",
        ),
    ],
)
async def test_invalid_prompts_are_refused(serve, prompt, field):
    _, stub = await serve()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.SubmitPrompts(pb.SubmitPromptsRequest(prompts=[prompt]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()


async def test_update_weights_needs_a_path_that_exists(serve, tmp_path):
    _, stub = await serve()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.UpdateWeights(
            pb.UpdateWeightsRequest(version=1, weights_path=str(tmp_path / "missing"))
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "weights_path" in info.value.details()
    ok = await stub.UpdateWeights(pb.UpdateWeightsRequest(version=1, weights_path=str(tmp_path)))
    assert ok.policy_version == 1


async def test_the_synthetic_text_covers_every_token(serve):
    _, stub = await serve(**{"engine.max_tokens": 40})
    [group] = await _fetch_all(stub, 1)
    for sample in group.samples:
        assert len(sample.text.split()) == len(sample.token_ids) > 8


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
async def test_reflection_answers_on_v1_and_v1alpha(serve, version):
    from grpc_reflection.v1alpha import reflection_pb2 as rpb  # v1 has the same messages

    service, _ = await serve()
    async with grpc.aio.insecure_channel(service.addresses.grpc) as channel:
        call = channel.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=rpb.ServerReflectionRequest.SerializeToString,
            response_deserializer=rpb.ServerReflectionResponse.FromString,
        )
        responses = [
            r
            async for r in call(
                iter(
                    [
                        rpb.ServerReflectionRequest(list_services=""),
                        rpb.ServerReflectionRequest(
                            file_containing_symbol="rolloutd.v1.RolloutService"
                        ),
                    ]
                )
            )
        ]
    listed = {s.name for s in responses[0].list_services_response.service}
    assert {"rolloutd.v1.RolloutService", f"grpc.reflection.{version}.ServerReflection"} <= listed
    assert responses[1].file_descriptor_response.file_descriptor_proto


async def test_a_rewind_may_exceed_capacity_and_admission_waits(serve):
    """Documented: a Rewind returns acked groups to the buffer even past limits.buffer_capacity
    (they were the trainer's already); status shows it, and nothing new is admitted meanwhile."""
    _, stub = await serve(**{"limits.max_in_flight": 4, "limits.buffer_capacity": 4})
    taken = 0
    while taken < 4:
        ask = pb.FetchGroupsRequest(max_groups=4 - taken, wait_ms=5000)  # exactly 4 in all
        lease = await stub.FetchGroups(ask)
        taken += len(lease.groups)
        if lease.lease_id:  # none ready within the wait: ask again
            await stub.AckGroups(pb.AckGroupsRequest(lease_id=lease.lease_id, trainer_step=1))

    async def status_when(ready) -> pb.GetStatusResponse | None:
        status = await stub.GetStatus(pb.GetStatusRequest())
        return status if ready(status) else None

    full = await eventually(
        "4 new groups committed after the acks",
        lambda: status_when(lambda s: s.buffer.committed == 4 and s.buffer.generating == 0),
    )
    rewound = await stub.Rewind(pb.RewindRequest(trainer_step=0))
    assert rewound.redelivered_groups == 4
    # Admission is woken by every change and the Rewind was one: it has looked at the buffer by
    # the time the reply is here, and it admits nothing while the total is past the capacity.
    after = await eventually(
        "the rewound groups back in the buffer",
        lambda: status_when(lambda s: s.buffer.committed == 8),
    )
    assert (after.buffer.committed, after.buffer.generating, after.buffer.capacity) == (8, 0, 4)
    assert after.counters.admitted_groups == full.counters.admitted_groups


async def test_reflection_describes_the_api_with_the_proto_comments(serve):
    """`grpcurl describe` shows the comments of the .proto (source info in the descriptors)."""
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2 as rpb

    service, _ = await serve()
    async with grpc.aio.insecure_channel(service.addresses.grpc) as channel:
        call = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=rpb.ServerReflectionRequest.SerializeToString,
            response_deserializer=rpb.ServerReflectionResponse.FromString,
        )
        request = rpb.ServerReflectionRequest(file_containing_symbol="rolloutd.v1.Prompt")
        [response] = [r async for r in call(iter([request]))]
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in response.file_descriptor_response.file_descriptor_proto
    ]
    (ours,) = [f for f in files if f.name == "rolloutd/v1/rollout.proto"]
    comments = " ".join(loc.leading_comments for loc in ours.source_code_info.location)
    assert "delivered back exactly" in comments  # Prompt.metadata_json's comment
