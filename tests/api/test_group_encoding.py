"""A delivered group's proto carries every field of the group and of each sample, in index order,
whatever shape the samples have (fresh or resumed) and whatever the prompt's metadata is."""

from __future__ import annotations

import json
from array import array

import pytest

from rolloutd.api.convert import group_to_proto
from rolloutd.domain.group import Group, GroupMeta, GroupState, Position, Prompt, Sample, SamplePart
from rolloutd.domain.spec import SamplingParams
from rolloutd.v1 import rollout_pb2 as pb


def sample(index: int, *, resumed: bool = False) -> Sample:
    return Sample(
        index=index,
        token_ids=array("i", [7 + index, 31_999, 3]),
        logprobs=array("f", [-0.5, -1.25, 0.0]),
        text=f"t{7 + index} t31999 t3",
        finish_reason="length" if resumed else "stop",
        policy_version=2,
        prompt_token_ids=array("i", [104, 105]),
        seed=1_000 + index,
        started_at=10.5,
        finished_at=11.25,
        resumed_at=1 if resumed else None,
        parts=(SamplePart(0, 2), SamplePart(1, 3)) if resumed else (),
    )


@pytest.mark.parametrize(
    ("position", "metadata"),
    [(Position(1, 42), {"answer": 4, "tags": ["a"]}), (None, None), (Position(0, 0), [1, "x"])],
)
def test_every_field_of_the_group_and_its_samples(position, metadata):
    meta = GroupMeta(
        group_id=9,
        prompt=Prompt("p9", "hi", metadata=metadata),
        position=position,
        group_size=3,
        policy_version=2,
        admitted_at=10.0,
        seed=5,
        state=GroupState.COMMITTED,
        committed_at=12.0,
    )
    group = Group(meta, {2: sample(2), 0: sample(0, resumed=True), 1: sample(1)})
    params = SamplingParams(max_tokens=16, temperature=0.5, top_p=0.9, top_k=5, stop=("\n",))
    proto = group_to_proto(group, "math", params)

    assert (proto.source_name, proto.generation.group_size, proto.generation.seed) == ("math", 3, 5)
    assert (proto.generation.max_tokens, proto.generation.temperature) == (16, 0.5)
    assert (proto.generation.top_k, list(proto.generation.stop)) == (5, ["\n"])
    assert proto.generation.top_p == pytest.approx(0.9)
    assert (proto.group_id, proto.prompt_id, proto.prompt_text) == (9, "p9", "hi")
    assert (proto.epoch, proto.offset) == (
        (position.epoch, position.offset) if position else (0, 0)
    )
    source = pb.PROMPT_SOURCE_DATASET if position else pb.PROMPT_SOURCE_SUBMITTED
    assert proto.source == source
    assert json.loads(proto.metadata_json) == metadata
    assert proto.HasField("metadata") == isinstance(metadata, dict)
    assert (proto.policy_version, proto.admitted_at, proto.committed_at) == (2, 10.0, 12.0)
    assert [s.index for s in proto.samples] == [0, 1, 2]
    for got in proto.samples:
        want = group.samples[got.index]
        assert list(got.token_ids) == list(want.token_ids)
        assert list(got.logprobs) == list(want.logprobs)
        assert list(got.prompt_token_ids) == list(want.prompt_token_ids)
        assert (got.text, got.finish_reason, got.policy_version, got.seed) == (
            want.text,
            want.finish_reason,
            want.policy_version,
            want.seed,
        )
        assert (got.started_at, got.finished_at) == (want.started_at, want.finished_at)
        assert got.HasField("resumed_at") == (want.resumed_at is not None)
        assert got.resumed_at == (want.resumed_at or 0)
        assert [(p.start, p.policy_version) for p in got.parts] == [
            (p.start, p.policy_version) for p in want.parts
        ]
