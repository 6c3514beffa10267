"""Group segments: typed columns that give back every field, and stores of format 2 (a JSON
document per group) that still restore, written by the format-2 code itself (data/format2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from rolloutd.checkpoint import groups, sidecar
from rolloutd.checkpoint.checkpointer import Checkpointer, CheckpointerConfig
from rolloutd.checkpoint.format import FORMAT_VERSION
from rolloutd.checkpoint.restore import Granularity, restore
from rolloutd.checkpoint.rows import (
    GROUP_SCHEMA,
    GROUP_SCHEMA_V3,
    GROUP_SCHEMA_V4,
    GROUP_SCHEMA_V5,
    SegmentKind,
)
from rolloutd.checkpoint.store import SnapshotStore
from rolloutd.domain.group import (
    BUFFERED,
    UNFINISHED,
    GroupMeta,
    GroupState,
    GroupTable,
    Position,
    Prompt,
    RestoredGroup,
)
from rolloutd.domain.report import RecoveryState, Trigger
from rolloutd.domain.spec import GenerationSpec, SamplingParams
from tests.checkpoint.data import make_format2 as format2
from tests.checkpoint.helpers import Location, StoreNode
from tests.controllers import fetch
from tests.fakes import settle

FORMAT2 = Path(__file__).parent / "data" / "format2"


def metas() -> list[GroupMeta]:
    """A group in every state it can be buffered in, with every optional field set and unset."""
    prompts = [
        Prompt("plain", "question"),
        Prompt("meta", "q \u00e9", metadata={"answer": [1, 2.5, None], "s": 'quote " \\'}),
        Prompt("scalar", "q", metadata=0),
        Prompt("chat", "", messages=({"role": "user", "content": "hi"}, {"role": "x", "c": ""})),
        Prompt("spec", "q", generation=GenerationSpec(temperature=0.5, stop=("\n", "##"), seed=3)),
    ]
    params = [None, SamplingParams(max_tokens=7, temperature=0.0, top_k=5, stop=("\n",))]
    out = []
    for i, state in enumerate(BUFFERED):
        for j, prompt in enumerate(prompts):
            gid = 10 * i + j
            out.append(
                GroupMeta(
                    group_id=gid,
                    prompt=prompt,
                    position=None if j == 3 else Position(i, gid, source=j % 3),
                    group_size=j + 1,
                    policy_version=i,
                    admitted_at=1_700_000_000.25 + gid,
                    seed=2**40 + gid,
                    state=state,
                    committed_at=None if state is GroupState.GENERATING else 1.5 * gid,
                    lease_id=f"lease-{gid}"
                    if state in (GroupState.LEASED, GroupState.ACKED)
                    else None,
                    ack_step=gid if state is GroupState.ACKED else None,
                    params=params[gid % 2],
                )
            )
    return out


def test_every_field_comes_back_from_the_typed_columns():
    given = metas()
    batches = list(groups.metas_to_batches(given, batch_rows=5))
    assert len(batches) == 5 and all(b.schema == GROUP_SCHEMA for b in batches)
    decoded = [m for batch in batches for m in groups.batch_to_metas(batch)]
    assert decoded == given
    assert [sidecar.to_json(m) for m in decoded] == [sidecar.to_json(m) for m in given]
    keep = np.array([i % 2 == 0 for i in range(5)])
    assert groups.batch_to_metas(batches[0], keep) == given[0:5:2]


async def _restored(root: Path):
    """A fresh controller restored from the store at ``root``, as the format-2 writer made it."""
    store = SnapshotStore(str(root))
    ctl = format2.controller(store)
    checkpointer = Checkpointer(
        ctl, store, store.journal, CheckpointerConfig(), format2.FINGERPRINT
    )
    report = await restore(
        ctl, store, checkpointer, "latest", format2.FINGERPRINT, Granularity.SIBLING
    )
    return store, ctl, checkpointer, report


def _as_written(ctl) -> dict:
    return {
        str(g.group_id): {
            "meta": sidecar.to_json(g.meta),
            "rows": {str(i): list(s.token_ids) for i, s in sorted(g.samples.items())},
        }
        for g in ctl.rooms.buffer.groups.values()
    }


async def test_a_store_written_in_format_2_restores_and_moves_to_typed_columns(tmp_path):
    expected = json.loads((FORMAT2 / "expected.json").read_text())
    shutil.copytree(FORMAT2 / "store", tmp_path / "store")
    old = SnapshotStore(str(tmp_path / "store")).load(2)
    assert old.format_version == 2 and len(old.groups) == 2 < FORMAT_VERSION

    store, ctl, checkpointer, report = await _restored(tmp_path / "store")
    assert report.sequence == 2 and not report.skipped
    assert report.groups[RecoveryState.ACKED] == 1 and report.groups[RecoveryState.UNFINISHED] == 2
    assert _as_written(ctl) == expected["groups"]
    assert [ctl.rooms.sampler.cursor.epoch, ctl.rooms.sampler.cursor.offset] == expected["cursor"]

    # a snapshot taken now lists the format-2 group segments beside a typed one
    lease, _ = await fetch(ctl, 1, 0, "t")
    await ctl.ack(lease.lease_id, 6)
    now = _as_written(ctl)
    third = store.load((await checkpointer.checkpoint(Trigger.ON_DEMAND)).sequence)
    await ctl.stop()
    assert third.format_version == FORMAT_VERSION
    layouts = [
        groups.is_legacy(store.open_segment(s, SegmentKind.GROUPS).schema) for s in third.groups
    ]
    assert layouts == [True, True, False]
    _, again, _, _ = await _restored(tmp_path / "store")
    assert _as_written(again) == now
    await again.stop()

    # compaction rewrites them as typed columns, and nothing changes
    compacted = store.compact(third, kind=SegmentKind.GROUPS)
    [merged] = compacted.groups
    schema = pa.ipc.open_file(tmp_path / "store" / merged.file.path).schema
    assert schema.remove_metadata() == GROUP_SCHEMA.remove_metadata()
    snapshot = store.open(compacted)
    assert {m.group_id: sidecar.to_json(m) for m in snapshot.group_metas()} == {
        int(gid): g["meta"] for gid, g in now.items()
    }


def test_a_table_over_the_typed_columns_answers_from_them_and_decodes_each_group_alike():
    given = metas()
    keep = np.array([i % 3 != 1 for i in range(len(given))])
    batches = [
        (b, keep[i * 5 : i * 5 + 5])
        for i, b in enumerate(groups.metas_to_batches(given, batch_rows=5))
    ]
    live = [m for m, k in zip(given, keep, strict=True) if k]
    for table in (groups.table_of(batches), GroupTable.of(live)):
        assert dict(table) == {m.group_id: m for m in live}
        assert table.counts() == {s: sum(m.state is s for m in live) for s in GroupState}
        committed = [m for m in live if m.state is GroupState.COMMITTED]
        by_commit = sorted(committed, key=lambda m: (m.committed_at or 0.0, m.group_id))
        assert table.committed_order() == [m.group_id for m in by_commit]
        assert table.unfinished() == [m.group_id for m in live if m.state in UNFINISHED]
        for source in range(3):  # each source's positions apart from the others'
            assert table.positions_from(1, 12, source) == [
                m.position
                for m in live
                if m.position is not None
                and m.position.source == source
                and m.position >= Position(1, 12, source)
            ]
        assert table.policy_versions == [m.policy_version for m in live]
        assert table.holds([live[0].group_id]) and not table.holds([live[0].group_id, 999])


async def test_a_restore_decodes_only_the_groups_it_delivers(tmp_path):
    """Restored groups keep their metadata and rows in the snapshot's columns: restoring,
    requeueing and evicting stale groups read the table's columns; a delivered group is
    decoded then, and only it."""
    node = StoreNode(
        Location(str(tmp_path / "store")),
        [Prompt(f"p{i}", f"question {i}") for i in range(12)],
        max_in_flight=12,
        buffer_capacity=12,
        keep_latest=2,
    )
    node.controller.start()
    await settle(lambda: node.controller.status().buffer.committed == 12)
    await node.checkpoint()
    await node.controller.stop()

    again = StoreNode(node.location, [], max_in_flight=12, buffer_capacity=12, keep_latest=2)
    report = await again.restore()
    assert report.groups[RecoveryState.COMMITTED] == 12
    buffered = list(again.controller.rooms.buffer.groups.values())
    assert all(isinstance(g, RestoredGroup) for g in buffered)
    decoded = lambda: {g.group_id for g in buffered if "meta" in g.__dict__}  # noqa: E731
    read = lambda: {g.group_id for g in buffered if "samples" in g.__dict__}  # noqa: E731
    assert decoded() == read() == set()
    assert await again.controller.rooms.policy.evict_stale() == 0
    assert decoded() == set()
    again.controller.start()

    _, delivered = await fetch(again.controller, 1, 0, "t")
    [group] = delivered
    assert decoded() == {group.group_id} and read() <= {group.group_id}
    assert group.meta.prompt.prompt_id in {f"p{i}" for i in range(12)}
    assert [s.index for s in group.ordered_samples()] == [0, 1]
    assert read() == {group.group_id}
    assert again.controller.status().buffer.committed == 11
    await again.controller.stop()


@pytest.mark.parametrize(
    ("schema", "dropped"), [(GROUP_SCHEMA_V5, 1), (GROUP_SCHEMA_V4, 4), (GROUP_SCHEMA_V3, 5)]
)
def test_group_segments_of_formats_3_to_5_read_with_the_defaults_of_what_they_lack(schema, dropped):
    given = [m for m in metas() if m.prompt.prompt_id != "spec"]
    [batch] = groups.metas_to_batches(given, batch_rows=len(given))
    old = pa.RecordBatch.from_arrays([batch.column(f.name) for f in schema], schema=schema)
    assert old.num_columns == batch.num_columns - dropped
    decoded = groups.batch_to_metas(old)
    defaults = {
        **({"params": None} if dropped >= 4 else {}),
        **({"scores": None} if dropped == 5 else {}),
    }
    assert decoded == [
        m.evolve(
            **defaults,
            position=m.position
            if m.position is None or dropped == 1
            else Position(m.position.epoch, m.position.offset),
        )
        for m in given
    ]
    assert dict(groups.table_of([(old, None)])) == {m.group_id: m for m in decoded}
