"""Snapshot store: publish, resolve, open and verify snapshots (manifests and their files).

Layout under the root (a directory, ``file://`` URL or any fsspec URL such as ``s3://bucket/pre``)::

    manifests/<sequence>.json            a snapshot exists exactly when its manifest does
    segments/<sequence>-<token>.arrow    Arrow IPC file of sample rows, shared by later snapshots
    sidecars/<sequence>-<token>.json     controller state of one snapshot
    partials/<sequence>-<token>.arrow    tokens of siblings still generating (partials.py)
    submissions/<sequence>-<token>.jsonl submitted prompts, shared by later snapshots (submissions.py)
    ledger/<sequence>-<token>.arrow      finalized leases, shared by later snapshots (ledger.py)
    journal/                             acks, leases, submissions, id reservations (journal.py)
    trash/, tmp/                         retention (retention.py), files being written (backends.py)

Invariants:

* Files are immutable once they have their final name; ``<sequence>`` is the snapshot that wrote the
  file and ``<token>`` is random, so a crashed attempt's leftovers never collide with a retry.
* :meth:`SnapshotStore.publish` makes every file of a manifest durable before the manifest itself
  (fsync of files, directories and the manifest, then a rename; on an object store every file is
  complete before the manifest is put), so a crash leaves either the new snapshot or none of it.
* One process writes a store at a time: it holds the store's claim (claim.py), and a process
  that lost it is fenced before it writes.

Every I/O failure is an :class:`OSError` (see backends.py); a file that exists but does not verify
raises :class:`CorruptSnapshot`. The checkpointer and restore see the store through the narrow
:class:`SnapshotWriter` and :class:`SnapshotReader` protocols.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import itertools
import json
import logging
import os
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from rolloutd.checkpoint import groups, ledger, partials, retention, segments, submissions
from rolloutd.checkpoint.backends import (
    MANIFESTS,
    PARTIALS,
    SEGMENTS,
    SIDECARS,
    CorruptSnapshot,
    StoreError,
    file_name,
    manifest_path,
    nothing,
    open_backend,
    sequence_of,
)
from rolloutd.checkpoint.checksums import (
    ChecksumAlgorithm,
    Hasher,
    arrival_for,
    checksum_algorithm,
    checksum_parts,
    checksum_started,
)
from rolloutd.checkpoint.claim import StoreClaim
from rolloutd.checkpoint.faults import FaultPoint, fault_point
from rolloutd.checkpoint.format import FORMAT_VERSION, FormatError
from rolloutd.checkpoint.journal import CorruptJournal, Journal
from rolloutd.checkpoint.manifest import (
    FileEntry,
    LedgerEntry,
    Manifest,
    SegmentEntry,
    SubmissionsEntry,
)
from rolloutd.checkpoint.retention import RetireResult, keep_tagged, plan_compaction
from rolloutd.checkpoint.rowids import RowIdSet
from rolloutd.checkpoint.rows import Row, SegmentKind, rows_to_batches
from rolloutd.checkpoint.segments import Snapshot, Started
from rolloutd.domain.buffer import SealedRows
from rolloutd.domain.group import GroupMeta, Prompt
from rolloutd.domain.partial import PartialSibling
from rolloutd.domain.report import SkippedSnapshot
from rolloutd.domain.state import Journaled

__all__ = [
    "LATEST",
    "CorruptJournal",
    "CorruptSnapshot",
    "Resolution",
    "RetireResult",
    "Snapshot",
    "SnapshotNotFound",
    "SnapshotReader",
    "SnapshotStore",
    "SnapshotWriter",
    "StoreError",
    "keep_tagged",
    "plan_compaction",
]

log = logging.getLogger(__name__)

LATEST = "latest"
"""The spec :meth:`SnapshotStore.resolve` takes for the newest snapshot that verifies."""

_VERIFY_THREADS = min(os.cpu_count() or 1, 4)
_VERIFY_PART = 64 << 20
"""At restore, a file is checksummed in parts of at least this size, each on its own thread: a
restore verifies every byte it reads, and one core checksumming a cold memory-mapped file
(faulting its pages in as it goes) ran slower than the disk's sequential read here."""


