"""Submitted prompts in snapshots: each checkpoint writes only the prompts accepted since its
parent, later snapshots list those pieces again, retention keeps exactly what kept snapshots list,
and a damaged piece makes its snapshot fall back like any other damaged file. On a local
directory and on S3 (moto's server)."""

from __future__ import annotations

import io
import itertools
import json
import math
from dataclasses import replace

import pytest

from rolloutd.checkpoint import sidecar, submissions
from rolloutd.checkpoint.backends import SUBMISSIONS, CorruptSnapshot
from rolloutd.checkpoint.checksums import ChecksumAlgorithm
from rolloutd.checkpoint.format import FormatError
from rolloutd.checkpoint.inspect import main as checkpoints
from rolloutd.checkpoint.manifest import Manifest, next_manifest
from rolloutd.domain.errors import FailedPrecondition
from rolloutd.domain.group import Prompt
from rolloutd.domain.report import SizePart
from rolloutd.domain.sampler import Admission
from tests.checkpoint.helpers import Location, StoreNode, publish_earlier_layout
from tests.controllers import fetch
from tests.fakes import settle

DATASET = [Prompt(f"p{i}", f"question {i}") for i in range(4)]


def prompt(i: int) -> Prompt:
    return Prompt(f"s{i}", f"submitted prompt number {i}", metadata={"answer": i})


class Node(StoreNode):
    def __init__(self, location: Location, *, keep_latest: int = 2) -> None:
        super().__init__(
            location, DATASET, max_in_flight=2, buffer_capacity=4, keep_latest=keep_latest
        )

    async def submit(self, start: int, stop: int) -> tuple[int, int]:
        return await self.controller.submit(
            [Admission(prompt(i), None) for i in range(start, stop)]
        )

    def written_submission_bytes(self, sequence: int) -> int:
        """Bytes of the pieces snapshot ``sequence`` wrote, as the store holds them."""
        manifest = self.store.load(sequence)
        return sum(
            self.store.backend.size(p.file.path)
            for p in manifest.submissions
            if p.written_by == sequence
        )


@pytest.fixture
async def node(location):
    made: list[Node] = []

    def make(**kw) -> Node:
        made.append(Node(location, **kw))
        return made[-1]

    yield make
    for n in made:
        await n.controller.stop()


async def test_a_checkpoint_writes_only_the_prompts_submitted_since_its_parent(node):
    a = node()
    assert await a.submit(0, 1000) == (1000, 0)
    first = await a.checkpoint()
    big = a.written_submission_bytes(first.sequence)
    assert await a.submit(1000, 1010) == (10, 0)
    second = await a.checkpoint()
    small = a.written_submission_bytes(second.sequence)
    third = await a.checkpoint()  # nothing submitted since
    assert first.size_bytes[SizePart.SUBMISSIONS] == big > 0
    assert second.size_bytes[SizePart.SUBMISSIONS] == small > 0
    assert third.size_bytes[SizePart.SUBMISSIONS] == a.written_submission_bytes(third.sequence) == 0
    # 10 prompts against 1,000 of the same shape: about a hundredth, never a rewrite of all
    assert small * 50 < big
    # the sidecar keeps the count, not the prompts, so it does not grow with them
    sidecar = a.location.read(a.store.load(second.sequence).sidecar.path)
    assert b"submitted prompt number" not in sidecar
    assert json.loads(sidecar)["sampler"]["submitted_len"] == 1010
    newest = a.store.load(third.sequence)
    assert [(p.first, p.count) for p in newest.submissions] == [(0, 1000), (1000, 10)]
    assert newest.submitted == 1010


async def test_restore_rebuilds_the_queue_and_idempotency_from_pieces_and_journal(node):
    a = node()
    await a.submit(0, 6)
    a.controller.start()
    # submitted prompts go first: the first admissions take some of them
    await settle(lambda: a.controller.status().buffer.committed >= 2)
    await a.checkpoint()
    await a.submit(6, 9)  # journaled only: no snapshot holds them
    await a.controller.stop()

    b = node()
    await b.restore()
    # prompts admitted before the snapshot, queued in it, and journaled after it
    assert await b.submit(0, 9) == (0, 9)
    with pytest.raises(FailedPrecondition, match="'s0' was submitted before with another text"):
        await b.controller.submit([Admission(Prompt("s0", "not the same text"), None)])
    b.controller.start()
    delivered = []
    while (leased := await fetch(b.controller, 4, 300, "t")) is not None:
        delivered += [g.meta.prompt.prompt_id for g in leased[1]]
        await b.controller.ack(leased[0].lease_id, 1)
    # each once: those the snapshot held as groups, queued, or that only the journal had
    submitted = sorted(d for d in delivered if d.startswith("s"))
    assert submitted == sorted(f"s{i}" for i in range(9))


async def test_pieces_stay_few_and_restore_reads_them_in_order(node):
    a = node(keep_latest=1)
    total = 0
    for round_ in range(40):
        step = 1 + round_ % 7
        await a.submit(total, total + step)
        total += step
        await a.checkpoint()
    manifest = a.store.load(a.store.sequences()[0])
    # sizes fall geometrically from the oldest piece: O(log n) pieces
    assert len(manifest.submissions) <= 2 * math.log2(total) + 1
    sizes = [p.file.size for p in manifest.submissions]
    assert all(older > 2 * newer for older, newer in itertools.pairwise(sizes))
    assert submissions.read(a.store.backend, manifest.submissions) == [
        prompt(i) for i in range(total)
    ]
    # retention deleted every piece that the one kept snapshot does not list
    listed = {p.file.path.rsplit("/", 1)[1] for p in manifest.submissions}
    assert set(a.location.listdir(SUBMISSIONS)) == listed

    b = node()
    await b.restore()
    assert b.controller.rooms.sampler.pending == total
    assert await b.submit(0, total) == (0, total)


