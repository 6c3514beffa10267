"""The finalized-lease ledger in snapshots: each checkpoint writes only the leases finalized since
its parent, later snapshots list those pieces again, the bound drops the oldest, restore rebuilds
the newest leases in order, a damaged piece makes its snapshot fall back, and a snapshot whose
sidecar holds the ledger (earlier versions) still restores. On a local directory and on S3."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rolloutd.checkpoint import ledger
from rolloutd.checkpoint.backends import CorruptSnapshot
from rolloutd.checkpoint.checksums import ChecksumAlgorithm
from rolloutd.checkpoint.manifest import Manifest, next_manifest
from rolloutd.domain.group import Prompt
from rolloutd.domain.report import SizePart
from tests.checkpoint.helpers import Location, StoreNode, publish_earlier_layout
from tests.controllers import fetch
from tests.fakes import settle

PROMPTS = [Prompt(f"p{i}", f"question {i}") for i in range(40)]
CRC = ChecksumAlgorithm.CRC32


class Node(StoreNode):
    def __init__(self, location: Location) -> None:
        super().__init__(location, PROMPTS, max_in_flight=3, buffer_capacity=6, keep_latest=3)

    async def finalize(self, step: int) -> str:
        """Fetches one group, acks it at ``step``; returns the lease, now finalized."""
        await settle(lambda: self.controller.status().buffer.committed >= 1)
        lease, _ = await fetch(self.controller, 1, 100, "t")
        await self.controller.ack(lease.lease_id, step)
        await self.controller.finalize(step)
        assert lease.lease_id in self.controller.rooms.ledger.finalized_leases
        return lease.lease_id


@pytest.fixture
async def node(location):
    made: list[Node] = []

    def make() -> Node:
        made.append(Node(location))
        return made[-1]

    yield make
    for n in made:
        await n.controller.stop()


def leases(start: int, stop: int) -> dict[str, int]:
    return {f"lease-{i:06d}": i // 3 for i in range(start, stop)}


async def test_each_snapshot_writes_only_the_leases_finalized_since_its_parent(node):
    a = node()
    a.controller.start()
    first = [await a.finalize(1), await a.finalize(1)]
    one = await a.checkpoint()
    second = [await a.finalize(2)]
    two = await a.checkpoint()
    three = await a.checkpoint()  # nothing finalized since
    pieces = a.store.load(two.sequence).ledger
    assert [(p.count, p.written_by) for p in pieces] in (
        [(2, one.sequence), (1, two.sequence)],
        [(3, two.sequence)],  # merged: the older piece was small enough to absorb
    )
    assert one.size_bytes[SizePart.LEDGER] > 0 and two.size_bytes[SizePart.LEDGER] > 0
    assert three.size_bytes[SizePart.LEDGER] == 0
    assert a.store.load(three.sequence).ledger == pieces
    sidecar = json.loads(a.location.read(a.store.load(two.sequence).sidecar.path))
    assert "finalized_leases" not in sidecar and first[0] not in json.dumps(sidecar)
    await a.controller.stop()

    b = node()
    report = await b.restore()
    assert report.sequence == three.sequence and report.skipped == []
    assert list(b.controller.rooms.ledger.finalized_leases) == first + second
    for lease_id, step in zip(first + second, (1, 1, 2), strict=True):
        assert (await b.controller.ack(lease_id, step)).already_acked  # as before the restart


def test_pieces_stay_few_and_the_bound_keeps_the_newest_leases_in_order(tmp_path):
    store = Location(str(tmp_path / "store")).open()
    bound = 500
    pieces: tuple[ledger.LedgerEntry, ...] = ()
    written = 0
    for sequence in range(1, 201):
        batch = leases(written, written + 7)
        pieces = ledger.extend(store.backend, CRC, sequence, pieces, batch, bound)
        written += len(batch)
        listed = sum(p.count for p in pieces)
        # every listed piece but the oldest is within the bound; the oldest is dropped as soon
        # as the newer ones hold the bound
        assert listed - pieces[0].count < bound
        assert listed >= min(written, bound)
        assert len(pieces) <= 12
        held = ledger.read(store.backend, pieces, bound)
        assert list(held.items()) == list(leases(max(0, written - bound), written).items())
    assert written == 1400


def test_a_merge_is_trimmed_to_the_bound(tmp_path):
    store = Location(str(tmp_path / "store")).open()
    (one,) = ledger.extend(store.backend, CRC, 1, (), leases(0, 50), bound=60)
    (two,) = ledger.extend(store.backend, CRC, 2, (one,), leases(50, 100), bound=60)
    assert (two.count, two.written_by) == (60, 2)  # absorbed the first and kept the newest 60
    assert list(ledger.read(store.backend, (two,), 60)) == list(leases(40, 100))


def test_a_piece_that_is_not_what_its_manifest_says_is_corrupt(tmp_path):
    store = Location(str(tmp_path / "store")).open()
    (piece,) = ledger.extend(store.backend, CRC, 1, (), leases(0, 3))
    data = store.backend.read(piece.file.path).to_pybytes()
    assert ledger.decode(data, piece).num_rows == 3
    with pytest.raises(CorruptSnapshot, match="3 leases, manifest says 4"):
        ledger.decode(data, replace(piece, count=4))
    with pytest.raises(CorruptSnapshot, match="not a ledger piece"):
        ledger.decode(data[: len(data) // 2], piece)


def test_a_manifest_lists_its_ledger_pieces(tmp_path):
    store = Location(str(tmp_path / "store")).open()
    one = ledger.extend(store.backend, CRC, 1, (), leases(0, 4000))
    two = ledger.extend(store.backend, CRC, 2, one, leases(4000, 4001))
    assert [(p.count, p.written_by) for p in two] == [(4000, 1), (1, 2)]
    sidecar_entry = store.write_sidecar_json(2, b"{}")
    manifest = next_manifest(None, sequence=2, created_at=0.0, sidecar=sidecar_entry, ledger=two)
    again = Manifest.from_json(manifest.to_json())
    assert again.ledger == two and again.written_ledger_bytes == two[1].file.size
    assert set(manifest.files()) == {sidecar_entry, two[0].file, two[1].file}
    # a manifest without pieces has no "ledger" key: older readers see what they saw
    assert (
        "ledger"
        not in next_manifest(None, sequence=3, created_at=0.0, sidecar=sidecar_entry)._body()
    )


@pytest.mark.parametrize("damage", ["flip", "delete"])
async def test_a_damaged_piece_skips_its_snapshot_and_restore_falls_back(node, damage):
    a = node()
    a.controller.start()
    older_leases = [await a.finalize(1)]
    older = await a.checkpoint()
    newer_leases = [await a.finalize(2)]
    newer = await a.checkpoint()
    await a.controller.stop()
    piece = next(p for p in a.store.load(newer.sequence).ledger if p.written_by == newer.sequence)
    if damage == "flip":
        a.location.flip_bit(piece.file.path)
    else:
        a.location.fs().rm(a.location.full(piece.file.path))

    b = node()
    report = await b.restore()
    assert report.sequence == older.sequence
    assert [s.sequence for s in report.skipped] == [newer.sequence]
    assert piece.file.path in report.skipped[0].reason
    # the older snapshot's ledger plus the journaled ack: both leases still answer as acked
    assert older_leases[0] in b.controller.rooms.ledger.finalized_leases
    assert (await b.controller.ack(older_leases[0], 1)).already_acked
    assert (await b.controller.ack(newer_leases[0], 2)).already_acked


async def test_a_snapshot_whose_sidecar_holds_the_ledger_restores_and_moves_it_to_a_piece(node):
    """Sidecars written before ledger pieces existed hold the whole ledger themselves."""
    a = node()
    a.controller.start()
    finalized = [await a.finalize(1), await a.finalize(1)]
    old = await a.checkpoint()

    def with_ledger(data):
        data["finalized_leases"] = {lease_id: 1 for lease_id in finalized}

    legacy = publish_earlier_layout(a, old.sequence, with_ledger, ledger=())
    await a.controller.stop()

    b = node()
    report = await b.restore()
    assert report.sequence == legacy.sequence and report.skipped == []
    assert list(b.controller.rooms.ledger.finalized_leases) == finalized
    assert (await b.controller.ack(finalized[0], 1)).already_acked
    b.controller.start()
    later = await b.finalize(2)
    moved = await b.checkpoint()
    (piece,) = b.store.load(moved.sequence).ledger
    assert piece.count == 3
    assert list(ledger.read(b.store.backend, (piece,))) == [*finalized, later]