@functools.cache
def _verifiers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_VERIFY_THREADS, thread_name_prefix="rolloutd-verify")


@functools.cache
def _openers() -> ThreadPoolExecutor:
    """Maps sample segments and starts their checksums: mapping a large file and asking for
    all of it ahead (see :meth:`SnapshotStore._start`) takes milliseconds that restore spends
    decoding instead."""
    return ThreadPoolExecutor(1, thread_name_prefix="rolloutd-open")


class SnapshotNotFound(LookupError):
    """No published snapshot matches the requested sequence or tag."""


@dataclass
class Resolution:
    """The snapshot a spec resolved to (``None`` when none verified) and each one passed over."""

    snapshot: Snapshot | None
    skipped: list[SkippedSnapshot]


class SnapshotWriter(Protocol):
    """What the checkpointer needs: write a snapshot's files, publish it, keep the store bounded."""

    def sequences(self) -> builtins.list[int]: ...
    def list(self) -> builtins.list[Manifest]: ...
    def write_segment(
        self,
        sequence: int,
        rows: Sequence[Row],
        sealed: Sequence[SealedRows] = (),
        sealed_ids: Collection[int] = (),
    ) -> SegmentEntry: ...
    def write_groups(self, sequence: int, metas: Sequence[GroupMeta]) -> SegmentEntry: ...
    def write_sidecar_json(self, sequence: int, data: bytes) -> FileEntry: ...
    def write_partials(
        self,
        sequence: int,
        siblings: Sequence[PartialSibling],
        resumed: Mapping[int, partials.ResumedRow],
    ) -> FileEntry: ...
    def compact(
        self, manifest: Manifest, segments: Sequence[SegmentEntry], kind: SegmentKind = ...
    ) -> Manifest: ...
    def write_submissions(
        self, sequence: int, parent: Sequence[SubmissionsEntry], prompts: Sequence[Prompt]
    ) -> tuple[SubmissionsEntry, ...]: ...
    def write_ledger(
        self, sequence: int, parent: Sequence[LedgerEntry], finalized: Mapping[str, int]
    ) -> tuple[LedgerEntry, ...]: ...
    def publish(self, manifest: Manifest) -> None: ...
    def retire(self, keep_latest: int, keep: Callable[[Manifest], bool]) -> RetireResult: ...


class SnapshotReader(Protocol):
    """What restore and the inspect command need: find, verify and open published snapshots."""

    @property
    def url(self) -> str: ...

    def sequences(self) -> builtins.list[int]: ...
    def list(self) -> builtins.list[Manifest]: ...
    def load(self, sequence: int) -> Manifest: ...
    def check_sizes(self, manifest: Manifest) -> builtins.list[str]: ...
    def verify_file(self, entry: FileEntry) -> builtins.list[str]: ...
    def resolve(
        self, spec: str | int = ..., *, verify: bool = ..., before: int | None = ...
    ) -> Resolution: ...
    def events_after(self, after: int) -> builtins.list[Journaled]: ...
    def read_partials(self, manifest: Manifest) -> builtins.list[PartialSibling]: ...
    def read_resumed(self, manifest: Manifest) -> dict[int, partials.ResumedRow]: ...


