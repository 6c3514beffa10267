"""Retention and compaction: what keeps a store's size and its restore cost bounded.

* :meth:`Retention.retire` keeps the newest snapshots and those a predicate selects
  (:func:`keep_tagged`);
  retired manifests are moved to ``trash/`` first, so a snapshot disappears whole, never
  half-deleted in place. Files no kept manifest lists are deleted, the ack journal pruned.
* :meth:`Retention.compact` merges segments (those :func:`plan_compaction` picks) into one
  without removed rows, so restore reads a bounded number of segments.

Neither runs concurrently with writes of the next snapshot: the checkpointer runs them in order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa

from rolloutd.checkpoint import groups
from rolloutd.checkpoint.backends import (
    LEDGER,
    MANIFESTS,
    PARTIALS,
    SEGMENTS,
    SIDECARS,
    SUBMISSIONS,
    TMP,
    TRASH,
    CorruptSnapshot,
    file_name,
    manifest_path,
    sequence_of,
)
from rolloutd.checkpoint.faults import FaultPoint, fault_point
from rolloutd.checkpoint.journal import Journal
from rolloutd.checkpoint.manifest import Manifest, SegmentEntry
from rolloutd.checkpoint.rowids import RowIdSet
from rolloutd.checkpoint.rows import SegmentKind
from rolloutd.checkpoint.writer import Writer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetireResult:
    """Sequences kept and retired (newest first), files deleted, journal pruned up to where."""

    kept: tuple[int, ...]
    retired: tuple[int, ...]
    deleted_files: int
    pruned_acks_through: int | None


def keep_tagged(min_trainer_step: int | None = None) -> Callable[[Manifest], bool]:
    """Retention predicate: tagged snapshots, only those of ``min_trainer_step`` or later if set."""

    def keep(manifest: Manifest) -> bool:
        if not manifest.tag:
            return False
        step = manifest.trainer_step
        return min_trainer_step is None or (step is not None and step >= min_trainer_step)

    return keep


def plan_compaction(
    manifest: Manifest, max_segments: int, kind: SegmentKind = SegmentKind.SAMPLES
) -> tuple[SegmentEntry, ...]:
    """Segments to merge so that at most ``max_segments // 2`` remain; empty when within bounds.

    The smallest by live bytes are chosen, so one compaction rewrites the least data and the
    large, mostly live segments are left alone (size-tiered compaction). Sample and group
    segments are planned separately (``kind``).
    """
    segments = _listed(manifest, kind)
    if len(segments) <= max_segments:
        return ()
    count = len(segments) - max(max_segments // 2, 1) + 1
    ranked = sorted(segments, key=lambda s: s.file.size * s.live_rows / s.rows)
    return tuple(ranked[:count])


def _listed(manifest: Manifest, kind: SegmentKind) -> tuple[SegmentEntry, ...]:
    return manifest.segments if kind is SegmentKind.SAMPLES else manifest.groups


class Retention(Writer):
    """Retires old snapshots and compacts segments: the store's size and restore cost stay
    bounded. Neither runs concurrently with writes of the next snapshot."""

    journal: Journal

    def compact(
        self,
        manifest: Manifest,
        segments: Sequence[SegmentEntry] | None = None,
        kind: SegmentKind = SegmentKind.SAMPLES,
    ) -> Manifest:
        """``manifest`` with ``segments`` (default: all of ``kind``) merged into one without
        removed rows. Group segments of format 2 (JSON per group) are rewritten as typed columns.

        The merged segment is written for ``manifest.sequence``; the returned manifest is not
        published. Sources are read back from the store and verified (:class:`CorruptSnapshot`
        when one does not), one at a time, so memory stays bounded by the largest segment.
        """
        present = _listed(manifest, kind)
        listed = present if segments is None else segments
        paths = {s.file.path for s in listed}
        if not paths <= {s.file.path for s in present}:
            raise ValueError("can only compact segments the manifest lists")
        chosen = [s for s in present if s.file.path in paths]  # keeps row order
        if not chosen:
            return manifest
        kept_ids: list[np.ndarray] = []

        def live_batches() -> Iterator[pa.RecordBatch]:
            for segment in chosen:
                try:
                    reader = self.open_segment(segment, kind)
                except CorruptSnapshot as exc:
                    raise CorruptSnapshot(manifest.sequence, exc.problems) from exc
                for i in range(reader.num_record_batches):
                    batch = reader.get_batch(i)
                    ids = batch.column(kind.id_column).to_numpy()
                    if segment.removed:
                        keep = ~segment.removed.mask(ids)
                        batch, ids = batch.filter(pa.array(keep)), ids[keep]
                    if batch.num_rows:
                        kept_ids.append(ids)
                        if kind is SegmentKind.GROUPS and groups.is_legacy(batch.schema):
                            yield from groups.metas_to_batches(groups.batch_to_metas(batch))
                        else:
                            yield batch

        suffix = ".arrow" if kind is SegmentKind.SAMPLES else ".groups.arrow"
        name = file_name(manifest.sequence, suffix)
        entry = self.write_batches(name, live_batches(), FaultPoint.COMPACT_MID, kind)
        ids = np.concatenate(kept_ids) if kept_ids else np.zeros(0, np.int64)
        merged = SegmentEntry(
            entry, int(ids.size), RowIdSet.from_ids(ids), RowIdSet(), manifest.sequence
        )
        at = min(i for i, s in enumerate(present) if s.file.path in paths)
        rest = [s for s in present if s.file.path not in paths]
        new = tuple(rest[:at] + ([merged] if merged.rows else []) + rest[at:])
        if kind is SegmentKind.SAMPLES:
            return replace(manifest, segments=new)
        return replace(manifest, groups=new)

    def retire(
        self, keep_latest: int, keep: Callable[[Manifest], bool] | None = None
    ) -> RetireResult:
        """Keep the newest ``keep_latest`` readable snapshots and those ``keep`` selects.

        Retired manifests are moved to ``trash/`` first (each snapshot disappears whole), then
        every segment, sidecar, submissions or ledger piece no kept manifest lists is deleted, then the
        trash is emptied and the ack journal pruned up to the oldest kept snapshot's
        ``acks_through`` (so a fallback to any kept snapshot still finds its acks). Unreadable
        manifests older than the kept window are retired too; while one is inside the window
        nothing else is deleted, since the files it lists are unknown. Files of sequences after
        the newest manifest belong to a snapshot still being written and are left alone. A process
        that lost its claim on the store retires nothing (:class:`Fenced`).
        """
        self.claim.check()
        if keep_latest < 1:
            raise ValueError(f"keep_latest must be at least 1, not {keep_latest}")
        sequences = self.sequences()
        readable: list[Manifest] = []
        unreadable: list[int] = []
        for sequence in sequences:
            try:
                readable.append(self.load(sequence))
            except CorruptSnapshot as exc:
                log.warning("%s", exc)
                unreadable.append(sequence)
        latest = readable[:keep_latest]
        floor = latest[-1].sequence if latest else -1
        newest = {m.sequence for m in latest}
        kept = [m for m in readable if m.sequence in newest or (keep is not None and keep(m))]
        kept_seqs = {m.sequence for m in kept}
        retired = [m.sequence for m in readable if m.sequence not in kept_seqs]
        retired += [s for s in unreadable if s < floor]
        blind = any(s >= floor for s in unreadable)

        self.backend.delete([f"{TRASH}/{n}" for n in self.backend.listdir(TRASH)])
        for sequence in sorted(retired):
            self.backend.rename(manifest_path(sequence), f"{TRASH}/{sequence:020d}.json")
        if retired:
            self.backend.sync_dirs([MANIFESTS])
        fault_point(FaultPoint.RETIRE_MID)

        deleted = 0
        if not blind and sequences:
            referenced = {entry.path for m in kept for entry in m.files()}
            doomed = []
            for prefix in (SEGMENTS, SIDECARS, PARTIALS, SUBMISSIONS, LEDGER):
                for name in self.backend.listdir(prefix):
                    written = sequence_of(name)
                    path = f"{prefix}/{name}"
                    if written is not None and written <= sequences[0] and path not in referenced:
                        doomed.append(path)
            if self.backend.local:
                doomed += [f"{TMP}/{n}" for n in self.backend.listdir(TMP)]
            self.backend.delete(doomed)
            deleted = len(doomed)
        self.backend.delete([f"{TRASH}/{n}" for n in self.backend.listdir(TRASH)])

        through = min((m.acks_through for m in kept), default=None)
        if through is not None:
            self.journal.prune(through)
        return RetireResult(
            kept=tuple(m.sequence for m in kept),
            retired=tuple(sorted(retired, reverse=True)),
            deleted_files=deleted,
            pruned_acks_through=through,
        )