async def test_retention_keeps_the_pieces_kept_snapshots_list_and_nothing_else(node):
    a = node(keep_latest=2)
    for start in range(0, 50, 10):
        await a.submit(start, start + 10)
        await a.checkpoint()
    kept = [a.store.load(s) for s in a.store.sequences()]
    assert len(kept) == 2
    listed = {p.file.path.rsplit("/", 1)[1] for m in kept for p in m.submissions}
    assert set(a.location.listdir(SUBMISSIONS)) == listed  # no leak
    out = io.StringIO()
    assert checkpoints(["verify", "--dir", a.location.url, *_options(a.location)], out) == 0, (
        out.getvalue()
    )  # no dangling reference: every listed piece is there and verifies


@pytest.mark.parametrize("damage", ["flip", "delete"])
async def test_a_damaged_piece_skips_its_snapshot_and_restore_falls_back(node, damage):
    a = node(keep_latest=3)
    await a.submit(0, 20)
    older = await a.checkpoint()
    await a.submit(20, 25)
    newer = await a.checkpoint()
    await a.submit(25, 27)  # journaled after the newest snapshot
    await a.controller.stop()
    piece = next(
        p for p in a.store.load(newer.sequence).submissions if p.written_by == newer.sequence
    )
    if damage == "flip":
        data = bytearray(a.location.read(piece.file.path))
        data[len(data) // 2] ^= 0x20
        a.location.write(piece.file.path, bytes(data))
    else:
        a.location.fs().rm(a.location.full(piece.file.path))

    out = io.StringIO()
    assert checkpoints(["verify", "--dir", a.location.url, *_options(a.location)], out) == 1
    assert piece.file.path in out.getvalue()
    out = io.StringIO()
    checkpoints(["list", "--json", "--dir", a.location.url, *_options(a.location)], out)
    status = {r["sequence"]: r["status"] for r in json.loads(out.getvalue())}
    # list compares sizes only: a missing piece shows, a flipped byte needs verify
    assert status == {
        newer.sequence: "damaged" if damage == "delete" else "unverified",
        older.sequence: "unverified",
    }
    out = io.StringIO()
    checkpoints(["show", str(newer.sequence), "--dir", a.location.url, *_options(a.location)], out)
    shown = json.loads(out.getvalue())["submissions"]
    assert [(p["first"], p["count"], p["path"]) for p in shown][-1] == (20, 5, piece.file.path)

    b = node()
    report = await b.restore()
    assert report.sequence == older.sequence
    assert [s.sequence for s in report.skipped] == [newer.sequence]
    assert piece.file.path in report.skipped[0].reason
    # the fallback plus the journal still holds every accepted prompt, once
    assert b.controller.rooms.sampler.pending == 27
    assert await b.submit(0, 27) == (0, 27)


async def test_a_piece_that_is_not_what_its_manifest_says_is_corrupt(tmp_path):
    store = Location(str(tmp_path / "store")).open()
    (piece,) = submissions.extend(
        store.backend, ChecksumAlgorithm.CRC32, 1, (), [prompt(0), prompt(1)]
    )
    data = store.backend.read(piece.file.path).to_pybytes()
    assert submissions.decode(data, piece) == [prompt(0), prompt(1)]
    with pytest.raises(CorruptSnapshot, match="2 prompts, manifest says 3"):
        submissions.decode(data, replace(piece, count=3))
    with pytest.raises(CorruptSnapshot, match="not a submissions piece"):
        submissions.decode(data[:-5] + b"\n", piece)


def _options(location: Location) -> list[str]:
    return [f"--storage-option={k}={json.dumps(v)}" for k, v in location.options.items()]


async def test_a_snapshot_of_the_earlier_layout_restores_and_moves_its_prompts_to_a_piece(node):
    """A sidecar written before pieces existed holds every submitted prompt itself."""
    a = node(keep_latest=3)
    await a.submit(0, 7)
    old = await a.checkpoint()

    def with_prompts(data):
        del data["sampler"]["submitted_len"]
        data["sampler"]["submitted"] = [sidecar.to_json(prompt(i)) for i in range(7)]

    legacy = publish_earlier_layout(a, old.sequence, with_prompts, submissions=())
    await a.controller.stop()

    b = node(keep_latest=3)
    report = await b.restore()
    assert report.sequence == legacy.sequence and report.skipped == []
    assert b.controller.rooms.sampler.pending == 7
    assert await b.submit(0, 8) == (1, 7)
    moved = await b.checkpoint()
    assert [(p.first, p.count) for p in b.store.load(moved.sequence).submissions] == [(0, 8)]


def test_a_manifest_lists_its_pieces_and_refuses_a_gap(tmp_path):
    store = Location(str(tmp_path / "store")).open()
    one = submissions.extend(store.backend, ChecksumAlgorithm.CRC32, 1, (), [prompt(0)] * 40)
    two = submissions.extend(store.backend, ChecksumAlgorithm.CRC32, 2, one, [prompt(1)])
    assert [(p.first, p.count, p.written_by) for p in two] == [(0, 40, 1), (40, 1, 2)]
    sidecar_entry = store.write_sidecar_json(2, b"{}")
    manifest = next_manifest(
        None, sequence=2, created_at=0.0, sidecar=sidecar_entry, submissions=two
    )
    again = Manifest.from_json(manifest.to_json())
    assert again.submissions == two and again.submitted == 41
    assert set(manifest.files()) == {sidecar_entry, two[0].file, two[1].file}
    gap = replace(manifest, submissions=(two[0], replace(two[1], first=41)))
    with pytest.raises(FormatError, match="not contiguous"):
        Manifest.from_json(gap.to_json())
