"""What the journal holds after the newest snapshot (or with no snapshot at all) comes back on
restore: acks, live lease grants, accepted submissions and reserved group ids. The stopped
controller stands for a process killed at that instant (everything it told a client is in the
journal; nothing after the snapshot is in a snapshot)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from rolloutd.checkpoint.store import SnapshotStore
from rolloutd.domain.controller import ID_BITS, ID_BLOCK
from rolloutd.domain.errors import Unavailable
from rolloutd.domain.group import GroupState, Prompt
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.sampler import Admission
from tests.checkpoint.test_checkpointer import nodes  # noqa: F401  (the fixture)
from tests.controllers import fetch
from tests.fakes import settle


async def drain(controller, step, *, wait_ms=300):
    """Fetches and acks until nothing comes within ``wait_ms``; the prompt ids delivered."""
    delivered = []
    while (leased := await fetch(controller, 4, wait_ms, "t")) is not None:
        delivered += [g.meta.prompt.prompt_id for g in leased[1]]
        await controller.ack(leased[0].lease_id, step)
    return delivered


async def _restored_after_one_expiry(nodes):  # noqa: F811
    """Restores a node with a 0.5 s lease timeout, waits for the one restored lease to expire,
    and drains it: the 40 prompts, each delivered once."""
    b = nodes(lease_timeout_s=0.5)
    await b.restore()
    b.controller.start()
    await settle(lambda: b.controller.rooms.accounting.counters.expired_leases == 1, within_s=60)
    delivered = await drain(b.controller, 1)
    assert sorted(delivered) == sorted({*delivered}) and len(delivered) == 40
    return delivered


async def test_an_ack_before_any_snapshot_holds_after_a_restart(nodes):  # noqa: F811
    a = nodes()
    a.controller.start()
    lease, groups = await fetch(a.controller, 2, 2000, "t")
    await a.controller.ack(lease.lease_id, 1)
    await a.controller.stop()
    assert a.store.sequences() == []  # no snapshot: only the journal

    b = nodes()
    await b.restore()
    again = await b.controller.ack(lease.lease_id, 1)
    assert again.already_acked  # the ack held, and acks again idempotently
    b.controller.start()
    delivered = await drain(b.controller, 2)
    acked = {g.meta.prompt.prompt_id for g in groups}
    assert not acked & set(delivered), "acknowledged prompts delivered again"
    assert len(delivered) + len(acked) == 40  # and no other prompt was lost


async def test_a_lease_survives_a_restart_and_its_groups_go_to_nobody_else(nodes):  # noqa: F811
    a = nodes()
    a.controller.start()
    await settle(lambda: a.controller.status().buffer.committed >= 4)
    await a.checkpoint()
    # leased after the snapshot: one group the snapshot holds ready, and then newer ones
    lease, groups = await fetch(a.controller, 4, 2000, "t")
    held = [g for g in groups if g.group_id <= 4]
    assert held
    await a.controller.stop()

    b = nodes()
    await b.restore()
    b.controller.start()
    taken_by_others = await drain(b.controller, 1)
    leased_ids = {g.meta.prompt.prompt_id for g in groups}
    assert not leased_ids & set(taken_by_others)  # neither held nor lost groups were redelivered
    result = await b.controller.ack(lease.lease_id, 2)
    assert result.acked_groups == len(groups) and not result.already_acked
    assert len(taken_by_others) + len(groups) == 40


async def test_a_restored_lease_that_expires_gives_its_groups_back(nodes):  # noqa: F811
    a = nodes(lease_timeout_s=0.5)
    a.controller.start()
    await settle(lambda: a.controller.status().buffer.committed >= 2)
    await a.checkpoint()
    _lease, groups = await fetch(a.controller, 4, 2000, "t")
    await a.controller.stop()

    delivered = await _restored_after_one_expiry(nodes)
    assert {g.meta.prompt.prompt_id for g in groups} <= set(delivered)


async def test_submitted_prompts_are_durable_without_a_snapshot(nodes):  # noqa: F811
    a = nodes(max_in_flight=1, buffer_capacity=1)
    prompts = [Admission(Prompt(f"s{i}", f"submitted {i}"), None) for i in range(5)]
    assert await a.controller.submit(prompts) == (5, 0)
    await a.controller.stop()

    b = nodes()
    await b.restore()
    assert await b.controller.submit(prompts[:2]) == (0, 2)  # idempotent across the restart
    b.controller.start()
    delivered = await drain(b.controller, 1)
    assert sorted(p for p in delivered if p.startswith("s")) == [f"s{i}" for i in range(5)]


async def test_group_ids_are_never_issued_twice_across_restarts(nodes):  # noqa: F811
    seen: dict[int, str] = {}
    for life in range(4):
        node = nodes()
        await node.restore()
        node.controller.start()
        await settle(lambda n=node: n.controller.status().buffer.committed >= 2)
        if life == 1:
            await node.checkpoint()
        for g in node.controller.rooms.buffer.groups.values():
            prompt = g.meta.prompt.prompt_id
            assert seen.setdefault(g.group_id, prompt) == prompt, f"id {g.group_id} reissued"
        await node.controller.stop()  # groups admitted since the snapshot are lost
    # each life reserved a block in the journal: ids keep climbing past them
    assert max(seen) > ID_BLOCK


async def test_the_replica_is_part_of_every_group_id(nodes):  # noqa: F811
    a = nodes(replica=3)
    a.controller.start()
    await settle(lambda: a.controller.status().buffer.committed >= 1)
    assert all(gid >> ID_BITS == 3 for gid in a.controller.rooms.buffer.groups)


async def test_concurrent_writes_share_a_sync(tmp_path):
    """Eight writers on the event loop, as the service's acks, leases and submissions are: each
    waits until its record is durable before it writes the next."""
    store = SnapshotStore(str(tmp_path / "store"))
    barrier = asyncio.Barrier(8)
    positions: list[int] = []

    async def writer(n: int) -> None:
        await barrier.wait()
        for i in range(25):
            positions.append(await store.journal.enqueue({"writer": n, "i": i}))

    await asyncio.gather(*(writer(n) for n in range(8)))
    assert sorted(positions) == list(range(1, 201))
    assert store.journal.syncs < 200  # group commit: some syncs made several records durable
    reread = SnapshotStore(str(tmp_path / "store")).journal.read(0)
    assert [e.position for e in reread] == list(range(1, 201))
    assert sorted((e.record["writer"], e.record["i"]) for e in reread) == sorted(
        (n, i) for n in range(8) for i in range(25)
    )


async def test_a_restored_lease_of_lost_groups_survives_a_second_restart(nodes):  # noqa: F811
    """The lease names groups admitted after the first snapshot (lost in the crash); after a
    restore, a snapshot that covers the lease, and another crash, its ack still consumes them."""
    a = nodes()
    a.controller.start()
    await settle(lambda: a.controller.status().buffer.committed >= 2)
    await a.checkpoint()
    in_snapshot = set(a.controller.rooms.buffer.groups)
    first, firsts = await fetch(a.controller, 2, 2000, "t")
    await a.controller.ack(first.lease_id, 1)  # frees room: groups are admitted after the snapshot
    await settle(
        lambda: any(
            g.state is GroupState.COMMITTED and gid not in in_snapshot
            for gid, g in a.controller.rooms.buffer.groups.items()
        )
    )
    lease, groups = await fetch(a.controller, 6, 2000, "t")
    lost = [g for g in groups if g.group_id not in in_snapshot]
    assert lost, "the lease should hold a group the snapshot lacks"
    await a.controller.stop()

    b = nodes()
    await b.restore()
    await b.checkpoint()  # covers the lease record: the next restore does not replay it
    await b.controller.stop()

    c = nodes()
    await c.restore()
    c.controller.start()
    others = await drain(c.controller, 1)
    result = await c.controller.ack(lease.lease_id, 2)
    assert result.acked_groups == len(groups)
    leased = {g.meta.prompt.prompt_id for g in groups}
    assert not leased & set(others)
    assert len(others) + len(groups) + len(firsts) == 40


class HeldSync:
    """Holds the journal's next batch before it is written (the worker thread waits), then
    writes it, or fails it with ``error``."""

    def __init__(self, journal, error: OSError | None = None) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self._journal, self._real, self._error = journal, journal._append, error
        journal._append = self._append

    def _append(self, records):
        self.entered.set()
        assert self.release.wait(10), "the held sync was never released"
        self._journal._append = self._real
        if self._error is not None:
            raise self._error
        return self._real(records)


async def test_a_checkpoint_does_not_wait_for_an_ack_syncing_and_restore_replays_it(nodes):  # noqa: F811
    a = nodes()
    a.controller.start()
    lease, groups = await fetch(a.controller, 2, 2000, "t")
    before = a.journal.position
    held = HeldSync(a.journal)
    acking = asyncio.ensure_future(a.controller.ack(lease.lease_id, 1))
    await settle(held.entered.is_set)
    report = await asyncio.wait_for(a.checkpoint(), 10)  # the ack holds no barrier meanwhile
    assert not acking.done()
    assert a.store.load(report.sequence).acks_through == before  # the ack is not in it
    held.release.set()
    assert not (await acking).already_acked
    assert a.journal.position == before + 1
    await a.controller.stop()

    b = nodes()
    await b.restore()
    assert (await b.controller.ack(lease.lease_id, 1)).already_acked  # replayed from the journal
    b.controller.start()
    delivered = await drain(b.controller, 2)
    assert not {g.meta.prompt.prompt_id for g in groups} & set(delivered)


async def test_an_ack_durable_before_the_capture_is_in_the_snapshot(nodes):  # noqa: F811
    a = nodes()
    a.controller.start()
    lease, _groups = await fetch(a.controller, 2, 2000, "t")
    held = HeldSync(a.journal)
    acking = asyncio.ensure_future(a.controller.ack(lease.lease_id, 1))
    await settle(held.entered.is_set)
    async with a.controller.barrier.mutation(MutationKind.ADMIT):  # keeps the checkpoint draining
        checkpointing = asyncio.ensure_future(a.checkpoint())
        await settle(lambda: a.controller.barrier._writers_waiting == 1)
        held.release.set()
        # durable now; the ack's own mutation waits behind the checkpoint's writer priority
        await settle(lambda: a.journal._flushing is None)
    report = await checkpointing
    assert not (await acking).already_acked
    manifest = a.store.load(report.sequence)
    assert manifest.acks_through == a.journal.position  # the record is covered ...
    await a.controller.stop()

    b = nodes()
    await b.restore()  # ... so restore does not replay it: the snapshot itself holds the ack
    assert (await b.controller.ack(lease.lease_id, 1)).already_acked


async def test_an_ack_whose_sync_fails_applies_nothing_and_a_retry_succeeds(nodes):  # noqa: F811
    a = nodes()
    a.controller.start()
    lease, groups = await fetch(a.controller, 2, 2000, "t")
    held = HeldSync(a.journal, OSError(28, "No space left on device"))
    acking = asyncio.ensure_future(a.controller.ack(lease.lease_id, 1))
    await settle(held.entered.is_set)
    report = await asyncio.wait_for(a.checkpoint(), 10)  # captures the lease as granted
    held.release.set()
    with pytest.raises(Unavailable, match=r"could not be made durable: .*No space left"):
        await acking
    assert lease.lease_id in a.controller.rooms.ledger.leases  # still granted, nothing acked
    assert a.controller.rooms.accounting.counters.acked_groups == 0
    assert not (await a.controller.ack(lease.lease_id, 1)).already_acked  # the retry is the ack
    await a.controller.stop()

    b = nodes()
    restored = await b.restore()
    assert restored.sequence == report.sequence
    assert (await b.controller.ack(lease.lease_id, 1)).already_acked
    b.controller.start()
    delivered = await drain(b.controller, 2)
    assert not {g.meta.prompt.prompt_id for g in groups} & set(delivered)


async def test_a_lease_whose_sync_fails_comes_back_also_from_a_snapshot_taken_meanwhile(nodes):  # noqa: F811
    a = nodes(lease_timeout_s=0.5)
    a.controller.start()
    await settle(lambda: a.controller.status().buffer.committed >= 2)
    held = HeldSync(a.journal, OSError(5, "Input/output error"))
    fetching = asyncio.ensure_future(fetch(a.controller, 2, 2000, "t"))
    await settle(held.entered.is_set)
    await asyncio.wait_for(a.checkpoint(), 10)  # captures the grant while it syncs
    held.release.set()
    with pytest.raises(Unavailable, match="lease could not be made durable"):
        await fetching
    assert not a.controller.rooms.ledger.leases  # requeued at once in the live process
    await a.controller.stop()

    # the snapshot's grant, which nobody received, expires like any unacked lease
    await _restored_after_one_expiry(nodes)


def _journal_bytes(node) -> int:
    journal = Path(node.store.backend.root) / "journal"
    return sum(p.stat().st_size for p in journal.glob("*.jsonl"))


async def test_leases_and_acks_name_prompts_by_reference_and_replay_resolves_them(nodes):  # noqa: F811
    """A lease or ack record names each group's prompt by id and position, so a prompt's
    metadata is journaled once (with its submission), not with every lease and ack; replay
    finds the prompts again, also for groups no snapshot held."""
    big = {"reference": "x" * 200_000}
    a = nodes(lease_timeout_s=1.0)
    prompts = [Admission(Prompt(f"s{i}", f"submitted {i}", big), None) for i in range(2)]
    assert await a.controller.submit(prompts) == (2, 0)
    submitted = _journal_bytes(a)
    assert submitted > 400_000
    a.controller.start()
    leases = []
    for _ in range(2):  # submitted prompts go first: one lease each
        lease, [group] = await fetch(a.controller, 1, 2000, "t")
        assert group.meta.prompt.metadata == big
        leases.append(lease)
    await a.controller.ack(leases[0].lease_id, 1)
    assert _journal_bytes(a) - submitted < 4_000  # two lease records and an ack
    await a.controller.stop()

    b = nodes(lease_timeout_s=1.0)
    await b.restore()  # no snapshot: both groups are lost, known from the journal only
    assert (await b.controller.ack(leases[0].lease_id, 1)).already_acked
    b.controller.start()
    # the unacked lease expires: its prompt, found again by reference, is admitted again whole
    await settle(lambda: b.controller.rooms.accounting.counters.expired_leases == 1, within_s=60)
    again = []
    while not again:
        lease, groups = await fetch(b.controller, 4, 2000, "t")
        again = [g.meta.prompt for g in groups if g.meta.prompt.prompt_id == "s1"]
        await b.controller.ack(lease.lease_id, 2)
    assert again[0].metadata == big


def test_lease_and_ack_records_written_before_references_are_still_read():
    from rolloutd.checkpoint import journal_records
    from rolloutd.checkpoint.sidecar import to_json
    from rolloutd.domain.group import Position
    from rolloutd.domain.journal import AckRecord, Lease

    admission = Admission(Prompt("p3", "question 3", {"a": 1}), Position(0, 3))
    whole = [{"group_id": 7, **to_json(admission)}]
    lease = Lease("l", (7,), "t", 1.0, 2.0)
    old_lease = {"kind": "lease", **to_json(lease), "groups": whole}
    old_ack = {**to_json(AckRecord("l", (7,), 4, 1.5)), "groups": whole}  # before `kind`, too
    for record in (old_lease, old_ack):
        event = journal_records.decode(record)
        assert event.admissions == {7: admission} and not event.refs
