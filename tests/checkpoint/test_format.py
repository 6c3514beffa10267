"""Sample rows to Arrow and back, row-id sets, checksums, manifests."""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from array import array
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pytest
from zlib_ng import zlib_ng

from rolloutd.checkpoint.format import (
    ARRIVAL_STEP,
    SAMPLE_SCHEMA,
    Arrival,
    ChecksumAlgorithm,
    FileEntry,
    FormatError,
    Hasher,
    Manifest,
    RowIdSet,
    SegmentEntry,
    arrival_for,
    checksum_of,
    checksum_parts,
    checksum_started,
    fingerprint_diff,
    next_manifest,
    rows_to_batches,
    rows_to_table,
    sorted_unique,
    table_to_rows,
)
from tests.checkpoint.helpers import make_rows

SIDECAR = FileEntry("sidecars/x.json", 10, "crc32:00000000")


def test_rows_round_trip_exactly():
    rows = make_rows(0, 200)
    table = rows_to_table(rows)
    assert table.schema == SAMPLE_SCHEMA
    assert table.num_rows == 200
    back = table_to_rows(table)
    assert back == rows
    for (_, _, sample), (_, _, original) in zip(back, rows, strict=True):
        assert sample.token_ids.typecode == "i" and sample.logprobs.typecode == "f"
        assert sample.prompt_token_ids.typecode == "i"
        assert sample.token_ids is not original.token_ids


def test_columns_hold_the_sample_values():
    rows = make_rows(10, 5)
    table = rows_to_table(rows)
    assert table.column("row_id").to_pylist() == [r[0] for r in rows]
    assert table.column("group_id").to_pylist() == [r[1] for r in rows]
    assert table.column("token_ids").to_pylist() == [list(r[2].token_ids) for r in rows]
    expected = np.concatenate([np.frombuffer(r[2].logprobs, np.float32) for r in rows])
    assert np.array_equal(table.column("logprobs").combine_chunks().values.to_numpy(), expected)
    assert table.column("text").to_pylist() == [r[2].text for r in rows]


def test_batches_are_bounded_by_rows_and_values():
    rows = make_rows(0, 100, max_tokens=40)
    by_rows = list(rows_to_batches(rows, batch_rows=16))
    assert [b.num_rows for b in by_rows] == [16] * 6 + [4]
    by_values = list(rows_to_batches(rows, batch_values=100))

    def values(batch):
        names = ("token_ids", "logprobs", "prompt_token_ids")
        return sum(len(batch.column(name).values) for name in names)

    assert all(values(b) <= 100 or b.num_rows == 1 for b in by_values)
    assert sum(b.num_rows for b in by_values) == 100
    assert table_to_rows(pa.Table.from_batches(by_values)) == rows
    assert [b.num_rows for b in rows_to_batches(rows, batch_values=1)] == [1] * 100


def test_sliced_and_combined_tables_decode():
    rows = make_rows(0, 50)
    table = rows_to_table(rows, batch_rows=7)
    assert table_to_rows(table.slice(5, 30)) == rows[5:35]
    assert table_to_rows(table.combine_chunks()) == rows


def test_empty_lists_and_no_rows():
    rows = make_rows(0, 30)
    empty = [r for r in rows if len(r[2].token_ids) == 0]
    assert empty, "the fixture should include a sample without tokens"
    assert table_to_rows(rows_to_table(empty)) == empty
    assert rows_to_table([]).num_rows == 0


def test_segment_file_opens_with_plain_pyarrow(tmp_path):
    rows = make_rows(0, 20)
    path = tmp_path / "seg.arrow"
    with pa.ipc.new_file(str(path), SAMPLE_SCHEMA) as writer:
        for batch in rows_to_batches(rows):
            writer.write_batch(batch)
    table = pa.ipc.open_file(str(path)).read_all()
    assert table.column("row_id").to_pylist() == list(range(20))


@pytest.mark.parametrize("n", [0, 1, 2, 3, 1000])
def test_sorted_unique_is_numpys_unique(n):
    ids = np.random.default_rng(n).integers(-5, 40, n)
    assert sorted_unique(ids).tolist() == np.unique(ids).tolist()


def test_row_id_set_ranges_and_membership():
    ids = RowIdSet.from_ids([5, 3, 4, 10, 11, 20, 4])
    assert ids.ranges == ((3, 6), (10, 12), (20, 21))
    assert len(ids) == 6
    assert ids.mask([2, 3, 5, 6, 11, 12, 20]).tolist() == [0, 1, 1, 0, 1, 0, 1]
    assert ids.ids().tolist() == [3, 4, 5, 10, 11, 20]
    assert ids.union(RowIdSet.from_ids([6, 7, 12])).ranges == ((3, 8), (10, 13), (20, 21))
    assert RowIdSet.from_json(ids.to_json()) == ids
    assert not RowIdSet.from_ids([])
    with pytest.raises(FormatError):
        RowIdSet(((5, 6), (6, 7)))


def test_checksums_name_their_algorithm():
    assert checksum_of(b"rolloutd") == f"crc32:{zlib.crc32(b'rolloutd'):08x}"
    sha = checksum_of(b"", ChecksumAlgorithm.SHA256)
    assert sha == "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    with pytest.raises(FormatError):
        FileEntry.from_json({"path": "x", "size": 1, "checksum": "md4:00"})


def _segment(sequence: int, ids: list[int]) -> SegmentEntry:
    entry = FileEntry(f"segments/{sequence}.arrow", 100 * len(ids), "crc32:00000001")
    return SegmentEntry(entry, len(ids), RowIdSet.from_ids(ids), RowIdSet(), sequence)


