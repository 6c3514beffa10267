"""Reading a sample segment as its bytes arrive (what a restore does while they verify)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from rolloutd.checkpoint.backends import CorruptSnapshot, LocalBackend
from rolloutd.checkpoint.checksums import Arrival, ChecksumAlgorithm
from rolloutd.checkpoint.faults import FaultPoint
from rolloutd.checkpoint.manifest import SegmentEntry
from rolloutd.checkpoint.rowids import RowIdSet
from rolloutd.checkpoint.rows import rows_to_batches
from rolloutd.checkpoint.segments import KeptRows, read_batches, write_file
from tests.checkpoint.helpers import make_rows

ROWS = make_rows(0, 600, max_tokens=400)


class RecordedArrival(Arrival):
    """An arrival whose whole file is in, recording how far each wait asked for."""

    def __init__(self, size: int) -> None:
        super().__init__([size])
        self.advance(0, size)
        self.asked: list[int] = []

    def wait(self, offset: int) -> None:
        self.asked.append(offset)
        super().wait(offset)


@pytest.fixture
def segment(tmp_path) -> tuple[pa.Buffer, SegmentEntry]:
    backend = LocalBackend(str(tmp_path))
    batches = rows_to_batches(ROWS, batch_rows=50)
    entry = write_file(
        backend, "segments/1-a.arrow", batches, FaultPoint.BUFFER_SAVE_MID, ChecksumAlgorithm.CRC32
    )
    ids = RowIdSet.from_ids(np.array([r[0] for r in ROWS], dtype=np.int64))
    return backend.read(entry.path), SegmentEntry(entry, len(ROWS), ids, RowIdSet(), 1)


def test_batches_are_those_of_the_file_each_read_after_its_bytes_arrived(segment):
    buffer, entry = segment
    arrival = RecordedArrival(buffer.size)
    expected = pa.ipc.open_file(buffer)
    got = []
    for batch in read_batches(buffer, entry, arrival):
        # every byte of the batch lies below what was waited for before it was handed out
        end = max(b.address + b.size for col in batch.columns for b in col.buffers() if b)
        assert end - buffer.address <= max(arrival.asked)
        got.append(batch)
    assert len(got) == expected.num_record_batches == 12
    assert all(b.equals(expected.get_batch(i)) for i, b in enumerate(got))
    assert arrival.asked == sorted(arrival.asked)  # front to back, like the read


def test_nothing_is_read_before_it_arrives(segment):
    buffer, entry = segment
    arrival = Arrival([buffer.size])
    arrival.advance(0, buffer.size // 2)
    assert arrival.through() == buffer.size // 2
    batches = read_batches(buffer, entry, arrival)
    first = next(batches)  # the first batch is within the first half
    assert first.num_rows == 50
    arrival.advance(0, buffer.size)
    assert sum(b.num_rows for b in batches) == len(ROWS) - 50


def test_rows_other_than_the_manifest_lists_do_not_verify(segment):
    buffer, entry = segment
    fewer = SegmentEntry(entry.file, len(ROWS) - 1, entry.row_ids, RowIdSet(), 1)
    with pytest.raises(CorruptSnapshot, match="rows disagree with the manifest"):
        list(read_batches(buffer, fewer, RecordedArrival(buffer.size)))
    others = RowIdSet.from_ids(np.arange(1000, 1000 + len(ROWS), dtype=np.int64))
    shifted = SegmentEntry(entry.file, len(ROWS), others, RowIdSet(), 1)
    with pytest.raises(CorruptSnapshot, match="rows disagree with the manifest"):
        next(read_batches(buffer, shifted, RecordedArrival(buffer.size)))


def test_bytes_that_do_not_decode_raise_corrupt_snapshot(segment):
    buffer, entry = segment
    garbled = bytearray(buffer.to_pybytes())
    garbled[8:16] = b"\x01" * 8  # the schema message's length prefix
    with pytest.raises(CorruptSnapshot, match="not a readable segment"):
        list(read_batches(pa.py_buffer(garbled), entry, RecordedArrival(len(garbled))))


@pytest.mark.parametrize("shuffled", [False, True])
def test_kept_rows_index_each_group_across_batches_in_any_order(shuffled):
    rows = make_rows(0, 230, max_tokens=4)  # groups of 4: batches of 50 split groups
    if shuffled:
        rows = [rows[i] for i in np.random.default_rng(7).permutation(len(rows))]
    removed = {r[0] for r in rows if r[0] % 9 == 0}
    batches = []
    for batch in rows_to_batches(rows, batch_rows=50):
        ids = batch.column("row_id").to_numpy()
        keep = ~np.isin(ids, list(removed))
        batches.append((batch, None if keep.all() else keep))
    kept = KeptRows(iter(batches), len(rows))

    expected: dict[int, dict[int, int]] = {}
    for row_id, group_id, sample in rows:
        if row_id not in removed:
            expected.setdefault(group_id, {})[sample.index] = row_id
    groups = kept.groups()
    assert list(groups) == sorted(expected)
    assert set(groups.keys()) == set(expected)
    assert len(kept) == len(rows) - len(removed)
    by_id = {r[0]: r[2] for r in rows}
    for group_id, siblings in expected.items():
        view = groups[group_id]
        assert view.row_ids() == siblings
        assert list(view) == sorted(siblings)
        assert all(view[i] == by_id[row_id] for i, row_id in siblings.items())
        assert view.tokens() == sum(len(by_id[row_id].token_ids) for row_id in siblings.values())