class SnapshotStore:
    """Snapshots of the rollout buffer in a directory or an fsspec URL; see the module docstring.

    Opening a store writes nothing, so a read-only location fails at the first write (an
    ``OSError`` the checkpointer reports as ``io_error``); it lists the journal and reads the newest
    manifest to continue ack positions, so an unreachable location raises ``OSError`` here.
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        checksum: ChecksumAlgorithm = ChecksumAlgorithm.CRC32,
        lock_timeout_s: float = 30.0,
    ) -> None:
        self.backend = open_backend(url, storage_options or {})
        self._checksum = checksum
        self.claim = StoreClaim(self.backend, lock_timeout_s)
        """The one-writer claim (claim.py): a serving process acquires it before restoring;
        publication, retention and journal writes check it first."""
        self.journal = Journal(
            self.backend, floor=self._newest_acks_through(), guard=self.claim.check
        )

    @property
    def url(self) -> str:
        return self.backend.url

    # --- writing ------------------------------------------------------------------------------

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
        lists it, it is invisible and :meth:`retire` collects it. Row ids must be unique.
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

    def read_partials(self, manifest: Manifest) -> builtins.list[PartialSibling]:
        """The partial siblings ``manifest`` lists, verified; none when it lists no file.
        :class:`CorruptSnapshot` when the file does not verify or decode."""
        return self._partials_file(manifest)[0]

    def read_resumed(self, manifest: Manifest) -> dict[int, partials.ResumedRow]:
        """Row id -> where its sample was resumed, for the live rows of ``manifest`` that were."""
        return self._partials_file(manifest)[1]

    def _partials_file(
        self, manifest: Manifest
    ) -> tuple[builtins.list[PartialSibling], dict[int, partials.ResumedRow]]:
        entry = manifest.partials
        if entry is None:
            return [], {}
        try:
            return partials.read(self._read_verified(entry), entry)
        except CorruptSnapshot as exc:
            raise CorruptSnapshot(manifest.sequence, exc.problems) from exc

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
        )

    # --- reading ------------------------------------------------------------------------------

    def sequences(self) -> list[int]:
        """Sequences of every published manifest, newest first, readable or not (one listing)."""
        names = self.backend.listdir(MANIFESTS)
        found = (sequence_of(n) for n in names if n.endswith(".json"))
        return sorted((s for s in found if s is not None), reverse=True)

    def load(self, sequence: int) -> Manifest:
        """The manifest of ``sequence``; :class:`CorruptSnapshot` when it cannot be trusted."""
        try:
            data = self.backend.read(manifest_path(sequence)).to_pybytes()
        except FileNotFoundError:
            raise SnapshotNotFound(f"no snapshot {sequence} in {self.url}") from None
        try:
            manifest = Manifest.from_json(data)
        except FormatError as exc:
            raise CorruptSnapshot(sequence, [f"{manifest_path(sequence)}: {exc}"]) from exc
        if manifest.sequence != sequence:
            problem = f"{manifest_path(sequence)}: holds sequence {manifest.sequence}"
            raise CorruptSnapshot(sequence, [problem])
        return manifest

    def list(self) -> builtins.list[Manifest]:
        """Readable manifests, newest first; reads manifests only, never segments."""
        manifests = []
        for sequence in self.sequences():
            try:
                manifests.append(self.load(sequence))
            except CorruptSnapshot as exc:
                log.warning("%s", exc)
        return manifests

    def _size_problem(self, entry: FileEntry) -> str | None:
        try:
            size = self.backend.size(entry.path)
        except FileNotFoundError:
            return f"{entry.path}: missing"
        if size != entry.size:
            kind = "truncated" if size < entry.size else "longer than recorded"
            return f"{entry.path}: {size} bytes, manifest says {entry.size} ({kind})"
        return None

    @staticmethod
    def _checksum_problem(entry: FileEntry, chunks: Iterable[memoryview]) -> str | None:
        hasher = Hasher(checksum_algorithm(entry.checksum))
        for chunk in chunks:
            hasher.update(chunk)
        if hasher.value != entry.checksum:
            return f"{entry.path}: checksum {hasher.value}, manifest says {entry.checksum}"
        return None

    def check_sizes(self, manifest: Manifest) -> builtins.list[str]:
        """Problems found by comparing each file's size only (cheap: no file is read)."""
        return [p for p in map(self._size_problem, manifest.files()) if p is not None]

    def verify_file(self, entry: FileEntry) -> builtins.list[str]:
        """Problems with one file: missing, wrong size or wrong checksum; [] when it verifies."""
        problem = self._size_problem(entry) or self._checksum_problem(
            entry, self.backend.chunks(entry.path)
        )
        return [problem] if problem else []

    def _read_verified(
        self, entry: FileEntry, threads: int = 1, buffer: pa.Buffer | None = None
    ) -> pa.Buffer:
        """``entry``'s bytes (``buffer`` when already read), checked against the manifest."""
        buffer = self.backend.read(entry.path) if buffer is None else buffer
        if buffer.size != entry.size:
            raise CorruptSnapshot(-1, [f"{entry.path}: {buffer.size} bytes, expected {entry.size}"])
        parts = min(threads, -(-buffer.size // _VERIFY_PART))
        value = checksum_parts(
            memoryview(buffer).cast("B"),  # type: ignore[arg-type]
            checksum_algorithm(entry.checksum),
            parts,
            _verifiers(),
        )
        if value != entry.checksum:
            problem = f"{entry.path}: checksum {value}, manifest says {entry.checksum}"
            raise CorruptSnapshot(-1, [problem])
        return buffer

    def open_segment(
        self,
        segment: SegmentEntry,
        kind: SegmentKind = SegmentKind.SAMPLES,
        *,
        threads: int = 1,
        buffer: pa.Buffer | None = None,
    ) -> pa.ipc.RecordBatchFileReader:
        """A segment's reader over its verified bytes; :class:`CorruptSnapshot` if they differ.
        ``threads`` checksum it at once: a restore, which has the machine to itself, uses
        several; compaction, which runs beside the service's event loop, one."""
        verified = self._read_verified(segment.file, threads, buffer)
        return segments.open_reader(verified, segment, kind)

    def _start(self, entry: FileEntry) -> Started:
        """Maps ``entry`` and starts its checksum on the verify threads, in parts of at least
        :data:`_VERIFY_PART`, each read front to back (see :class:`Arrival`).

        A file checksummed in one part is mapped to be read in order (``read_in_order``: 30 ms
        for 64 MB here, where asking for all of it ahead took 35 ms); one in several parts is
        asked for all at once (``read``), since parts read in order from several offsets at
        once restored the 1.6 GB full run in ~730 ms against ~520 ms."""
        parts = min(_VERIFY_THREADS, -(-entry.size // _VERIFY_PART))
        if parts > 1:
            buffer, read = self.backend.read(entry.path), nothing
        else:
            buffer, read = self.backend.read_in_order(entry.path)
        if buffer.size != entry.size:
            raise CorruptSnapshot(-1, [f"{entry.path}: {buffer.size} bytes, expected {entry.size}"])
        view = memoryview(buffer).cast("B")  # type: ignore[arg-type]
        algorithm = checksum_algorithm(entry.checksum)
        arrival = arrival_for(buffer.size, algorithm, parts)
        checksum = checksum_started(view, algorithm, parts, _verifiers(), arrival)

        def checked() -> str:
            try:
                return checksum()
            finally:
                read()

        return Started(buffer, checked, arrival)

    def open(self, manifest: Manifest, *, verify: bool = True) -> Snapshot:
        """Read and verify every file of ``manifest`` once; :class:`CorruptSnapshot` if any fails.

        With ``verify=False`` the sample segments (nearly all the bytes) are still being read
        and checksummed on the verify threads when this returns; everything else has verified.
        The caller decodes meanwhile and must call :meth:`Snapshot.verify` before it uses rows.
        """
        problems = self.check_sizes(manifest)
        if problems:
            raise CorruptSnapshot(manifest.sequence, problems)
        # The sample segments start first: their read is the long pole, and a restore ends
        # ~1.5 ms after their last byte. The small files read and checked here meanwhile are
        # decoded long before that (64 MB quick snapshot, two runs of three restores: 35-41 ms,
        # and 40-52 ms with the small files asked for first; raw reads 28-30 ms).
        started = [(s, _openers().submit(self._start, s.file)) for s in manifest.segments]
        small = {g.file.path: self.backend.read(g.file.path) for g in manifest.groups}
        sidecar_buffer = self.backend.read(manifest.sidecar.path)
        try:
            group_segments = [
                (s, self.open_segment(s, SegmentKind.GROUPS, buffer=small[s.file.path]))
                for s in manifest.groups
            ]
            sidecar = self._parse_sidecar(
                self._read_verified(manifest.sidecar, buffer=sidecar_buffer), manifest.sidecar
            )
            submitted = submissions.read(self.backend, manifest.submissions)
            finalized = ledger.read(self.backend, manifest.ledger)
        except CorruptSnapshot as exc:
            raise CorruptSnapshot(manifest.sequence, exc.problems) from exc
        snapshot = Snapshot(
            manifest,
            sidecar,
            [],
            group_segments,
            submitted,
            finalized,
            started,
        )
        if verify:
            snapshot.verify()
        return snapshot

    @staticmethod
    def _parse_sidecar(buffer: pa.Buffer, entry: FileEntry) -> dict[str, Any]:
        try:
            state = json.loads(buffer.to_pybytes())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptSnapshot(-1, [f"{entry.path}: not JSON: {exc}"]) from exc
        if not isinstance(state, dict):
            raise CorruptSnapshot(-1, [f"{entry.path}: not a JSON object"])
        return state

    def resolve(
        self, spec: str | int = LATEST, *, verify: bool = True, before: int | None = None
    ) -> Resolution:
        """The newest snapshot selected by ``spec`` that verifies, and each newer one skipped.

        ``spec`` is :data:`LATEST`, a sequence (an int or a string of digits) or a tag. The newest
        snapshot it names is tried first, then each older one, whatever its tag: an older snapshot
        plus the acks journaled after it is a valid, earlier state. :class:`SnapshotNotFound` when
        the sequence or tag names no published snapshot; ``snapshot=None`` when nothing verifies
        (or the store is empty and ``spec`` is :data:`LATEST`). ``before`` tries only snapshots
        older than that sequence (restore's next try when one's rows do not verify);
        ``verify=False`` leaves the sample segments verifying (see :meth:`open`).
        """
        sequences = self.sequences()
        skipped: builtins.list[SkippedSnapshot] = []
        if isinstance(spec, int) or spec.isdigit():
            target = int(spec)
            if target not in sequences:
                raise SnapshotNotFound(f"no snapshot {target} in {self.url}")
        elif spec == LATEST:
            target = sequences[0] if sequences else -1
        else:
            target = self._find_tag(spec, sequences)
        if before is not None:
            target = min(target, before - 1)
        for sequence in (s for s in sequences if s <= target):
            try:
                return Resolution(self.open(self.load(sequence), verify=verify), skipped)
            except CorruptSnapshot as exc:
                log.warning("%s", exc)
                skipped.append(SkippedSnapshot(sequence, "; ".join(exc.problems)))
        return Resolution(None, skipped)

    def _find_tag(self, tag: str, sequences: Sequence[int]) -> int:
        for sequence in sequences:
            with contextlib.suppress(CorruptSnapshot):
                if self.load(sequence).tag == tag:
                    return sequence
        raise SnapshotNotFound(f"no snapshot tagged {tag!r} in {self.url}")

    def _newest_acks_through(self) -> int:
        for sequence in self.sequences():
            with contextlib.suppress(CorruptSnapshot):
                return self.load(sequence).acks_through
        return 0

    # --- retention and the journal (retention.py, journal.py) ---------------------------------

    def compact(
        self,
        manifest: Manifest,
        segments: Sequence[SegmentEntry] | None = None,
        kind: SegmentKind = SegmentKind.SAMPLES,
    ) -> Manifest:
        """See :func:`retention.compact`."""
        return retention.compact(self, manifest, segments, kind)

    def retire(
        self, keep_latest: int, keep: Callable[[Manifest], bool] | None = None
    ) -> RetireResult:
        """See :func:`retention.retire`; nothing is retired by a process that lost its claim."""
        self.claim.check()
        return retention.retire(self, keep_latest, keep)

    def events_after(self, after: int) -> builtins.list[Journaled]:
        """Acks, lease grants, submissions and id reservations journaled after ``after`` (a
        manifest's ``acks_through``), decoded, in order."""
        return self.journal.events_after(after)
