"""Checkpointer and restore against a real store on disk, with a gated fake engine."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import replace

import pytest

from rolloutd.checkpoint import restore as restore_module
from rolloutd.checkpoint.checkpointer import Checkpointer, CheckpointerConfig
from rolloutd.checkpoint.restore import Granularity, RestoreRefused, restore
from rolloutd.checkpoint.segments import ArrowSealer, Snapshot
from rolloutd.checkpoint.store import SnapshotStore
from rolloutd.domain.controller import Controller, ControllerConfig
from rolloutd.domain.group import GroupState, KeptSamples, Prompt
from rolloutd.domain.report import (
    CheckpointPhase,
    Disposition,
    Outcome,
    Reason,
    RecoveryState,
    RowKind,
    SizePart,
    Trigger,
)
from rolloutd.domain.sampler import Sampler
from tests.controllers import fetch, generating_groups
from tests.fakes import GatedEngine, settle

PROMPTS = [Prompt(f"p{i}", f"question {i}") for i in range(40)]
FINGERPRINT = {"model": "tiny", "group_size": 2}


class Node:
    """One controller + store + checkpointer, as a process would have them."""

    def __init__(
        self,
        root,
        *,
        engine=None,
        fingerprint=FINGERPRINT,
        sealer=None,
        runner=None,
        observer=None,
        **limits,
    ):
        cfg = {
            "group_size": 2,
            "max_in_flight": 3,
            "buffer_capacity": 6,
            "rewind_window": 100,
            "reap_interval_s": 0.02,
            **limits,
        }
        self.engine = engine or GatedEngine(auto=True)
        self.store = SnapshotStore(str(root))
        self.journal = self.store.journal
        self.controller = Controller(
            ControllerConfig(**cfg),
            self.engine,
            Sampler(PROMPTS, seed=1, epochs=1),
            journal=self.journal,
            sealer=sealer,
            runner=runner,
            observer=observer,
        )
        self.checkpointer = Checkpointer(
            self.controller,
            self.store,
            self.journal,
            CheckpointerConfig(keep_latest=2),
            fingerprint,
        )

    async def restore(
        self, spec="latest", granularity=Granularity.SIBLING, fingerprint=FINGERPRINT
    ):
        return await restore(
            self.controller, self.store, self.checkpointer, spec, fingerprint, granularity
        )

    async def checkpoint(self, **kw):
        return await self.checkpointer.checkpoint(Trigger.ON_DEMAND, **kw)


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


async def test_snapshots_are_incremental(nodes):
    a = nodes()
    a.controller.start()
    await settle(lambda: a.controller.status().buffer.committed == 6)
    first = await a.checkpoint()
    assert first.outcome is Outcome.COMPLETED and first.rows[RowKind.NEW] == 12
    assert [p.phase for p in first.phases] == list(CheckpointPhase)
    lease, _groups = await fetch(a.controller, 1, 100, "t")
    await a.controller.ack(lease.lease_id, 1)
    await a.controller.finalize(1)  # one group (2 rows) removed, a new one admitted
    await settle(lambda: a.controller.status().buffer.committed == 6)
    second = await a.checkpoint()
    assert second.rows[RowKind.NEW] == 2 and second.rows[RowKind.REMOVED] == 2
    assert second.rows[RowKind.LIVE] == 12
    assert (
        0
        < second.size_bytes[next(iter(second.size_bytes))]
        < first.size_bytes[next(iter(first.size_bytes))]
    )
    periodic = await a.checkpointer.checkpoint(Trigger.PERIODIC)
    assert (periodic.outcome, periodic.reason) == (Outcome.SKIPPED, Reason.NO_CHANGES)


async def test_the_hold_does_no_io(nodes):
    a = nodes()
    calls = []
    targets = [(a.store, n) for n in ("write_segment", "write_sidecar_json", "publish", "retire")]
    for owner, name in [*targets, (a.store.journal, "_append")]:
        real = getattr(owner, name)

        def spy(*args, _real=real, _name=name, **kw):
            calls.append((_name, a.controller.barrier.exclusive_held))
            return _real(*args, **kw)

        setattr(owner, name, spy)
    a.controller.start()
    await settle(lambda: a.controller.status().buffer.committed == 6)
    await a.checkpoint()
    assert {n for n, _ in calls} >= {"write_segment", "write_sidecar_json", "publish"}
    assert not any(held for _, held in calls)


async def test_restore_brings_back_every_state(nodes):
    engine = GatedEngine()
    a = nodes(engine=engine, max_in_flight=3, buffer_capacity=6)
    a.controller.start()
    await settle(lambda: len(engine.requests) == 6)
    engine.release(4)  # two groups complete
    await settle(lambda: a.controller.status().buffer.committed == 2)
    engine.release(1)  # a third group has one sibling staged
    await settle(lambda: sum(len(g.samples) for g in generating_groups(a.controller)) == 1)
    acked_lease, acked = await fetch(a.controller, 1, 100, "t")
    await a.controller.ack(acked_lease.lease_id, 7)
    _leased_lease, leased = await fetch(a.controller, 1, 100, "t")
    report = await a.checkpoint()
    assert report.outcome is Outcome.COMPLETED
    cursor = a.controller.rooms.sampler.cursor
    unfinished = generating_groups(a.controller)
    staged = sum(len(g.samples) for g in unfinished)
    assert staged == 1 and len(unfinished) == 3  # the partial group plus two admitted meanwhile
    await a.controller.stop()

    b = nodes(engine=GatedEngine())
    r = await b.restore()
    assert r.sequence == report.sequence
    assert r.groups[RecoveryState.ACKED] == 1 and r.groups[RecoveryState.LEASED] == 1
    assert r.groups[RecoveryState.UNFINISHED] == len(unfinished)
    assert r.siblings == {
        Disposition.REUSED: staged,
        Disposition.RERUN: 2 * len(unfinished) - staged,
    }
    await settle(
        lambda: len(b.engine.requests) == 2 * len(unfinished) - staged
    )  # only the missing ones
    assert b.controller.rooms.sampler.cursor == cursor
    g_acked = b.controller.rooms.buffer.groups[acked[0].group_id]
    assert g_acked.state is GroupState.ACKED and g_acked.meta.ack_step == 7
    # the lease has not expired: it lives on, and its ack succeeds after the restart
    assert b.controller.rooms.buffer.groups[leased[0].group_id].state is GroupState.LEASED
    assert not (await b.controller.ack(_leased_lease.lease_id, 5)).already_acked
    assert (
        await b.controller.ack(acked_lease.lease_id, 7)
    ).already_acked  # idempotent across restarts
    rewound = await b.controller.rewind(6)
    assert rewound.redelivered_groups == 1


async def test_restored_rows_stay_in_the_snapshot_buffers_until_delivered(nodes):
    a = nodes()
    a.controller.start()
    await settle(lambda: a.controller.status().buffer.committed == 6)
    before = {g.group_id: g.ordered_samples() for g in a.controller.rooms.buffer.groups.values()}
    await a.checkpoint()
    await a.controller.stop()

    b = nodes(engine=GatedEngine())
    await b.restore()
    groups = b.controller.rooms.buffer.groups
    assert all(isinstance(g.samples, KeptSamples) for g in groups.values())
    lease, delivered = await fetch(b.controller, 2, 100, "t")
    assert {g.group_id: g.ordered_samples() for g in delivered} == {
        g.group_id: before[g.group_id] for g in delivered
    }
    with pytest.raises(TypeError, match="read-only"):
        delivered[0].samples[5] = before[delivered[0].group_id][0]
    await b.controller.ack(lease.lease_id, 1)
    await b.controller.finalize(1)  # removing kept rows reports their row ids
    report = await b.checkpoint()
    assert report.rows[RowKind.REMOVED] == 4 and report.rows[RowKind.LIVE] == 8


def _samples(node):
    return {gid: g.ordered_samples() for gid, g in node.controller.rooms.buffer.groups.items()}


async def _consume_one(node):
    """Fetch, ack and finalize the oldest committed group; wait for its replacement."""
    lease, groups = await fetch(node.controller, 1, 100, "t")
    await node.controller.ack(lease.lease_id, 1)
    await node.controller.finalize(1)
    await settle(lambda: node.controller.status().buffer.committed == 6)
    return groups[0].group_id


async def test_sealed_rows_are_delivered_written_and_restored_unchanged(nodes):
    a = nodes(sealer=ArrowSealer())
    a.controller.start()
    await settle(lambda: a.controller.status().buffer.committed == 6)
    before = _samples(a)
    a.controller.rooms.buffer.seal()
    groups = a.controller.rooms.buffer.groups
    assert all(isinstance(g.samples, KeptSamples) for g in groups.values())
    assert _samples(a) == before  # every field read back from the columns

    consumed = await _consume_one(a)  # sealed, never captured: neither new nor removed
    first = await a.checkpoint()
    assert first.rows == {RowKind.NEW: 12, RowKind.REMOVED: 0, RowKind.LIVE: 12}
    a.controller.rooms.buffer.seal()  # the replacement, captured as objects, is sealed afterwards
    assert consumed not in groups and all(
        isinstance(g.samples, KeptSamples) for g in groups.values()
    )
    await _consume_one(a)  # a captured sealed group leaves: its rows are removed
    second = await a.checkpoint()
    assert second.rows == {RowKind.NEW: 2, RowKind.REMOVED: 2, RowKind.LIVE: 12}
    live = _samples(a)
    await a.controller.stop()

    b = nodes(engine=GatedEngine())
    await b.restore()
    assert _samples(b) == live


async def test_a_failed_snapshot_hands_its_sealed_rows_to_the_next(nodes):
    a = nodes(sealer=ArrowSealer())
    a.controller.start()
    await settle(lambda: a.controller.status().buffer.committed == 6)
    a.controller.rooms.buffer.seal()

    def broken(*args, **kw):
        raise OSError(28, "No space left on device")

    a.store.write_segment = broken
    assert (await a.checkpoint()).outcome is Outcome.FAILED
    del a.store.write_segment
    await _consume_one(a)  # a sealed row handed back and removed is written by no snapshot
    r = await a.checkpoint()
    assert r.outcome is Outcome.COMPLETED
    assert r.rows[RowKind.NEW] == r.rows[RowKind.LIVE] == 12
    live = _samples(a)
    await a.controller.stop()

    b = nodes(engine=GatedEngine())
    await b.restore()
    assert _samples(b) == live


async def test_a_long_restore_logs_its_progress_while_the_loop_stays_free(
    nodes, monkeypatch, caplog
):
    a = nodes()
    a.controller.start()
    await settle(lambda: a.controller.status().buffer.committed == 6)
    await a.checkpoint()
    await a.controller.stop()
    indexing = Snapshot.kept_rows

    def slow(self, *args):  # the rows of a large snapshot take a while to arrive
        time.sleep(0.3)
        return indexing(self, *args)

    monkeypatch.setattr(Snapshot, "kept_rows", slow)
    monkeypatch.setattr(restore_module, "PROGRESS_S", 0.02)
    ticks = 0

    async def tick():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticking = asyncio.create_task(tick())
    b = nodes(engine=GatedEngine())
    with caplog.at_level(logging.INFO, logger="rolloutd.checkpoint.restore"):
        await b.restore()
    ticking.cancel()
    assert ticks >= 10  # the event loop ran while the rows were read
    progress = [
        r.getMessage() for r in caplog.records if "rows read and verified" in r.getMessage()
    ]
    assert len(progress) >= 3
    assert "(100%)" in progress[-1]


async def test_changed_groups_go_to_a_group_segment_and_supersede_their_old_row(nodes):
    a = nodes()
    a.controller.start()
    await settle(lambda: a.controller.status().buffer.committed == 6)
    first = a.store.load((await a.checkpoint()).sequence)
    assert [g.live_rows for g in first.groups] == [len(a.controller.rooms.buffer.groups)]
    lease, (leased,) = await fetch(a.controller, 1, 100, "t")
    await a.controller.ack(lease.lease_id, 3)
    report = await a.checkpoint()
    second = a.store.load(report.sequence)
    old, new = second.groups
    assert new.rows == 1 and new.row_ids.mask([leased.group_id]).all()
    assert old.removed.mask([leased.group_id]).all()  # live in exactly one group segment
    assert second.sidecar.size < first.sidecar.size + 200  # no group in the sidecar
    assert 0 < report.size_bytes[SizePart.GROUPS] < second.groups[0].file.size
    await a.controller.stop()

    b = nodes(engine=GatedEngine())
    await b.restore()
    restored = b.controller.rooms.buffer.groups
    assert len(restored) == sum(g.live_rows for g in second.groups)
    assert restored[leased.group_id].meta.ack_step == 3


async def test_granularity_group_reruns_whole_groups(nodes):
    engine = GatedEngine()
    a = nodes(engine=engine, max_in_flight=1, buffer_capacity=1)
    a.controller.start()
    await settle(lambda: len(engine.requests) == 2)
    engine.release(1)
    await settle(lambda: sum(len(g.samples) for g in generating_groups(a.controller)) == 1)
    await a.checkpoint()
    await a.controller.stop()
    b = nodes(engine=GatedEngine())
    r = await b.restore(granularity=Granularity.GROUP)
    assert r.siblings == {Disposition.REUSED: 0, Disposition.RERUN: 2}
    await settle(lambda: len(b.engine.requests) == 2)
    assert sorted(req.index for req in b.engine.requests) == [0, 1]


async def test_acks_journaled_after_the_snapshot_are_applied(nodes):
    a = nodes(max_in_flight=2, buffer_capacity=4)
    a.controller.start()
    await settle(lambda: a.controller.status().buffer.committed == 4)
    await a.checkpoint()
    in_snapshot = await fetch(a.controller, 1, 100, "t")
    await a.controller.ack(in_snapshot[0].lease_id, 3)
    # a group admitted and acked after the snapshot: its rows were never durable
    await settle(
        lambda: (
            a.controller.status().buffer.committed == 4 and a.controller.rooms.ids.next_local > 5
        )
    )
    ready = [
        g for g in a.controller.rooms.buffer.groups.values() if g.state is GroupState.COMMITTED
    ]
    newest = max(ready, key=lambda g: g.group_id)
    while True:
        lease, groups = await fetch(a.controller, 1, 100, "t")
        await a.controller.ack(lease.lease_id, 4)
        if groups[0].group_id == newest.group_id:
            break
    await a.controller.stop()

    b = nodes()
    await b.restore()
    assert b.controller.rooms.buffer.groups[in_snapshot[1][0].group_id].state is GroupState.ACKED
    assert newest.group_id not in b.controller.rooms.buffer.groups
    b.controller.start()
    delivered = []
    while (leased := await fetch(b.controller, 4, 300, "t")) is not None:
        delivered += [g.meta.position for g in leased[1]]
        await b.controller.ack(leased[0].lease_id, 5)
    assert newest.meta.position not in delivered  # its position is never admitted again
    assert in_snapshot[1][0].meta.position not in delivered
    rewound = await b.controller.rewind(3)
    assert rewound.readmitted_prompts >= 1  # the lost group's prompt comes back on a rewind


async def test_a_lease_that_expired_by_the_restore_does_not_deliver_stale_groups(nodes, tmp_path):
    # gating off: the test fills the buffer with no trainer's pace to go by (the gate would
    # admit max_in_flight groups at a version, and after the restore one at a time)
    a = nodes(max_staleness=0, lease_timeout_s=0.2, reap_interval_s=3600, staleness_gating=False)
    a.controller.start()
    await settle(lambda: a.controller.status().buffer.committed == 6)
    lease, [group] = await fetch(a.controller, 1, 100, "t")
    await a.controller.update_weights(1, str(tmp_path))  # the leased group stays the trainer's
    assert a.controller.rooms.buffer.groups[group.group_id].state is GroupState.LEASED
    await a.checkpoint()
    await a.controller.stop()
    await settle(lambda: time.time() > lease.expires_at)

    b = nodes(max_staleness=0, staleness_gating=False)
    await b.restore()
    assert group.group_id not in b.controller.rooms.buffer.groups
    assert (
        b.controller.rooms.accounting.counters.evicted_groups
        == a.controller.rooms.accounting.counters.evicted_groups + 1
    )
    b.controller.start()
    await settle(lambda: any(r.prompt == group.meta.prompt for r in b.engine.requests))
    await settle(lambda: b.controller.status().buffer.committed == 6)
    while (leased := await fetch(b.controller, 8, 0, "t")) is not None:
        assert {g.policy_version for g in leased[1]} == {1}


async def test_changed_configuration_is_refused_with_the_differing_keys(nodes):
    a = nodes()
    a.controller.start()
    await settle(lambda: a.controller.status().buffer.committed >= 1)
    await a.checkpoint()
    await a.controller.stop()
    b = nodes()
    with pytest.raises(RestoreRefused, match=r"group_size: snapshot 2 != now 4"):
        await b.restore(fingerprint={**FINGERPRINT, "group_size": 4})


async def test_a_corrupt_newest_snapshot_falls_back_with_a_reason(nodes, tmp_path):
    a = nodes()
    a.controller.start()
    await settle(lambda: a.controller.status().buffer.committed >= 2)
    first = await a.checkpoint()
    await fetch(a.controller, 1, 100, "t")
    second = await a.checkpoint()
    await a.controller.stop()
    [newest] = (tmp_path / "store" / "sidecars").glob(f"{second.sequence:020d}-*")
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    b = nodes()
    r = await b.restore()
    assert r.sequence == first.sequence
    assert [s.sequence for s in r.skipped] == [second.sequence] and r.skipped[0].reason


async def _two_snapshots(nodes):
    """Two snapshots; the second wrote a sample segment and a group segment of its own."""
    a = nodes()
    a.controller.start()
    await settle(lambda: a.controller.status().buffer.committed == 6)
    first = await a.checkpoint()
    before = {g.group_id: g.meta for g in a.controller.rooms.buffer.groups.values()}
    lease, _ = await fetch(a.controller, 2, 100, "t")
    await a.controller.ack(lease.lease_id, 1)
    await a.controller.finalize(1)  # room for new groups: the second snapshot has new rows
    await settle(lambda: a.controller.status().buffer.committed == 6)
    second = await a.checkpoint()
    await a.controller.stop()
    manifest = a.store.load(second.sequence)
    assert any(s.written_by == second.sequence for s in manifest.segments)
    return first, second, manifest, before


def _flip_middle_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["rows", "groups"])
async def test_a_corrupt_segment_is_skipped_with_its_reason(nodes, tmp_path, kind):
    """Rows are checked while the groups decode: bytes that fail the check after decoding
    began still send the restore to the previous snapshot, and nothing of them is kept."""
    first, second, manifest, before = await _two_snapshots(nodes)
    listed = manifest.segments if kind == "rows" else manifest.groups
    [newest] = [s for s in listed if s.written_by == second.sequence]
    _flip_middle_byte(tmp_path / "store" / newest.file.path)
    b = nodes(engine=GatedEngine())
    r = await b.restore()
    assert r.sequence == first.sequence
    assert [s.sequence for s in r.skipped] == [second.sequence]
    assert newest.file.path in r.skipped[0].reason and "checksum" in r.skipped[0].reason
    # the first snapshot's groups (with the ack journaled after it), none of the second's
    restored = b.controller.rooms.buffer.groups
    assert {gid: g.meta.prompt for gid, g in restored.items()} == {
        gid: m.prompt for gid, m in before.items()
    }
    assert sum(g.state is GroupState.ACKED for g in restored.values()) == 2


async def test_io_errors_are_failed_attempts_and_count_in_a_row(nodes, tmp_path):
    a = nodes()
    a.controller.start()
    await settle(lambda: a.controller.status().buffer.committed >= 1)

    def broken(*args, **kw):
        raise OSError(28, "No space left on device")

    a.store.write_segment = broken
    for expected in (1, 2, 3):
        r = await a.checkpoint()
        assert (r.outcome, r.reason) == (Outcome.FAILED, Reason.IO_ERROR)
        assert a.checkpointer.consecutive_failures == expected
    assert a.checkpointer.failing
    del a.store.write_segment  # the disk has room again: the next attempt writes everything
    r = await a.checkpoint()
    assert r.outcome is Outcome.COMPLETED and not a.checkpointer.failing
    staged = sum(len(g.samples) for g in a.controller.rooms.buffer.groups.values())
    assert r.rows[RowKind.NEW] == r.rows[RowKind.LIVE] == staged  # nothing lost by the failures


async def test_concurrent_periodic_attempt_is_skipped_in_progress(nodes):
    a = nodes()
    a.controller.start()
    await settle(lambda: a.controller.status().buffer.committed >= 1)
    periodic = a.checkpointer.checkpoint(Trigger.PERIODIC)
    first, second = await asyncio.gather(a.checkpoint(), periodic)
    assert {(first.outcome, first.reason), (second.outcome, second.reason)} == {
        (Outcome.COMPLETED, Reason.COMPLETED),
        (Outcome.SKIPPED, Reason.IN_PROGRESS),
    }


async def test_an_on_demand_attempt_waits_for_the_running_one_and_finalizes_its_step(nodes):
    a = nodes()
    a.controller.start()
    await settle(lambda: a.controller.status().buffer.committed >= 2)
    lease, groups = await fetch(a.controller, 2, 0, "t")
    await a.controller.ack(lease.lease_id, 4)
    running = asyncio.ensure_future(a.checkpointer.checkpoint(Trigger.PERIODIC, tag="p"))
    await asyncio.sleep(0)  # the periodic attempt holds the checkpointer
    on_demand = await a.checkpoint(trainer_step=4)
    assert (await running).outcome is Outcome.COMPLETED
    assert (on_demand.outcome, on_demand.reason) == (Outcome.COMPLETED, Reason.COMPLETED)
    assert on_demand.sequence == (await running).sequence + 1
    assert a.controller.rooms.accounting.counters.finalized_groups == len(groups)
    assert all(g.group_id not in a.controller.rooms.buffer.groups for g in groups)


async def test_finalized_leases_of_every_snapshot_survive_a_restore(nodes):
    a = nodes()
    a.controller.start()
    finalized = []
    for step in (1, 2):
        await settle(lambda: a.controller.status().buffer.committed == 6)
        lease, _groups = await fetch(a.controller, 1, 100, "t")
        await a.controller.ack(lease.lease_id, step)
        await a.controller.finalize(step)
        finalized.append(lease.lease_id)
        assert (await a.checkpoint()).outcome is Outcome.COMPLETED
    await a.controller.stop()

    b = nodes()
    await b.restore()
    assert list(b.controller.rooms.ledger.finalized_leases) == finalized
    for step, lease_id in enumerate(finalized, start=1):  # the same step: idempotent
        assert (await b.controller.ack(lease_id, step)).already_acked


async def test_compaction_merges_small_segments_and_keeps_the_large_one(nodes):
    a = nodes(engine=GatedEngine(auto=True, tokens=2000))
    a.checkpointer.config = replace(a.checkpointer.config, compact_segments=4)
    a.controller.start()
    await settle(lambda: a.controller.status().buffer.committed == 6)
    first = await a.checkpoint()
    large = a.store.load(first.sequence).segments[0].file
    for step in range(1, 5):  # each removes a group of the first segment and adds one
        lease, _groups = await fetch(a.controller, 1, 100, "t")
        await a.controller.ack(lease.lease_id, step)
        await a.controller.finalize(step)
        await settle(lambda: a.controller.status().buffer.committed == 6)
        last = await a.checkpoint()
    manifest = a.store.load(last.sequence)
    assert len(manifest.segments) == 2 and manifest.segments[0].file == large
    assert manifest.segments[1].written_by == last.sequence
    rows = manifest.live_rows
    await a.controller.stop()

    b = nodes(engine=GatedEngine())
    await b.restore()
    assert sum(len(g.samples) for g in b.controller.rooms.buffer.groups.values()) == rows == 12


async def test_an_attempt_that_timed_out_never_publishes_and_the_next_holds_its_rows(nodes):
    """A disk stall outlasts an attempt: the attempt fails with ``timeout`` while its worker
    thread still waits on the disk. When the stall ends, that thread must publish nothing (a
    snapshot the checkpointer reported failed, whose capture it handed back, racing the next
    attempt and retention); the next attempt writes everything since the last success."""
    a = nodes()
    a.checkpointer.config = CheckpointerConfig(keep_latest=2, timeout_s=0.2)
    a.controller.start()
    await settle(lambda: a.controller.status().buffer.committed >= 2)
    stall, stalled = threading.Event(), threading.Event()
    real_write_sidecar = a.store.write_sidecar_json

    def write_sidecar_on_a_stalled_disk(sequence, data):
        stalled.set()
        stall.wait(30)
        return real_write_sidecar(sequence, data)

    finished = threading.Event()
    real_write_snapshot = a.checkpointer._write_snapshot

    def write_snapshot(*args):
        try:
            return real_write_snapshot(*args)
        finally:
            finished.set()  # the worker thread is done, published or not

    a.store.write_sidecar_json = write_sidecar_on_a_stalled_disk
    a.checkpointer._write_snapshot = write_snapshot
    late = await a.checkpoint()
    assert (late.outcome, late.reason) == (Outcome.FAILED, Reason.TIMEOUT)
    assert stalled.is_set()
    stall.set()  # the disk comes back while nothing waits for the attempt any more
    assert await asyncio.to_thread(finished.wait, 30)
    assert a.store.sequences() == [], "an attempt that timed out published a snapshot"

    a.store.write_sidecar_json = real_write_sidecar
    a.checkpointer._write_snapshot = real_write_snapshot
    a.checkpointer.config = CheckpointerConfig(keep_latest=2, timeout_s=30)
    await fetch(a.controller, 1, 100, "t")
    r = await a.checkpoint()
    assert r.outcome is Outcome.COMPLETED and a.store.sequences() == [r.sequence]
    held = sum(len(g.samples) for g in a.controller.rooms.buffer.groups.values())
    assert r.rows[RowKind.LIVE] == held
    b = nodes(engine=GatedEngine())
    await b.restore()
    assert sum(len(g.samples) for g in b.controller.rooms.buffer.groups.values()) == held


async def test_an_attempt_publishing_when_it_times_out_completes(nodes, caplog):
    """Publishing is the commit point: a timeout that comes while the manifest is on its way
    waits for it, and the attempt counts as completed (the parent moves to it)."""
    a = nodes()
    a.checkpointer.config = CheckpointerConfig(keep_latest=2, timeout_s=0.2)
    a.controller.start()
    await settle(lambda: a.controller.status().buffer.committed >= 2)
    stall, publishing = threading.Event(), threading.Event()
    real_publish = a.store.publish

    def publish_on_a_stalled_disk(manifest):
        publishing.set()
        stall.wait(30)
        real_publish(manifest)

    a.store.publish = publish_on_a_stalled_disk
    attempt = asyncio.create_task(a.checkpoint())
    await settle(lambda: any("publishing when the attempt timed out" in m for m in caplog.messages))
    assert publishing.is_set()
    stall.set()
    r = await attempt
    assert r.outcome is Outcome.COMPLETED and a.store.sequences() == [r.sequence]
    assert a.checkpointer.sequence == r.sequence


TAGS = {1: ("step-1", 1), 2: ("manual-1", None), 5: ("step-5", 5), 10: ("step-10", 10)}


async def _tagged_history(node: Node, steps: int) -> None:
    """One checkpoint per trainer step, tagged as TAGS says (the rollback walkthrough's tags)."""
    node.controller.start()
    for step in range(1, steps + 1):
        await settle(lambda: node.controller.status().buffer.committed >= 1)
        lease, _groups = await fetch(node.controller, 1, 100, "t")
        await node.controller.ack(lease.lease_id, step)
        tag, trainer_step = TAGS.get(step, ("", step))
        report = await node.checkpoint(tag=tag, trainer_step=trainer_step)
        assert report.outcome is Outcome.COMPLETED, report
    await node.controller.stop()


async def test_retention_keeps_the_newest_tagged_snapshots(nodes):
    """keep_latest=2, rewind_window=2: without keep_tagged only step-10's snapshot would be
    needed by a rewind, and manual-1 (no trainer step) never; keep_tagged keeps all four."""
    a = nodes(rewind_window=2)
    await _tagged_history(a, 14)
    tags = [m.tag for m in a.store.list() if m.tag]
    assert tags == ["step-10", "step-5", "manual-1", "step-1"]
    assert len(a.store.list()) == 2 + 4


async def test_keep_tagged_bounds_what_tags_protect(nodes):
    a = nodes(rewind_window=2)
    a.checkpointer.config = replace(a.checkpointer.config, keep_tagged=1)
    await _tagged_history(a, 14)
    assert [m.tag for m in a.store.list() if m.tag] == ["step-10"]
    assert len(a.store.list()) == 3


async def test_a_skip_with_no_changes_counts_as_fresh(nodes):
    """An idle, healthy service has a current snapshot: since_success must not keep growing
    (RolloutdCheckpointStale fired on idle pods)."""
    a = nodes()
    a.controller.start()
    await settle(lambda: a.controller.status().buffer.committed == 6)  # the buffer is full
    assert (await a.checkpointer.checkpoint(Trigger.PERIODIC)).outcome is Outcome.COMPLETED
    completed_at = a.checkpointer.last_success_at
    asked_at = time.time()
    skipped = await a.checkpointer.checkpoint(Trigger.PERIODIC)
    assert (skipped.outcome, skipped.reason) == (Outcome.SKIPPED, Reason.NO_CHANGES)
    # counted from the skip, not from the snapshot written before it was asked for
    assert completed_at < asked_at
    assert a.checkpointer.since_success_s() <= time.time() - asked_at
    assert a.checkpointer.last_success_at == completed_at  # still the last snapshot written
    await a.controller.stop()


async def test_a_slow_attempt_logs_how_long_each_phase_took(nodes, monkeypatch, caplog):
    from rolloutd.checkpoint import checkpointer as checkpointer_module

    a = nodes()
    a.controller.start()
    await settle(lambda: a.controller.status().buffer.committed >= 2)
    real_write = a.store.write_segment

    def slow_write(*args):  # a segment's fsync waiting on a busy disk
        time.sleep(0.3)
        return real_write(*args)

    monkeypatch.setattr(checkpointer_module, "SLOW_S", 0.25)
    a.store.write_segment = slow_write
    with caplog.at_level(logging.INFO, logger="rolloutd.checkpoint.checkpointer"):
        slow = await a.checkpoint()
        a.store.write_segment = real_write
        await fetch(a.controller, 1, 100, "t")
        quick = await a.checkpoint()
    assert slow.outcome is quick.outcome is Outcome.COMPLETED
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.getMessage().startswith(f"checkpoint seq={slow.sequence} took 0.")
    phases = dict(
        part.rsplit(" ", 2)[:2] for part in warning.getMessage().split(": ", 1)[1].split(", ")
    )
    assert list(phases) == [p.value for p in CheckpointPhase]
    assert int(phases[CheckpointPhase.BUFFER_SAVE.value]) >= 300


async def test_a_reused_tag_answers_with_the_snapshot_it_now_names(nodes, caplog):
    """A trainer restarted from an earlier step tags its checkpoints as it did before: the tag
    moves to the new snapshot, and the one it named stays reachable by its sequence."""
    caplog.set_level("INFO", logger="rolloutd.checkpoint.checkpointer")
    a = nodes()
    first = await a.checkpoint(tag="step-10", trainer_step=None)
    assert first.outcome is Outcome.COMPLETED and first.retagged is None
    assert first.message() == ""
    second = await a.checkpoint(tag="step-10", trainer_step=None)
    assert second.outcome is Outcome.COMPLETED and second.retagged == first.sequence
    assert f"now names snapshot {second.sequence}" in second.message()
    assert f"snapshot {first.sequence}, which it named before, stays reachable" in (
        second.message()
    )
    assert any("now names snapshot" in r.getMessage() for r in caplog.records)
    assert {m.sequence for m in a.store.list()} >= {first.sequence, second.sequence}
