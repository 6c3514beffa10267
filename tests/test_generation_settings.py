"""Per-prompt generation settings and weighted sources through the service (synthetic engine, real
gRPC, real snapshots): a row's settings shape its group, a delivered group says what it was
generated with, two sources keep their mix across a restore, and every setting the service
cannot honour is refused with its name while nothing already admitted is lost."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest

from rolloutd.checkpoint.reader import SnapshotNotFound
from rolloutd.config import ConfigError, load_config
from rolloutd.dataset import DatasetError, load_prompts
from rolloutd.domain.errors import RestoreRefused
from rolloutd.domain.spec import SpecLimits
from rolloutd.server import RolloutService
from rolloutd.v1 import rollout_pb2 as pb
from rolloutd.v1 import rollout_pb2_grpc as pb_grpc


def jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def service(tmp_path: Path, **overrides: Any) -> RolloutService:
    config = load_config(
        overrides={
            "engine.kind": "synthetic",
            "engine.synthetic.tokens_per_s": 0,
            "engine.max_tokens": 32,
            "grpc.host": "127.0.0.1",
            "grpc.port": 0,
            "grpc.grace_s": 0,
            "http.enabled": False,
            "checkpoint.dir": str(tmp_path / "checkpoints"),
            "checkpoint.interval_s": 0,
            "restore": "none",
            **overrides,
        },
        environ={},
    )
    return RolloutService(config)


async def fetch_all(stub: pb_grpc.RolloutServiceStub, n: int, step: int = 1) -> list[pb.Group]:
    """``n`` groups, fetched and acked at ``step``."""
    groups: list[pb.Group] = []
    while len(groups) < n:
        got = await stub.FetchGroups(
            pb.FetchGroupsRequest(max_groups=min(64, n - len(groups)), wait_ms=10_000), timeout=30
        )
        assert got.groups, f"nothing to fetch after {len(groups)} of {n} groups"
        groups += got.groups
        await stub.AckGroups(pb.AckGroupsRequest(lease_id=got.lease_id, trainer_step=step))
    return groups


ROWS = [
    {"id": f"short{i}", "prompt": f"short {i}", "generation": {"max_tokens": 4, "group_size": 2}}
    for i in range(4)
] + [
    {
        "id": f"long{i}",
        "prompt": f"long {i}",
        "generation": {"max_tokens": 16, "group_size": 8, "temperature": 0.5, "seed": 40 + i},
    }
    for i in range(4)
]


async def test_each_rows_settings_shape_its_group_and_come_back_with_it(tmp_path):
    data = jsonl(tmp_path / "rows.jsonl", ROWS)
    s = service(tmp_path, **{"dataset.path": str(data), "dataset.epochs": 1})
    addresses = await s.start()
    try:
        async with grpc.aio.insecure_channel(addresses.grpc) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            groups = await fetch_all(stub, len(ROWS))
    finally:
        await s.shutdown()
    by_id = {g.prompt_id: g for g in groups}
    assert sorted(by_id) == sorted(r["id"] for r in ROWS)
    for g in groups:
        short = g.prompt_id.startswith("short")
        assert len(g.samples) == (2 if short else 8)
        assert max(len(s.token_ids) for s in g.samples) <= (4 if short else 16)
        assert g.source_name == "dataset"
        spec = g.generation
        assert (spec.max_tokens, spec.group_size) == ((4, 2) if short else (16, 8))
        assert spec.temperature == (1.0 if short else 0.5)  # the service's, or the row's
        if not short:
            assert spec.seed == 40 + int(g.prompt_id[4:])
            # siblings' seeds derive from the row's seed: the same row, the same samples
            assert [s.seed for s in g.samples] == [
                (spec.seed * 1_000_003 + i) % (2**31 - 1) for i in range(8)
            ]
    assert max(len(s.token_ids) for s in by_id["long0"].samples) > 4


def two_sources(tmp_path: Path, weights: tuple[float, float], math_rows: int = 50) -> list[dict]:
    math = jsonl(tmp_path / "math.jsonl", [{"prompt": f"math {i}"} for i in range(math_rows)])
    chat = jsonl(tmp_path / "chat.jsonl", [{"prompt": f"chat {i}"} for i in range(30)])
    return [
        {"name": "math", "path": str(math), "weight": weights[0], "generation": {"max_tokens": 4}},
        {"name": "chat", "path": str(chat), "weight": weights[1]},
    ]


async def test_two_sources_at_3_to_1_keep_their_mix_across_a_restore(tmp_path):
    settings = {"group_size": 1, "limits.max_in_flight": 8, "limits.buffer_capacity": 16}
    first = service(tmp_path, **settings, **{"dataset.sources": two_sources(tmp_path, (3, 1))})
    addresses = await first.start()
    try:
        async with grpc.aio.insecure_channel(addresses.grpc) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            before = await fetch_all(stub, 200)
            await stub.Checkpoint(pb.CheckpointRequest(trainer_step=1), timeout=30)
    finally:
        await first.shutdown()

    second = service(
        tmp_path, **settings, restore="latest", **{"dataset.sources": two_sources(tmp_path, (3, 1))}
    )
    addresses = await second.start()
    try:
        async with grpc.aio.insecure_channel(addresses.grpc) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            after = await fetch_all(stub, 200, step=2)
            status = await stub.GetStatus(pb.GetStatusRequest(), timeout=10)
    finally:
        await second.shutdown()

    for part in (before, after, before + after):
        share = Counter(g.source_name for g in part)
        assert abs(share["math"] / len(part) - 0.75) <= 0.05, share
    # each group once: the restored service continued each source's cursor
    seen = Counter((g.source_name, g.epoch, g.prompt_id) for g in before + after)
    assert max(seen.values()) == 1
    for g in before + after:
        assert g.generation.max_tokens == (4 if g.source_name == "math" else 32)
    sources = {s.name: s for s in status.sources}
    assert [s.name for s in status.sources] == ["math", "chat"]
    assert sources["math"].weight == 3 and sources["math"].prompts == 50
    math = [g for g in before + after if g.source_name == "math"]
    assert sources["math"].delivered_groups >= len(math)  # the first life's acks were kept
    assert (sources["math"].epoch, sources["math"].offset) >= divmod(len(math), 50)


async def test_a_new_weight_restores_but_new_content_is_refused_naming_the_source(tmp_path):
    first = service(tmp_path, **{"dataset.sources": two_sources(tmp_path, (3, 1))})
    await first.start()
    await first.shutdown()  # its final snapshot holds both sources' cursors

    reweighted = service(
        tmp_path, restore="latest", **{"dataset.sources": two_sources(tmp_path, (1, 1))}
    )
    await reweighted.start()
    await reweighted.shutdown()

    changed = service(
        tmp_path, restore="latest", **{"dataset.sources": two_sources(tmp_path, (1, 1), 51)}
    )
    with pytest.raises((RestoreRefused, SnapshotNotFound)) as refused:
        await changed.start()
    assert "dataset.sources[math]" in str(refused.value)
    assert "dataset.sources[chat]" not in str(refused.value)


async def test_a_submitted_setting_the_engine_cannot_honour_is_refused_and_nothing_is_lost(
    tmp_path,
):
    s = service(tmp_path, **{"dataset.epochs": 1, "limits.max_group_size": 8})
    addresses = await s.start()
    try:
        async with grpc.aio.insecure_channel(addresses.grpc) as channel:
            stub = pb_grpc.RolloutServiceStub(channel)
            good = pb.Prompt(
                prompt_id="mine",
                text="say hi",
                generation=pb.GenerationSpec(temperature=0.25, group_size=3, stop=["!"]),
            )
            accepted = await stub.SubmitPrompts(pb.SubmitPromptsRequest(prompts=[good]))
            assert accepted.accepted == 1
            for spec, field, message in [
                (pb.GenerationSpec(temperature=-1), "temperature", "must be at least 0"),
                (pb.GenerationSpec(top_p=1.5), "top_p", "must be in (0, 1]"),
                (pb.GenerationSpec(group_size=9), "group_size", "limits.max_group_size=8"),
                (pb.GenerationSpec(max_tokens=0), "max_tokens", "must be at least 1"),
            ]:
                bad = pb.Prompt(prompt_id="bad", text="x", generation=spec)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.SubmitPrompts(pb.SubmitPromptsRequest(prompts=[good, bad]))
                assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                detail = refused.value.details()
                assert f"prompts[1].generation.{field}" in detail and message in detail, detail
                assert "'bad'" in detail
            other = pb.Prompt(
                prompt_id="mine", text="say hi", generation=pb.GenerationSpec(temperature=0.5)
            )
            with pytest.raises(grpc.aio.AioRpcError) as again:
                await stub.SubmitPrompts(pb.SubmitPromptsRequest(prompts=[other]))
            assert again.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "another generation" in again.value.details()
            status = await stub.GetStatus(pb.GetStatusRequest(), timeout=10)
            groups = await fetch_all(stub, status.counters.admitted_groups or 1)
            while not any(g.prompt_id == "mine" for g in groups):
                groups += await fetch_all(stub, 1)
    finally:
        await s.shutdown()
    mine = next(g for g in groups if g.prompt_id == "mine")
    assert mine.source_name == "submitted" and len(mine.samples) == 3
    assert (mine.generation.temperature, list(mine.generation.stop)) == (0.25, ["!"])


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"generation": {"temperature": -1}}, "line 2: generation.temperature must be at least 0"),
        ({"generation": {"top_p": 2}}, r"line 2: generation.top_p must be in \(0, 1\]"),
        ({"generation": {"max_tokens": 600}}, "line 2: generation.max_tokens 600 leaves no room"),
        ({"generation": {"group_size": 2000}}, "line 2: generation.group_size must be in"),
        ({"generation": {"max_new_tokens": 8}}, "line 2: generation.max_new_tokens is not a"),
        ({"generation": [1]}, "line 2: generation.generation must be an object"),
    ],
)
def test_a_rows_setting_outside_what_the_engine_accepts_names_file_row_and_field(
    tmp_path, row, message
):
    data = jsonl(tmp_path / "rows.jsonl", [{"prompt": "fine"}, {"prompt": "not fine", **row}])
    with pytest.raises(DatasetError, match=message) as refused:
        load_prompts(str(data), SpecLimits(max_group_size=1024, max_model_len=512))
    assert str(data) in str(refused.value)


def test_sources_are_checked_at_load_naming_the_key(tmp_path):
    sources = two_sources(tmp_path, (3, 1))
    with pytest.raises(ConfigError, match=r"dataset\.path and dataset\.sources exclude each other"):
        load_config(overrides={"dataset.sources": sources, "dataset.path": "x"}, environ={})
    with pytest.raises(ConfigError, match="names must be unique"):
        load_config(overrides={"dataset.sources": [sources[0], sources[0]]}, environ={})
    bad = [{**sources[0], "generation": {"top_p": 3}}]
    with pytest.raises(ConfigError, match=r"dataset.sources.0.generation.top_p"):
        load_config(overrides={"dataset.sources": bad}, environ={})
    big = [{**sources[0], "generation": {"group_size": 4096}}]
    with pytest.raises(ConfigError, match=r"dataset.sources\[0\].generation.group_size"):
        load_config(overrides={"dataset.sources": big}, environ={})
    with pytest.raises(ConfigError, match="at least one source needs a weight"):
        zero = [{**s, "weight": 0} for s in sources]
        load_config(overrides={"dataset.sources": zero}, environ={})


async def test_a_fleet_shares_each_source_apart(tmp_path):
    """Two replicas over two sources: each prompt of each source is delivered once an epoch,
    by one replica."""
    delivered: list[tuple[str, str]] = []
    for replica in range(2):
        s = service(
            tmp_path / f"r{replica}",
            group_size=1,
            **{
                "dataset.sources": two_sources(tmp_path, (3, 1)),
                "dataset.epochs": 1,
                "fleet.replicas": 2,
                "fleet.replica": replica,
            },
        )
        addresses = await s.start()
        try:
            async with grpc.aio.insecure_channel(addresses.grpc) as channel:
                stub = pb_grpc.RolloutServiceStub(channel)
                groups = await fetch_all(stub, 40)  # half of 50 + 30 prompts
                status = await stub.GetStatus(pb.GetStatusRequest(), timeout=10)
        finally:
            await s.shutdown()
        assert status.dataset_exhausted
        assert {src.name: src.prompts for src in status.sources} == {"math": 25, "chat": 15}
        delivered += [(g.source_name, g.prompt_text) for g in groups]
    assert sorted(delivered) == sorted(
        [("math", f"math {i}") for i in range(50)] + [("chat", f"chat {i}") for i in range(30)]
    )
