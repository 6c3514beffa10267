"""The manifest: what one snapshot holds, and how the next one is built from it.

A snapshot exists exactly when its manifest does. The manifest lists every file of the snapshot
with its size and checksum, the live rows of each segment, and where the journal replay starts.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from rolloutd.checkpoint.checksums import checksum_algorithm, checksum_of
from rolloutd.checkpoint.format import FORMAT_VERSION, FormatError
from rolloutd.checkpoint.rowids import RowIdSet, sorted_unique


@dataclass(frozen=True)
class FileEntry:
    """A file of a snapshot, by path relative to the store root, with its exact size and checksum."""

    path: str
    size: int
    checksum: str

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "checksum": self.checksum}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> FileEntry:
        entry = cls(str(value["path"]), int(value["size"]), str(value["checksum"]))
        checksum_algorithm(entry.checksum)
        return entry


@dataclass(frozen=True)
class SegmentEntry:
    """A segment as listed by one snapshot.

    Invariants: ``removed`` is a subset of ``row_ids``; ``len(row_ids) == rows``; ``written_by`` is
    the sequence of the snapshot that wrote the file (later snapshots list it unchanged but for
    ``removed``). A segment with no live row is dropped from the next manifest.
    """

    file: FileEntry
    rows: int
    row_ids: RowIdSet
    removed: RowIdSet
    written_by: int

    @property
    def live_rows(self) -> int:
        return self.rows - len(self.removed)

    def to_json(self) -> dict[str, Any]:
        return {
            **self.file.to_json(),
            "rows": self.rows,
            "row_ids": self.row_ids.to_json(),
            "removed": self.removed.to_json(),
            "written_by": self.written_by,
        }

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> SegmentEntry:
        return cls(
            file=FileEntry.from_json(value),
            rows=int(value["rows"]),
            row_ids=RowIdSet.from_json(value["row_ids"]),
            removed=RowIdSet.from_json(value["removed"]),
            written_by=int(value["written_by"]),
        )


@dataclass(frozen=True)
class SubmissionsEntry:
    """A piece of the submitted-prompt log (submissions.py) as listed by a snapshot.

    Invariants: the piece holds prompts ``first .. first + count`` of the submitted list, in order;
    a manifest's pieces are contiguous from 0; ``written_by`` is the snapshot that wrote the file
    (later snapshots list it unchanged, until a merge replaces it).
    """

    file: FileEntry
    first: int
    count: int
    written_by: int

    def to_json(self) -> dict[str, Any]:
        return {
            **self.file.to_json(),
            "first": self.first,
            "count": self.count,
            "written_by": self.written_by,
        }

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> SubmissionsEntry:
        return cls(
            file=FileEntry.from_json(value),
            first=int(value["first"]),
            count=int(value["count"]),
            written_by=int(value["written_by"]),
        )


@dataclass(frozen=True)
class LedgerEntry:
    """A piece of the finalized-lease ledger (ledger.py) as listed by a snapshot.

    Invariants: the piece holds ``count`` (lease id, trainer step) pairs in the order they were
    finalized; a manifest's pieces are oldest first; ``written_by`` is the snapshot that wrote the
    file (later snapshots list it unchanged until a merge replaces it or the bound drops it).
    """

    file: FileEntry
    count: int
    written_by: int

    def to_json(self) -> dict[str, Any]:
        return {**self.file.to_json(), "count": self.count, "written_by": self.written_by}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> LedgerEntry:
        return cls(
            file=FileEntry.from_json(value),
            count=int(value["count"]),
            written_by=int(value["written_by"]),
        )


@dataclass(frozen=True)
class Manifest:
    """What one snapshot holds; its publication makes the snapshot exist.

    Invariants: ``sequence`` is strictly increasing in a store and ``parent`` (the snapshot this
    one was built on, or ``None`` for a full snapshot) is smaller; the live rows are the rows of
    ``segments`` minus each segment's ``removed``; ``acks_through`` is the last ack-journal position
    whose effect the sidecar already holds (acks after it are replayed at restore).
    """

    sequence: int
    parent: int | None
    created_at: float
    segments: tuple[SegmentEntry, ...]
    sidecar: FileEntry
    acks_through: int = 0
    tag: str = ""
    trainer_step: int | None = None
    fingerprint: Mapping[str, Any] = field(default_factory=dict)
    new_rows: int = 0
    removed_rows: int = 0
    format_version: int = FORMAT_VERSION
    partials: FileEntry | None = None
    """The snapshot's own partial siblings (checkpoint/partials.py), never inherited."""
    groups: tuple[SegmentEntry, ...] = ()
    """Group segments (format 2; a format-1 sidecar holds every group itself)."""
    submissions: tuple[SubmissionsEntry, ...] = ()
    """Pieces of the submitted-prompt log, oldest first (absent from older manifests)."""
    ledger: tuple[LedgerEntry, ...] = ()
    """Pieces of the finalized-lease ledger, oldest first (absent from older manifests, whose
    sidecar holds the ledger itself)."""

    @property
    def live_rows(self) -> int:
        return sum(segment.live_rows for segment in self.segments)

    @property
    def segment_bytes(self) -> int:
        return sum(segment.file.size for segment in self.segments)

    @property
    def total_bytes(self) -> int:
        return (
            self.segment_bytes
            + sum(g.file.size for g in self.groups)
            + self.sidecar.size
            + self.partials_bytes
            + sum(p.file.size for p in self.submissions)
            + sum(p.file.size for p in self.ledger)
        )

    @property
    def submitted(self) -> int:
        """Prompts the submitted-prompt log of this snapshot holds."""
        return sum(piece.count for piece in self.submissions)

    @property
    def written_submission_bytes(self) -> int:
        """Bytes of submitted-prompt pieces this snapshot wrote itself (new or merged)."""
        return sum(p.file.size for p in self.submissions if p.written_by == self.sequence)

    @property
    def written_ledger_bytes(self) -> int:
        """Bytes of ledger pieces this snapshot wrote itself (new or merged)."""
        return sum(p.file.size for p in self.ledger if p.written_by == self.sequence)

    @property
    def partials_bytes(self) -> int:
        return self.partials.size if self.partials is not None else 0

    @property
    def written_bytes(self) -> int:
        """Bytes this snapshot wrote itself (new or compacted segments of both kinds, its
        sidecar, its partials file and new or merged submitted-prompt and ledger pieces)."""
        return (
            self.written_segment_bytes
            + self.written_group_bytes
            + self.sidecar.size
            + self.partials_bytes
            + self.written_submission_bytes
            + self.written_ledger_bytes
        )

    @property
    def written_segment_bytes(self) -> int:
        return sum(s.file.size for s in self.segments if s.written_by == self.sequence)

    @property
    def written_group_bytes(self) -> int:
        return sum(s.file.size for s in self.groups if s.written_by == self.sequence)

    def files(self) -> tuple[FileEntry, ...]:
        return (
            *(segment.file for segment in self.segments),
            *(segment.file for segment in self.groups),
            self.sidecar,
            *((self.partials,) if self.partials is not None else ()),
            *(piece.file for piece in self.submissions),
            *(piece.file for piece in self.ledger),
        )

    def _body(self) -> dict[str, Any]:
        body = {
            "format_version": self.format_version,
            "sequence": self.sequence,
            "parent": self.parent,
            "created_at": self.created_at,
            "tag": self.tag,
            "trainer_step": self.trainer_step,
            "fingerprint": dict(self.fingerprint),
            "acks_through": self.acks_through,
            "rows": {"new": self.new_rows, "removed": self.removed_rows, "live": self.live_rows},
            "segments": [segment.to_json() for segment in self.segments],
            "groups": [segment.to_json() for segment in self.groups],
            "sidecar": self.sidecar.to_json(),
            # only when there are any: manifests without submissions stay as they were
            **(
                {"submissions": [p.to_json() for p in self.submissions]} if self.submissions else {}
            ),
            **({"ledger": [p.to_json() for p in self.ledger]} if self.ledger else {}),
        }
        if self.partials is not None:  # absent otherwise: older readers see the same manifest
            body["partials"] = self.partials.to_json()
        return body

    def to_dict(self) -> dict[str, Any]:
        """The JSON document, with a CRC-32 of its own canonical form under ``checksum``."""
        body = self._body()
        body["checksum"] = checksum_of(_canonical(body))
        return body

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        try:
            body = json.loads(data)
            checksum = body.pop("checksum")
            if checksum != checksum_of(_canonical(body)):
                raise FormatError("manifest checksum mismatch")
            if body["format_version"] > FORMAT_VERSION:
                raise FormatError(
                    f"manifest format {body['format_version']} is newer than {FORMAT_VERSION}"
                )
            manifest = cls(
                sequence=int(body["sequence"]),
                parent=body["parent"],
                created_at=float(body["created_at"]),
                segments=tuple(SegmentEntry.from_json(s) for s in body["segments"]),
                sidecar=FileEntry.from_json(body["sidecar"]),
                acks_through=int(body["acks_through"]),
                tag=str(body["tag"]),
                trainer_step=body["trainer_step"],
                fingerprint=body["fingerprint"],
                new_rows=int(body["rows"]["new"]),
                removed_rows=int(body["rows"]["removed"]),
                format_version=int(body["format_version"]),
                partials=FileEntry.from_json(body["partials"]) if "partials" in body else None,
                groups=tuple(SegmentEntry.from_json(s) for s in body.get("groups", ())),
                submissions=tuple(
                    SubmissionsEntry.from_json(p) for p in body.get("submissions", [])
                ),
                ledger=tuple(LedgerEntry.from_json(p) for p in body.get("ledger", [])),
            )
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise FormatError(f"manifest is not valid: {exc!r}") from exc
        if manifest.live_rows != body["rows"]["live"]:
            raise FormatError("manifest live row count disagrees with its segments")
        firsts = itertools.accumulate((p.count for p in manifest.submissions), initial=0)
        if any(p.first != first for p, first in zip(manifest.submissions, firsts, strict=False)):
            raise FormatError("manifest submission pieces are not contiguous from 0")
        return manifest


