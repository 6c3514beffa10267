"""A prompt's ``tools``: submitted as ``tools_json`` (a JSON array of objects, bounded like
metadata), refused with the field named otherwise, and passed to the episode's environment and
its chat template (through the Python client, which takes ``tools`` as a list)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from rolloutd.client import RolloutClient
from rolloutd.v1 import rollout_pb2 as pb
from tests.waiting import eventually

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "évalue"}}]


def prompt(prompt_id: str, tools_json: str) -> pb.Prompt:
    return pb.Prompt(prompt_id=prompt_id, text="What is 17 * 23?", tools_json=tools_json)


async def test_tools_that_are_not_a_bounded_list_of_objects_are_refused_naming_the_field(serve):
    _, stub = await serve(**{"limits.max_metadata_bytes": 1_000})
    good = prompt("ok", json.dumps(TOOLS))
    for tools_json, problem in (
        ("{not json", "not JSON"),
        ('{"name": "calc"}', "must be a list of JSON objects"),
        ('[{"name": "calc"}, "calc"]', "item 1 must be a JSON object"),
        ('[{"a": ' + "[" * 40 + "]" * 40 + "}]", "nested deeper"),
        (json.dumps([{"description": "x" * 2_000}]), "limits.max_metadata_bytes=1000"),
    ):
        request = pb.SubmitPromptsRequest(prompts=[good, prompt("bad", tools_json)])
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.SubmitPrompts(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompts[1].tools_json" in info.value.details()
        assert problem in info.value.details()
    status = await stub.GetStatus(pb.GetStatusRequest())
    assert status.pending_prompts == 0  # a refused call accepts nothing


async def test_submitted_tools_reach_the_environment_and_the_chat_template(serve, tmp_path):
    log = tmp_path / "env.jsonl"
    service, stub = await serve(
        **{
            "episodes.environment": "tests.integration.episode_envs:ReplayedEnv",
            "episodes.environment_config": {"log": str(log), "turns": 1},
            "dataset.path": None,
            "group_size": 1,
        }
    )
    submitted = {"prompt_id": "t1", "text": "What is 17 * 23?", "tools": TOOLS}
    with RolloutClient(service.addresses.grpc, interceptors=[], retries=0) as client:
        r = await asyncio.to_thread(client.submit_prompts, [submitted])
    assert r.accepted == 1

    async def submitted_group():  # type: ignore[no-untyped-def]
        fetched = await stub.FetchGroups(
            pb.FetchGroupsRequest(max_groups=4, wait_ms=2_000, consumer="t")
        )
        if fetched.lease_id:
            await stub.AckGroups(pb.AckGroupsRequest(lease_id=fetched.lease_id, trainer_step=1))
        return next((g for g in fetched.groups if g.prompt_id == "t1"), None)

    group = await eventually("the submitted prompt's group", submitted_group)
    # the synthetic engine's tokens are code points: the prompt as the template rendered it
    rendered = "".join(map(chr, group.samples[0].prompt_token_ids))
    assert rendered.startswith(
        "<|bos|><|system|>\n# Tools\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n<|end|>\n"
    )
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    [reset] = [c for c in calls if c["call"] == "reset" and c["episode"] == f"g{group.group_id}-s0"]
    assert reset["tools"] == TOOLS
