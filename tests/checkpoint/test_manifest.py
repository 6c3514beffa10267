"""Manifests: built from their parent, written and read back."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rolloutd.checkpoint.format import FormatError
from rolloutd.checkpoint.manifest import (
    FileEntry,
    Manifest,
    SegmentEntry,
    fingerprint_diff,
    next_manifest,
)
from rolloutd.checkpoint.rowids import RowIdSet

SIDECAR = FileEntry("sidecars/x.json", 10, "crc32:00000000")


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