def _canonical(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _without(
    segments: Sequence[SegmentEntry], removed: npt.ArrayLike
) -> tuple[list[SegmentEntry], int]:
    """``segments`` with ``removed`` ids marked removed (ids none holds are ignored) and the
    segments left without a live row dropped; and how many live rows were removed."""
    removed_ids = sorted_unique(removed)
    count = 0
    updated: list[SegmentEntry] = []
    for segment in segments:
        hit = removed_ids[segment.row_ids.mask(removed_ids)]
        if hit.size:
            gone = segment.removed.union(RowIdSet.from_ids(hit))
            count += len(gone) - len(segment.removed)
            segment = replace(segment, removed=gone)
        if segment.live_rows > 0:
            updated.append(segment)
    return updated, count


def next_manifest(
    parent: Manifest | None,
    *,
    sequence: int,
    created_at: float,
    sidecar: FileEntry,
    new_segment: SegmentEntry | None = None,
    removed: npt.ArrayLike = (),
    new_groups: SegmentEntry | None = None,
    changed_groups: npt.ArrayLike = (),
    acks_through: int = 0,
    tag: str = "",
    trainer_step: int | None = None,
    fingerprint: Mapping[str, Any] | None = None,
    submissions: Sequence[SubmissionsEntry] | None = None,
    ledger: Sequence[LedgerEntry] | None = None,
) -> Manifest:
    """The manifest of snapshot ``sequence``: ``parent``'s live rows, minus ``removed``, plus new.

    ``removed`` holds the ids of rows removed since ``parent``; ids that no listed segment holds
    (rows staged and removed between two snapshots, or removed before) are ignored. Segments left
    without a live row are dropped. ``parent=None`` makes a full snapshot of ``new_segment`` alone.
    Group segments go the same way: ``changed_groups`` (changed or dropped since ``parent``) are
    removed from the segments that held them, then ``new_groups`` (their new metadata) is added.
    ``submissions`` lists the submitted-prompt pieces, ``ledger`` the finalized-lease pieces
    (default: the parent's).
    """
    if parent is not None and sequence <= parent.sequence:
        raise ValueError(f"sequence {sequence} is not after its parent {parent.sequence}")
    segments = list(parent.segments) if parent is not None else []
    if new_segment is not None:
        if new_segment.written_by != sequence:
            raise ValueError(
                f"new segment was written for {new_segment.written_by}, not {sequence}"
            )
        held = [s for s in segments if s.row_ids.mask(new_segment.row_ids.ids()).any()]
        if held:
            raise ValueError(f"new segment repeats row ids of {held[0].file.path}")
        segments.append(new_segment)
    updated, removed_rows = _without(segments, removed)
    groups, _ = _without(parent.groups if parent is not None else (), changed_groups)
    if new_groups is not None:
        if new_groups.written_by != sequence:
            raise ValueError(f"new groups were written for {new_groups.written_by}, not {sequence}")
        stale = RowIdSet.from_ids(np.asarray(changed_groups, dtype=np.int64))
        if not stale.mask(new_groups.row_ids.ids()).all():
            raise ValueError("new group segment holds groups not listed as changed")
        groups.append(new_groups)
    return Manifest(
        sequence=sequence,
        parent=parent.sequence if parent is not None else None,
        created_at=created_at,
        segments=tuple(updated),
        sidecar=sidecar,
        acks_through=acks_through,
        tag=tag,
        trainer_step=trainer_step,
        fingerprint=dict(fingerprint or {}),
        new_rows=new_segment.rows if new_segment is not None else 0,
        removed_rows=removed_rows,
        groups=tuple(groups),
        submissions=tuple(
            submissions
            if submissions is not None
            else (parent.submissions if parent is not None else ())
        ),
        ledger=tuple(
            ledger if ledger is not None else (parent.ledger if parent is not None else ())
        ),
    )


def fingerprint_diff(expected: Mapping[str, Any], found: Mapping[str, Any]) -> list[str]:
    """Keys whose values differ (or exist on one side only), sorted: what a refusal names."""
    return sorted(k for k in expected.keys() | found.keys() if expected.get(k) != found.get(k))
