"""Partial siblings: captured by checkpoints, written to their own file, continued after a restore
(recovery.granularity: token). A real store on disk, a gated fake engine that streams."""

from __future__ import annotations

from pathlib import Path

import pytest

from rolloutd.checkpoint.backends import PARTIALS
from rolloutd.checkpoint.restore import Granularity
from rolloutd.domain.group import SamplePart
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.report import TokenDisposition
from tests.checkpoint.test_checkpointer import Node
from tests.controllers import fetch
from tests.fakes import GatedEngine, settle

TOKENS = 8
EARLY = 3


def streaming(**kw) -> GatedEngine:
    return GatedEngine(tokens=TOKENS, early=EARLY, **kw)


@pytest.fixture
async def nodes(tmp_path):
    made: list[Node] = []

    def make(**kw):
        node = Node(tmp_path / "store", **kw)
        made.append(node)
        return node

    yield make
    for node in made:
        await node.controller.stop()


async def generating(node: Node, siblings: int = 6) -> None:
    node.controller.start()
    await settle(lambda: len(node.engine.requests) == siblings)


def flip_a_byte(path: Path) -> None:
    """Corrupts the file but keeps its size, so only its checksum can tell."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def uninterrupted(seed: int) -> list[int]:
    return [seed % 1000 + i for i in range(TOKENS)]


async def test_a_checkpoint_writes_the_tokens_of_generating_siblings(nodes):
    a = nodes(engine=streaming())
    await generating(a)
    report = await a.checkpoint()
    manifest = a.store.load(report.sequence)
    assert manifest.partials is not None and manifest.partials.path.startswith(f"{PARTIALS}/")
    partials = a.store.read_partials(manifest)
    assert len(partials) == 6
    for p in partials:
        seed = a.controller.rooms.buffer.groups[p.group_id].meta.sibling_seed(p.index)
        assert p.token_ids().tolist() == uninterrupted(seed)[:EARLY]
        assert p.logprobs().tolist() == pytest.approx([-0.5 - i / 100 for i in range(EARLY)])
        assert p.parts() == (SamplePart(0, 0),)


async def test_the_cut_holds_what_the_hold_saw_not_what_came_after(nodes):
    a = nodes(engine=streaming())
    await generating(a)
    async with a.controller.barrier.exclusive():
        state = a.controller.capture()
    a.engine.release(1)  # its last delta is appended after the cut, then it is staged
    await settle(
        lambda: sum(len(g.samples) for g in a.controller.rooms.buffer.groups.values()) == 1
    )
    assert sorted(len(p) for p in state.partials) == [EARLY] * 6


async def test_a_staged_sibling_leaves_the_partials_in_the_same_mutation(nodes):
    a = nodes(engine=streaming())
    await generating(a)
    a.engine.release(1)
    await settle(
        lambda: sum(len(g.samples) for g in a.controller.rooms.buffer.groups.values()) == 1
    )
    report = await a.checkpoint()
    manifest = a.store.load(report.sequence)
    assert manifest.new_rows == 1
    staged = {(g.group_id, i) for g in a.controller.rooms.buffer.groups.values() for i in g.samples}
    partial = {(p.group_id, p.index) for p in a.store.read_partials(manifest)}
    assert len(partial) == 5 and not staged & partial


async def test_restore_continues_each_sibling_from_its_tokens(nodes):
    a = nodes(engine=streaming())
    await generating(a)
    await a.checkpoint()
    await a.controller.stop()

    b = nodes(engine=GatedEngine(tokens=TOKENS, auto=True))
    report = await b.restore(granularity=Granularity.TOKEN)
    assert report.tokens == {TokenDisposition.REUSED: 6 * EARLY, TokenDisposition.REGENERATED: 0}
    assert all(r.prefix is not None and len(r.prefix) == EARLY for r in b.engine.requests)
    await settle(lambda: b.controller.status().buffer.committed == 3)
    for g in b.controller.rooms.buffer.groups.values():
        for s in g.samples.values():
            assert s.token_ids.tolist() == uninterrupted(s.seed)
            assert s.logprobs.tolist() == pytest.approx([-0.5 - i / 100 for i in range(TOKENS)])
            assert s.resumed_at == EARLY and s.parts == (SamplePart(0, 0),)


async def test_sibling_granularity_discards_the_tokens_and_counts_them(nodes):
    a = nodes(engine=streaming())
    await generating(a)
    await a.checkpoint()
    await a.controller.stop()

    b = nodes(engine=GatedEngine(tokens=TOKENS, auto=True))
    report = await b.restore(granularity=Granularity.SIBLING)
    assert report.tokens == {TokenDisposition.REUSED: 0, TokenDisposition.REGENERATED: 6 * EARLY}
    assert all(r.prefix is None for r in b.engine.requests)
    await settle(lambda: b.controller.status().buffer.committed == 3)
    assert all(
        s.resumed_at is None
        for g in b.controller.rooms.buffer.groups.values()
        for s in g.samples.values()
    )


async def test_a_resume_across_a_weight_update_records_both_versions(nodes, tmp_path):
    a = nodes(engine=streaming())
    await generating(a)
    await a.checkpoint()
    await a.controller.stop()

    engine = GatedEngine(tokens=TOKENS, auto=True)
    await engine.update_weights(str(tmp_path), 1)
    b = nodes(engine=engine)
    await b.restore(granularity=Granularity.TOKEN)
    await settle(lambda: b.controller.status().buffer.committed == 3)
    for g in b.controller.rooms.buffer.groups.values():
        for s in g.samples.values():
            assert s.parts == (SamplePart(0, 0), SamplePart(EARLY, 1))
            assert s.policy_version == 0  # the oldest part: staleness stays conservative


async def test_a_resumed_sibling_is_captured_again_with_its_prefix(nodes):
    a = nodes(engine=streaming())
    await generating(a)
    await a.checkpoint()
    await a.controller.stop()

    b = nodes(engine=GatedEngine(tokens=TOKENS))  # continues, then waits
    await b.restore(granularity=Granularity.TOKEN)
    report = await b.checkpoint()  # before any continuation token came
    partials = b.store.read_partials(b.store.load(report.sequence))
    assert sorted(len(p) for p in partials) == [EARLY] * 6


async def test_partials_that_do_not_verify_cost_only_their_tokens(nodes):
    a = nodes(engine=streaming())
    await generating(a)
    report = await a.checkpoint()
    await a.controller.stop()
    entry = a.store.load(report.sequence).partials
    assert entry is not None
    flip_a_byte(Path(a.store.backend._path(entry.path)))

    b = nodes(engine=GatedEngine(tokens=TOKENS, auto=True))
    restored = await b.restore(granularity=Granularity.TOKEN)
    assert restored.sequence == report.sequence
    assert restored.tokens[TokenDisposition.REUSED] == 0
    assert all(r.prefix is None for r in b.engine.requests)
    await settle(lambda: b.controller.status().buffer.committed == 3)


def cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage", [Path.unlink, cut_in_half], ids=["missing", "truncated"])
async def test_a_missing_or_truncated_partials_file_costs_only_its_tokens(nodes, damage):
    a = nodes(engine=streaming())
    await generating(a)
    report = await a.checkpoint()
    await a.controller.stop()
    entry = a.store.load(report.sequence).partials
    assert entry is not None
    damage(Path(a.store.backend._path(entry.path)))

    b = nodes(engine=GatedEngine(tokens=TOKENS, auto=True))
    restored = await b.restore(granularity=Granularity.TOKEN)
    assert restored.sequence == report.sequence and not restored.skipped
    assert restored.tokens[TokenDisposition.REUSED] == 0
    assert all(r.prefix is None for r in b.engine.requests)
    await settle(lambda: b.controller.status().buffer.committed == 3)


async def test_retention_deletes_the_partials_of_retired_snapshots(nodes):
    a = nodes(engine=streaming())
    await generating(a)
    for _ in range(4):
        async with a.controller.barrier.mutation(MutationKind.ADMIT):
            pass
        await a.checkpoint()
    kept = {m.partials.path for m in a.store.list() if m.partials is not None}
    on_disk = {f"{PARTIALS}/{n}" for n in a.store.backend.listdir(PARTIALS)}
    assert len(kept) == 2 and on_disk == kept


async def test_a_second_restart_still_delivers_where_samples_were_resumed(nodes):
    a = nodes(engine=streaming())
    await generating(a)
    await a.checkpoint()
    await a.controller.stop()
    b = nodes(engine=GatedEngine(tokens=TOKENS, auto=True))
    await b.restore(granularity=Granularity.TOKEN)
    await settle(lambda: b.controller.status().buffer.committed == 3)
    report = await b.checkpoint()
    await b.controller.stop()
    resumed = b.store.read_resumed(b.store.load(report.sequence))
    assert len(resumed) == 6

    c = nodes(engine=GatedEngine(tokens=TOKENS, auto=True))
    await c.restore(granularity=Granularity.TOKEN)
    samples = [s for g in c.controller.rooms.buffer.groups.values() for s in g.samples.values()]
    assert sum(s.resumed_at == EARLY for s in samples) == 6
    assert all(s.parts == (SamplePart(0, 0),) for s in samples if s.resumed_at is not None)
    lease, _groups = await fetch(c.controller, 16, 0, "t")
    await c.controller.ack(lease.lease_id, 1)
    await c.controller.finalize(1)  # the resumed rows are gone: so are their records
    report = await c.checkpoint()
    assert c.store.read_resumed(c.store.load(report.sequence)) == {}