def test_next_manifest_maps_removed_rows_to_their_segments():
    first = next_manifest(
        None, sequence=1, created_at=1.0, sidecar=SIDECAR, new_segment=_segment(1, [0, 1, 2, 3])
    )
    second = next_manifest(
        first,
        sequence=2,
        created_at=2.0,
        sidecar=SIDECAR,
        new_segment=_segment(2, [4, 5, 6]),
        removed=[1, 5, 99],  # 99 was never snapshotted
        acks_through=7,
    )
    assert second.parent == 1
    assert [s.removed.ids().tolist() for s in second.segments] == [[1], [5]]
    assert second.new_rows == 3 and second.removed_rows == 2 and second.live_rows == 5
    third = next_manifest(second, sequence=3, created_at=3.0, sidecar=SIDECAR, removed=[0, 2, 3])
    assert [s.file.path for s in third.segments] == ["segments/2.arrow"]
    assert third.removed_rows == 3 and third.written_bytes == SIDECAR.size
    with pytest.raises(ValueError, match="not after its parent"):
        next_manifest(third, sequence=3, created_at=4.0, sidecar=SIDECAR)
    with pytest.raises(ValueError, match="repeats row ids"):
        next_manifest(
            third, sequence=4, created_at=4.0, sidecar=SIDECAR, new_segment=_segment(4, [6])
        )


def test_manifest_json_round_trip_and_self_check():
    manifest = next_manifest(
        None,
        sequence=12,
        created_at=1712345678.25,
        sidecar=SIDECAR,
        new_segment=_segment(12, [0, 1, 2]),
        removed=[1],
        acks_through=3,
        tag="step-40",
        trainer_step=40,
        fingerprint={"model": "tiny", "group_size": 4},
    )
    data = manifest.to_json()
    assert Manifest.from_json(data) == manifest
    body = json.loads(data)
    assert body["rows"] == {"new": 3, "removed": 1, "live": 2}
    assert body["segments"][0]["removed"] == [[1, 2]]
    body["tag"] = "step-41"
    with pytest.raises(FormatError, match="checksum"):
        Manifest.from_json(json.dumps(body).encode())
    with pytest.raises(FormatError):
        Manifest.from_json(data[: len(data) // 2])
    newer = dataclasses.replace(manifest, format_version=99).to_json()
    with pytest.raises(FormatError, match="newer"):
        Manifest.from_json(newer)


def test_fingerprint_diff_names_keys():
    assert fingerprint_diff({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 0}) == ["b", "c"]
    assert fingerprint_diff({"a": 1}, {"a": 1}) == []


def test_samples_share_no_memory_with_the_table():
    rows = make_rows(0, 3, max_tokens=5)
    rows = [(0, 0, dataclasses.replace(rows[0][2], token_ids=array("i", [1, 2, 3])))]
    back = table_to_rows(rows_to_table(rows))
    back[0][2].token_ids[0] = 9
    assert rows[0][2].token_ids[0] == 1


def test_a_checksum_in_parts_is_the_checksum_of_the_whole():
    data = memoryview(os.urandom(100_003))
    with ThreadPoolExecutor(3) as pool:
        for parts in (1, 2, 3, 7):
            assert checksum_parts(data, ChecksumAlgorithm.CRC32, parts, pool) == checksum_of(data)
        sha = checksum_parts(data, ChecksumAlgorithm.SHA256, 3, pool)
        assert sha == checksum_of(data, ChecksumAlgorithm.SHA256)
        flipped = bytearray(data)
        flipped[-1] ^= 1  # a bit flipped in the last part changes the combined value
        assert checksum_parts(memoryview(flipped), ChecksumAlgorithm.CRC32, 3, pool) != (
            checksum_of(data)
        )
    assert zlib_ng.crc32_combine(zlib.crc32(b"ab"), zlib.crc32(b"cde"), 3) == zlib.crc32(b"abcde")


def test_arrival_is_the_prefix_every_part_before_has_finished():
    data = memoryview(os.urandom(3 * ARRIVAL_STEP + 5))
    with ThreadPoolExecutor(3) as pool:
        for parts in (1, 3):
            arrival = arrival_for(len(data), ChecksumAlgorithm.CRC32, parts)
            result = checksum_started(data, ChecksumAlgorithm.CRC32, parts, pool, arrival)
            arrival.wait(len(data) + 1)  # beyond the end: returns once all of it arrived
            assert arrival.through() == len(data)
            assert result() == checksum_of(data)
    arrival = Arrival([10, 10, 10])
    arrival.advance(1, 10)  # a later part done first does not count
    assert arrival.through() == 0
    arrival.advance(0, 10)
    arrival.advance(2, 4)
    assert arrival.through() == 24


def test_a_waiter_wakes_when_the_part_it_needs_arrives():
    arrival = Arrival([100])
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(arrival.wait, 60)
        arrival.advance(0, 30)
        assert not waiting.done()  # 30 of the 60 bytes it waits for
        arrival.advance(0, 60)
        waiting.result(timeout=30)


def test_a_failing_checksum_still_reports_its_part_done(monkeypatch):
    def fail(self: Hasher, data: memoryview) -> None:
        raise OSError("read failed")

    monkeypatch.setattr(Hasher, "update", fail)
    data = memoryview(os.urandom(2 * ARRIVAL_STEP))
    arrival = arrival_for(len(data), ChecksumAlgorithm.CRC32, 2)
    with ThreadPoolExecutor(2) as pool:
        result = checksum_started(data, ChecksumAlgorithm.CRC32, 2, pool, arrival)
        arrival.wait(len(data))  # would hang if a part that raised never said it was done
        with pytest.raises(OSError, match="read failed"):
            result()
