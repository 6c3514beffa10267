"""Writing a snapshot: its files, each whole and durable under its final name, then its manifest.

:meth:`Writer.publish` makes every file of a manifest durable before the manifest itself (fsync
of files, directories and the manifest, then a rename; on an object store every file is complete
before the manifest is put), so a crash leaves either the new snapshot or none of it. A process
that lost its claim on the store (claim.py) publishes nothing.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Collection, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa

from rolloutd.checkpoint import groups, ledger, partials, segments, submissions
from rolloutd.checkpoint.backends import PARTIALS, SEGMENTS, SIDECARS, file_name, manifest_path
from rolloutd.checkpoint.checksums import ChecksumAlgorithm, Hasher
from rolloutd.checkpoint.claim import StoreClaim
from rolloutd.checkpoint.faults import FaultPoint, fault_point
from rolloutd.checkpoint.format import FORMAT_VERSION
from rolloutd.checkpoint.manifest import (
    FileEntry,
    LedgerEntry,
    Manifest,
    SegmentEntry,
    SubmissionsEntry,
)
from rolloutd.checkpoint.reader import Reader
from rolloutd.checkpoint.rowids import RowIdSet
from rolloutd.checkpoint.rows import Row, SegmentKind, rows_to_batches
from rolloutd.domain.buffer import SealedRows
from rolloutd.domain.group import GroupMeta, Prompt
from rolloutd.domain.partial import PartialSibling


class Writer(Reader):
    """Writes the files of new snapshots and publishes their manifests."""

    claim: StoreClaim
    _checksum: ChecksumAlgorithm

    def write_segment(
        self,
        sequence: int,
        rows: Sequence[Row],
        sealed: Sequence[SealedRows] = (),
        sealed_ids: Collection[int] = (),
    ) -> SegmentEntry:
        """Write ``rows``, and the rows ``sealed_ids`` of ``sealed`` as they were sealed, as a new
        immutable segment of snapshot ``sequence``; not yet published.

        The file is whole and durable under its final name when this returns; until a manifest
        lists it, it is invisible and :meth:`Retention.retire` collects it. Row ids must be unique.
        """
        count = len(rows) + len(sealed_ids)
        if not count:
            raise ValueError("a segment needs at least one row")
        of_sealed = RowIdSet.from_ids(np.fromiter(sealed_ids, dtype=np.int64))
        ids = np.fromiter((row[0] for row in rows), dtype=np.int64, count=len(rows))
        row_ids = RowIdSet.from_ids(ids).union(of_sealed)
        if len(row_ids) != count:
            raise ValueError("row ids of a segment must be unique")
        batches = itertools.chain(rows_to_batches(rows), segments.sealed_batches(sealed, of_sealed))
        entry = self.write_batches(
            file_name(sequence, ".arrow"), batches, FaultPoint.BUFFER_SAVE_MID
        )
        return SegmentEntry(entry, count, row_ids, RowIdSet(), sequence)

    def write_groups(self, sequence: int, metas: Sequence[GroupMeta]) -> SegmentEntry:
        """Write the metadata of changed groups as a new group segment of snapshot ``sequence``;
        like :meth:`write_segment`, durable and unpublished on return."""
        ids = np.fromiter((m.group_id for m in metas), dtype=np.int64, count=len(metas))
        group_ids = RowIdSet.from_ids(ids)
        if not metas or len(group_ids) != len(metas):
            raise ValueError("a group segment needs at least one group, each once")
        entry = self.write_batches(
            file_name(sequence, ".groups.arrow"),
            groups.metas_to_batches(metas),
            FaultPoint.SIDECAR_WRITE_MID,
            SegmentKind.GROUPS,
        )
        return SegmentEntry(entry, len(metas), group_ids, RowIdSet(), sequence)

    def write_batches(
        self,
        name: str,
        batches: Iterator[pa.RecordBatch],
        fault: FaultPoint,
        kind: SegmentKind = SegmentKind.SAMPLES,
    ) -> FileEntry:
        """Write an Arrow IPC segment file ``segments/<name>``, whole and durable on return."""
        path = f"{SEGMENTS}/{name}"
        return segments.write_file(self.backend, path, batches, fault, self._checksum, kind)

    def write_sidecar_json(self, sequence: int, data: bytes) -> FileEntry:
        """Write an already encoded JSON object as the sidecar of snapshot ``sequence``."""
        path = f"{SIDECARS}/{file_name(sequence, '.json')}"
        hasher = Hasher(self._checksum)
        hasher.update(data)
        sink = self.backend.sink(path)
        try:
            half = len(data) // 2
            sink.write(data[:half])
            fault_point(FaultPoint.SIDECAR_WRITE_MID)
            sink.write(data[half:])
            sink.commit()
        except BaseException:
            sink.abort()
            raise
        return FileEntry(path, len(data), hasher.value)

    def write_partials(
        self,
        sequence: int,
        siblings: Sequence[PartialSibling],
        resumed: Mapping[int, partials.ResumedRow],
    ) -> FileEntry:
        """Write the partial siblings and resumed rows of snapshot ``sequence``; not yet
        published."""
        path = f"{PARTIALS}/{file_name(sequence, '.arrow')}"
        return partials.write(self.backend, path, siblings, resumed, self._checksum)

    def write_submissions(
        self, sequence: int, parent: Sequence[SubmissionsEntry], prompts: Sequence[Prompt]
    ) -> tuple[SubmissionsEntry, ...]:
        """See :func:`submissions.extend`."""
        return submissions.extend(self.backend, self._checksum, sequence, parent, prompts)

    def write_ledger(
        self, sequence: int, parent: Sequence[LedgerEntry], finalized: Mapping[str, int]
    ) -> tuple[LedgerEntry, ...]:
        """See :func:`ledger.extend`."""
        return ledger.extend(self.backend, self._checksum, sequence, parent, finalized)

    def publish(self, manifest: Manifest) -> None:
        """Make ``manifest`` the newest snapshot, atomically and durably.

        Its files must have been written by this store; sequences must increase. A process that
        lost its claim on the store publishes nothing (:class:`Fenced`).
        """
        self.claim.check()
        newest = self.sequences()
        if newest and manifest.sequence <= newest[0]:
            raise ValueError(f"sequence {manifest.sequence} is not after {newest[0]}")
        if manifest.format_version != FORMAT_VERSION:
            raise ValueError(f"cannot publish a manifest of format {manifest.format_version}")
        dirs = {os.path.dirname(entry.path) for entry in manifest.files()}
        self.backend.sync_dirs(sorted(dirs))
        self.backend.put(
            manifest_path(manifest.sequence),
            manifest.to_json(),
            before_visible=FaultPoint.COMMIT_BEFORE_RENAME,
            after_visible=FaultPoint.COMMIT_AFTER_RENAME,
            guard=self.claim.check,  # again: the writes above may have stalled past the claim
        )
