"""Snapshot store: immutable segment and sidecar files, manifests that publish them, an ack journal.

Layout under the root (a directory, ``file://`` URL or any fsspec URL such as ``s3://bucket/pre``)::

    manifests/<sequence>.json            a snapshot exists exactly when its manifest does
    segments/<sequence>-<token>.arrow    Arrow IPC file of sample rows, shared by later snapshots
    sidecars/<sequence>-<token>.json     controller state of one snapshot
    journal/<position>-<token>.jsonl     local: durable ack records, appended and fsynced
    journal/<position>.json              object store: one object per ack record
    trash/<sequence>.json                manifests being retired
    tmp/                                 local: files being written, renamed into place when whole

Invariants:

* Files are immutable once they have their final name; ``<sequence>`` is the snapshot that wrote the
  file and ``<token>`` is random, so a crashed attempt's leftovers never collide with a retry.
* :meth:`SnapshotStore.publish` makes every file of a manifest durable before the manifest itself.
  Locally that is fsync of each file, of its directory, of the manifest under a temporary name, a
  rename, and fsync of ``manifests/``; on an object store every file is complete before the manifest
  is put. A crash at any instant therefore leaves either the new snapshot or none of it visible.
* Retirement first moves manifests away (the snapshot disappears at once, whole), then deletes
  files that no kept manifest lists. Files of a visible snapshot are never deleted.
* One process writes a store at a time, and :meth:`SnapshotStore.retire` does not run concurrently
  with writes of the next snapshot (the checkpointer runs them in order).

Every I/O failure is an :class:`OSError` (object-store client errors are wrapped in
:class:`StoreError`); a file that exists but does not verify raises :class:`CorruptSnapshot`.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import fsspec
import numpy as np
import pyarrow as pa

from rolloutd.checkpoint.faults import FaultPoint, fault_point
from rolloutd.checkpoint.format import (
    FORMAT_VERSION,
    SAMPLE_SCHEMA,
    ChecksumAlgorithm,
    FileEntry,
    FormatError,
    Hasher,
    Manifest,
    Row,
    RowIdSet,
    SegmentEntry,
    batch_to_rows,
    checksum_algorithm,
    rows_to_batches,
)
from rolloutd.domain.report import SkippedSnapshot

log = logging.getLogger(__name__)

MANIFESTS = "manifests"
SEGMENTS = "segments"
SIDECARS = "sidecars"
JOURNAL = "journal"
TRASH = "trash"
TMP = "tmp"

LATEST = "latest"
"""The spec :meth:`SnapshotStore.resolve` takes for the newest snapshot that verifies."""

_READ_CHUNK = 16 << 20
_WRITEBACK_CHUNK = 64 << 20
"""Locally, writeback of each this many bytes starts while later ones are still encoded."""
_HINT_WRITEBACK = sys.platform.startswith("linux")
"""``posix_fadvise(DONTNEED)`` starts writeback on Linux; elsewhere it may not exist."""


class StoreError(OSError):
    """An I/O failure of the store that the backend did not report as an ``OSError`` itself."""


class CorruptSnapshot(StoreError):
    """A snapshot's manifest or files exist but do not verify; ``problems`` names each failure."""

    def __init__(self, sequence: int, problems: Sequence[str]) -> None:
        super().__init__(f"snapshot {sequence} does not verify: {'; '.join(problems)}")
        self.sequence = sequence
        self.problems = list(problems)


class CorruptJournal(StoreError):
    """The ack journal lost or garbled a record that was acknowledged as durable."""


class SnapshotNotFound(LookupError):
    """No published snapshot matches the requested sequence or tag."""


def _client_errors() -> tuple[type[BaseException], ...]:
    """Exceptions object-store clients raise that are not ``OSError`` (boto's, when installed)."""
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        return ()
    return (BotoCoreError, ClientError)


def _name(sequence: int, suffix: str) -> str:
    return f"{sequence:020d}-{secrets.token_hex(4)}{suffix}"


def _sequence_of(name: str) -> int | None:
    head = name.split("-", 1)[0].split(".", 1)[0]
    return int(head) if head.isdigit() else None


# --- backends ---------------------------------------------------------------------------------


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _makedirs(path: str) -> None:
    """``mkdir -p`` whose new entries are durable: each created directory's parent is fsynced."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    _makedirs(parent)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path)
    _fsync_dir(parent)


class _Sink(Protocol):
    def write(self, data: Any) -> int: ...
    def commit(self) -> None: ...
    def abort(self) -> None: ...


class _Backend(Protocol):
    """Storage primitives; paths are relative to the store root and use ``/``."""

    url: str
    local: bool

    def sink(self, path: str) -> _Sink:
        """A writer whose :meth:`_Sink.commit` makes ``path`` whole and durable at once."""
        ...

    def put(
        self,
        path: str,
        data: bytes,
        *,
        before_visible: FaultPoint | None = None,
        after_visible: FaultPoint | None = None,
    ) -> None:
        """Write a small file atomically and durably, directory entry included."""
        ...

    def read(self, path: str) -> pa.Buffer: ...
    def chunks(self, path: str) -> Iterator[memoryview]: ...
    def size(self, path: str) -> int: ...
    def listdir(self, path: str) -> list[str]: ...
    def rename(self, src: str, dst: str) -> None: ...
    def delete(self, paths: Collection[str]) -> None: ...
    def sync_dirs(self, paths: Collection[str]) -> None: ...


class _LocalSink:
    """Writes ``tmp/<name>.<token>.partial``; commit fsyncs it and renames it into place."""

    def __init__(self, root: str, path: str) -> None:
        self._final = os.path.join(root, path)
        tmp_dir = os.path.join(root, TMP)
        _makedirs(tmp_dir)
        _makedirs(os.path.dirname(self._final))
        # random: a crashed attempt's leftover (collected by retire) must not block a retry
        name = f"{os.path.basename(path)}.{secrets.token_hex(4)}.partial"
        self._tmp = os.path.join(tmp_dir, name)
        self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self._written = self._synced = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.write(self._fd, view[done:])
        self._written += done
        if _HINT_WRITEBACK and self._written - self._synced >= _WRITEBACK_CHUNK:
            # Start writeback of what was just written (Linux starts it asynchronously for
            # DONTNEED, then drops only pages already clean), so the device works while later
            # batches are encoded instead of all at the final fsync.
            os.posix_fadvise(self._fd, self._synced, 0, os.POSIX_FADV_DONTNEED)
            self._synced = self._written
        return done

    def flush(self) -> None:
        """Durable under the temporary name."""
        os.fsync(self._fd)

    def rename(self) -> None:
        os.close(self._fd)
        self._fd = -1
        os.rename(self._tmp, self._final)

    def commit(self) -> None:
        self.flush()
        self.rename()

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp)


class _LocalBackend:
    local = True

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root

    def _path(self, path: str) -> str:
        return os.path.join(self.root, path)

    def sink(self, path: str) -> _LocalSink:
        return _LocalSink(self.root, path)

    def put(
        self,
        path: str,
        data: bytes,
        *,
        before_visible: FaultPoint | None = None,
        after_visible: FaultPoint | None = None,
    ) -> None:
        sink = _LocalSink(self.root, path)
        try:
            sink.write(data)
            sink.flush()
        except BaseException:
            sink.abort()
            raise
        if before_visible is not None:
            fault_point(before_visible)
        sink.rename()
        if after_visible is not None:
            fault_point(after_visible)
        self.sync_dirs([os.path.dirname(path)])

    def read(self, path: str) -> pa.Buffer:
        """The whole file, memory-mapped: verification and decoding read the page cache directly."""
        if os.path.getsize(self._path(path)) == 0:
            return pa.py_buffer(b"")
        with pa.memory_map(self._path(path), "r") as mapped:
            return mapped.read_buffer()

    def chunks(self, path: str) -> Iterator[memoryview]:
        buffer = self.read(path)
        view = memoryview(buffer).cast("B")
        for start in range(0, len(view), _READ_CHUNK):
            yield view[start : start + _READ_CHUNK]

    def size(self, path: str) -> int:
        return os.stat(self._path(path)).st_size

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self._path(path)))
        except FileNotFoundError:
            return []

    def rename(self, src: str, dst: str) -> None:
        _makedirs(os.path.dirname(self._path(dst)))
        os.rename(self._path(src), self._path(dst))

    def delete(self, paths: Collection[str]) -> None:
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(path))

    def sync_dirs(self, paths: Collection[str]) -> None:
        for path in paths:
            _fsync_dir(self._path(path))


class _ObjectSink:
    def __init__(self, backend: _ObjectBackend, path: str) -> None:
        self._io = backend.io
        self._path = path
        with self._io(f"open {path}"):
            self._file = backend.fs.open(path, "wb")

    def write(self, data: Any) -> int:
        with self._io(f"write {self._path}"):
            return int(self._file.write(memoryview(data).cast("B")))

    def commit(self) -> None:
        with self._io(f"close {self._path}"):
            self._file.close()

    def abort(self) -> None:
        with self._io(f"abort {self._path}"):
            self._file.discard()
        self._file.closed = True


class _ObjectBackend:
    """Any fsspec filesystem without rename or fsync: an object is whole once its put returns."""

    local = False

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str) -> None:
        self.fs = fs
        self._root = root.rstrip("/")
        self.url = url
        self._errors = _client_errors()

    @contextlib.contextmanager
    def io(self, what: str) -> Iterator[None]:
        """Client errors that are not ``OSError`` become :class:`StoreError`."""
        try:
            yield
        except self._errors as exc:
            raise StoreError(f"{what} in {self.url}: {exc}") from exc

    def _path(self, path: str) -> str:
        return f"{self._root}/{path}"

    def sink(self, path: str) -> _ObjectSink:
        return _ObjectSink(self, self._path(path))

    def put(
        self,
        path: str,
        data: bytes,
        *,
        before_visible: FaultPoint | None = None,
        after_visible: FaultPoint | None = None,
    ) -> None:
        if before_visible is not None:
            fault_point(before_visible)
        with self.io(f"put {path}"):
            self.fs.pipe_file(self._path(path), data)
        if after_visible is not None:
            fault_point(after_visible)

    def read(self, path: str) -> pa.Buffer:
        with self.io(f"read {path}"):
            return pa.py_buffer(self.fs.cat_file(self._path(path)))

    def read_many(self, paths: Sequence[str]) -> builtins.list[bytes]:
        """Small objects fetched concurrently, in the order of ``paths``."""
        if not paths:
            return []
        full = [self._path(p) for p in paths]
        with self.io(f"read {len(paths)} objects"):
            found = self.fs.cat(full, on_error="raise")
        return [found[p] for p in full]

    def chunks(self, path: str) -> Iterator[memoryview]:
        with (
            self.io(f"read {path}"),
            self.fs.open(self._path(path), "rb", block_size=_READ_CHUNK) as f,
        ):
            while chunk := f.read(_READ_CHUNK):
                yield memoryview(chunk)

    def size(self, path: str) -> int:
        full = self._path(path)
        with self.io(f"stat {path}"):
            self.fs.invalidate_cache(full)
            return int(self.fs.info(full)["size"])

    def listdir(self, path: str) -> list[str]:
        full = self._path(path)
        with self.io(f"list {path}"):
            self.fs.invalidate_cache(full)
            try:
                entries = self.fs.ls(full, detail=False)
            except FileNotFoundError:
                return []
        return sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries)

    def rename(self, src: str, dst: str) -> None:
        with self.io(f"rename {src}"):
            self.fs.mv(self._path(src), self._path(dst))

    def delete(self, paths: Collection[str]) -> None:
        if paths:
            with self.io(f"delete {len(paths)} objects"):
                self.fs.rm([self._path(p) for p in paths])

    def sync_dirs(self, paths: Collection[str]) -> None:
        """Nothing to do: a put object is durable."""


# --- ack journal ------------------------------------------------------------------------------


@dataclass(frozen=True)
class JournalEntry:
    """One durable ack record at its journal position (positions increase by one per record)."""

    position: int
    record: dict[str, Any]


def _encode_record(position: int, record: Mapping[str, Any]) -> bytes:
    return json.dumps({"position": position, "record": record}, separators=(",", ":")).encode()


def _decode_record(data: bytes) -> JournalEntry:
    value = json.loads(data)
    return JournalEntry(int(value["position"]), value["record"])


class _FileJournal:
    """Local journal: records appended as JSON lines and fsynced, one file per run of appends.

    A file is named after its first position; a new file starts after each :meth:`prune` and
    each process start, so no append follows a torn tail. A torn (unsynced) last line of a file is
    not a record: it was never acknowledged. Files are deleted whole once every record is pruned.
    """

    def __init__(self, root: str) -> None:
        self._dir = os.path.join(root, JOURNAL)
        self._fd = -1

    def _files(self) -> list[tuple[int, str]]:
        try:
            names = os.listdir(self._dir)
        except FileNotFoundError:
            return []
        return sorted((int(n.split("-", 1)[0]), n) for n in names if n.endswith(".jsonl"))

    def _read_file(self, name: str) -> list[JournalEntry]:
        """The file's records; unreadable lines after the last good one are a torn tail (an
        append that never returned), unreadable lines before it are corruption."""
        with open(os.path.join(self._dir, name), "rb") as f:
            lines = f.read().split(b"\n")
        entries: list[JournalEntry] = []
        damaged: list[str] = []
        for number, line in enumerate(lines, start=1):
            if not line:
                continue
            try:
                entry = _decode_record(line)
            except (ValueError, KeyError, TypeError) as exc:
                damaged.append(f"{JOURNAL}/{name} line {number}: {exc}")
                continue
            if damaged:
                raise CorruptJournal("; ".join(damaged))
            entries.append(entry)
        return entries

    def last_position(self) -> int:
        files = self._files()
        for _, name in reversed(files):
            entries = self._read_file(name)
            if entries:
                return entries[-1].position
        return 0

    def append(self, position: int, record: Mapping[str, Any]) -> None:
        if self._fd < 0:
            _makedirs(self._dir)
            # first position, then creation time: files sort in the order they were written
            name = f"{position:020d}-{time.time_ns():020d}-{secrets.token_hex(2)}.jsonl"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC
            self._fd = os.open(os.path.join(self._dir, name), flags, 0o644)
            _fsync_dir(self._dir)
        data = _encode_record(position, record) + b"\n"
        done = 0
        while done < len(data):
            done += os.write(self._fd, data[done:])
        os.fdatasync(self._fd)

    def read(self, after: int) -> list[JournalEntry]:
        """Records after ``after``; a position written twice (an append that failed and was
        retried in a later file) keeps its later record, the one that was acknowledged."""
        files = self._files()
        entries: dict[int, JournalEntry] = {}
        for i, (_, name) in enumerate(files):
            if i + 1 < len(files) and files[i + 1][0] <= after + 1:
                continue
            entries.update((e.position, e) for e in self._read_file(name) if e.position > after)
        return [entries[p] for p in sorted(entries)]

    def prune(self, through: int) -> int:
        self.rotate()
        files = self._files()
        doomed = [n for i, (_, n) in enumerate(files[:-1]) if files[i + 1][0] - 1 <= through]
        for name in doomed:
            os.unlink(os.path.join(self._dir, name))
        if doomed:
            _fsync_dir(self._dir)
        return len(doomed)

    def rotate(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _ObjectJournal:
    """Object-store journal: one object per record, durable once its put returns."""

    def __init__(self, backend: _ObjectBackend) -> None:
        self._backend = backend

    def _positions(self) -> list[int]:
        names = self._backend.listdir(JOURNAL)
        return sorted(int(n.split(".", 1)[0]) for n in names if n.endswith(".json"))

    def last_position(self) -> int:
        positions = self._positions()
        return positions[-1] if positions else 0

    def append(self, position: int, record: Mapping[str, Any]) -> None:
        self._backend.put(f"{JOURNAL}/{position:020d}.json", _encode_record(position, record))

    def read(self, after: int) -> list[JournalEntry]:
        paths = [f"{JOURNAL}/{p:020d}.json" for p in self._positions() if p > after]
        return [_decode_record(data) for data in self._backend.read_many(paths)]

    def prune(self, through: int) -> int:
        doomed = [f"{JOURNAL}/{p:020d}.json" for p in self._positions() if p <= through]
        self._backend.delete(doomed)
        return len(doomed)

    def rotate(self) -> None:
        """Nothing to do: every record is its own object."""


def _open(url: str, options: Mapping[str, Any]) -> tuple[_Backend, _FileJournal | _ObjectJournal]:
    """The backend for ``url`` (a plain path or ``file://`` is local) and its kind of journal."""
    protocol, path = fsspec.core.split_protocol(url)
    if protocol in (None, "file", "local"):
        local = _LocalBackend(path)
        return local, _FileJournal(local.root)
    fs = fsspec.filesystem(protocol, **options)
    remote = _ObjectBackend(fs, fs._strip_protocol(url), url)
    return remote, _ObjectJournal(remote)


# --- snapshots --------------------------------------------------------------------------------


@dataclass
class Snapshot:
    """A published snapshot whose every file verified, holding the verified bytes.

    Decoding reads the same bytes that were checked, so a restore reads each file once. The
    bytes (memory-mapped locally, in memory from an object store) are held until it is dropped.
    """

    manifest: Manifest
    sidecar: dict[str, Any]
    _segments: list[tuple[SegmentEntry, pa.ipc.RecordBatchFileReader]] = field(repr=False)

    def _batches(self) -> Iterator[tuple[pa.RecordBatch, np.ndarray | None]]:
        for segment, reader in self._segments:
            for i in range(reader.num_record_batches):
                batch = reader.get_batch(i)
                keep = None
                if segment.removed:
                    keep = ~segment.removed.mask(batch.column("row_id").to_numpy())
                yield batch, keep

    def rows(self) -> list[Row]:
        """Live rows as ``(row_id, group_id, Sample)``, segment by segment in file order."""
        rows: list[Row] = []
        for batch, keep in self._batches():
            rows.extend(batch_to_rows(batch, keep))
        return rows

    def table(self) -> pa.Table:
        """Live rows as one Arrow table of :data:`SAMPLE_SCHEMA`."""
        batches = [b if keep is None else b.filter(pa.array(keep)) for b, keep in self._batches()]
        return pa.Table.from_batches(batches, schema=SAMPLE_SCHEMA)


@dataclass
class Resolution:
    """The snapshot a spec resolved to (``None`` when none verified) and each one passed over."""

    snapshot: Snapshot | None
    skipped: list[SkippedSnapshot]


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


def plan_compaction(manifest: Manifest, max_segments: int) -> tuple[SegmentEntry, ...]:
    """Segments to merge so that at most ``max_segments // 2`` remain; empty when within bounds.

    The smallest by live bytes are chosen, so one compaction rewrites the least data and the
    large, mostly live segments are left alone (size-tiered compaction).
    """
    segments = manifest.segments
    if len(segments) <= max_segments:
        return ()
    count = len(segments) - max(max_segments // 2, 1) + 1
    ranked = sorted(segments, key=lambda s: s.file.size * s.live_rows / s.rows)
    return tuple(ranked[:count])


class _SegmentWriter:
    """The file Arrow's IPC writer writes to: checksums each buffer on its way to the sink.

    Arrow hands over body buffers without copying them, so each byte is touched once by the
    checksum and once by the write, while the batch is still in cache. Both stay on the calling
    thread: with two busy cores a separate writer thread lost more to GIL hand-offs and
    contention than it overlapped.
    """

    def __init__(self, sink: _Sink, algorithm: ChecksumAlgorithm) -> None:
        self._sink = sink
        self._hasher = Hasher(algorithm)
        self.size = 0
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._hasher.update(view)
        self._sink.write(view)
        self.size += len(view)
        return len(view)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        """Durability comes from the sink's commit."""

    def close(self) -> None:
        self.closed = True

    def writable(self) -> bool:
        return True

    def entry(self, path: str) -> FileEntry:
        return FileEntry(path, self.size, self._hasher.value)


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
    ) -> None:
        self._backend, self._journal = _open(url, storage_options or {})
        self._checksum = checksum
        self._journal_lock = threading.Lock()
        self._position = max(self._journal.last_position(), self._newest_acks_through())

    @property
    def url(self) -> str:
        return self._backend.url

    # --- writing ------------------------------------------------------------------------------

    def write_segment(self, sequence: int, rows: Sequence[Row]) -> SegmentEntry:
        """Write ``rows`` as a new immutable segment of snapshot ``sequence``; not yet published.

        The file is whole and durable under its final name when this returns; until a manifest
        lists it, it is invisible and :meth:`retire` collects it. Row ids must be unique.
        """
        if not rows:
            raise ValueError("a segment needs at least one row")
        ids = np.fromiter((row[0] for row in rows), dtype=np.int64, count=len(rows))
        row_ids = RowIdSet.from_ids(ids)
        if len(row_ids) != len(rows):
            raise ValueError("row ids of a segment must be unique")
        entry = self._write_batches(
            _name(sequence, ".arrow"), rows_to_batches(rows), FaultPoint.BUFFER_SAVE_MID
        )
        return SegmentEntry(entry, len(rows), row_ids, RowIdSet(), sequence)

    def _write_batches(
        self, name: str, batches: Iterator[pa.RecordBatch], fault: FaultPoint
    ) -> FileEntry:
        path = f"{SEGMENTS}/{name}"
        sink = self._backend.sink(path)
        out = _SegmentWriter(sink, self._checksum)
        try:
            with pa.ipc.new_file(pa.PythonFile(out, mode="w"), SAMPLE_SCHEMA) as writer:
                for i, batch in enumerate(batches):
                    writer.write_batch(batch)
                    if i == 0:
                        fault_point(fault)
            sink.commit()
        except BaseException:
            sink.abort()
            raise
        return out.entry(path)

    def write_sidecar(self, sequence: int, state: Mapping[str, Any]) -> FileEntry:
        """Write controller state (JSON-able) as the sidecar of snapshot ``sequence``."""
        return self.write_sidecar_json(
            sequence, json.dumps(state, separators=(",", ":"), allow_nan=False).encode()
        )

    def write_sidecar_json(self, sequence: int, data: bytes) -> FileEntry:
        """Write an already encoded JSON object as the sidecar of snapshot ``sequence``."""
        path = f"{SIDECARS}/{_name(sequence, '.json')}"
        hasher = Hasher(self._checksum)
        hasher.update(data)
        sink = self._backend.sink(path)
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

    def publish(self, manifest: Manifest) -> None:
        """Make ``manifest`` the newest snapshot, atomically and durably.

        Its files must have been written by this store; sequences must increase.
        """
        newest = self.sequences()
        if newest and manifest.sequence <= newest[0]:
            raise ValueError(f"sequence {manifest.sequence} is not after {newest[0]}")
        if manifest.format_version != FORMAT_VERSION:
            raise ValueError(f"cannot publish a manifest of format {manifest.format_version}")
        dirs = {os.path.dirname(entry.path) for entry in manifest.files()}
        self._backend.sync_dirs(sorted(dirs))
        self._backend.put(
            _manifest_path(manifest.sequence),
            manifest.to_json(),
            before_visible=FaultPoint.COMMIT_BEFORE_RENAME,
            after_visible=FaultPoint.COMMIT_AFTER_RENAME,
        )

    # --- reading ------------------------------------------------------------------------------

    def sequences(self) -> list[int]:
        """Sequences of every published manifest, newest first, readable or not (one listing)."""
        names = self._backend.listdir(MANIFESTS)
        found = (_sequence_of(n) for n in names if n.endswith(".json"))
        return sorted((s for s in found if s is not None), reverse=True)

    def load(self, sequence: int) -> Manifest:
        """The manifest of ``sequence``; :class:`CorruptSnapshot` when it cannot be trusted."""
        try:
            data = self._backend.read(_manifest_path(sequence)).to_pybytes()
        except FileNotFoundError:
            raise SnapshotNotFound(f"no snapshot {sequence} in {self.url}") from None
        try:
            manifest = Manifest.from_json(data)
        except FormatError as exc:
            raise CorruptSnapshot(sequence, [f"{_manifest_path(sequence)}: {exc}"]) from exc
        if manifest.sequence != sequence:
            problem = f"{_manifest_path(sequence)}: holds sequence {manifest.sequence}"
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
            size = self._backend.size(entry.path)
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
            entry, self._backend.chunks(entry.path)
        )
        return [problem] if problem else []

    def verify(self, manifest: Manifest) -> builtins.list[str]:
        """Problems with ``manifest``'s files (every file re-read and checksummed); [] if none."""
        return [p for entry in manifest.files() for p in self.verify_file(entry)]

    def _read_verified(self, entry: FileEntry) -> pa.Buffer:
        buffer = self._backend.read(entry.path)
        if buffer.size != entry.size:
            raise CorruptSnapshot(-1, [f"{entry.path}: {buffer.size} bytes, expected {entry.size}"])
        problem = self._checksum_problem(entry, [memoryview(buffer).cast("B")])
        if problem:
            raise CorruptSnapshot(-1, [problem])
        return buffer

    def _open_segment(self, segment: SegmentEntry) -> pa.ipc.RecordBatchFileReader:
        buffer = self._read_verified(segment.file)
        path = segment.file.path
        try:
            reader = pa.ipc.open_file(buffer)
            ids = [reader.get_batch(i).column("row_id") for i in range(reader.num_record_batches)]
        except (pa.ArrowInvalid, KeyError) as exc:
            raise CorruptSnapshot(-1, [f"{path}: not a readable segment: {exc}"]) from exc
        if reader.schema.remove_metadata() != SAMPLE_SCHEMA.remove_metadata():
            raise CorruptSnapshot(-1, [f"{path}: schema differs from the sample schema"])
        row_ids = np.concatenate([a.to_numpy() for a in ids]) if ids else np.zeros(0, np.int64)
        if row_ids.size != segment.rows or not segment.row_ids.mask(row_ids).all():
            raise CorruptSnapshot(-1, [f"{path}: rows disagree with the manifest"])
        return reader

    def open(self, manifest: Manifest) -> Snapshot:
        """Read and verify every file of ``manifest`` once; :class:`CorruptSnapshot` if any fails."""
        problems = self.check_sizes(manifest)
        if problems:
            raise CorruptSnapshot(manifest.sequence, problems)
        try:
            segments = [(s, self._open_segment(s)) for s in manifest.segments]
            sidecar = self._parse_sidecar(self._read_verified(manifest.sidecar), manifest.sidecar)
        except CorruptSnapshot as exc:
            raise CorruptSnapshot(manifest.sequence, exc.problems) from exc
        return Snapshot(manifest, sidecar, segments)

    @staticmethod
    def _parse_sidecar(buffer: pa.Buffer, entry: FileEntry) -> dict[str, Any]:
        try:
            state = json.loads(buffer.to_pybytes())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptSnapshot(-1, [f"{entry.path}: not JSON: {exc}"]) from exc
        if not isinstance(state, dict):
            raise CorruptSnapshot(-1, [f"{entry.path}: not a JSON object"])
        return state

    def read_rows(self, manifest: Manifest) -> builtins.list[Row]:
        """Live rows of a snapshot, verified as they are read."""
        return self.open(manifest).rows()

    def read_sidecar(self, manifest: Manifest) -> dict[str, Any]:
        """The sidecar of a snapshot, verified as it is read."""
        try:
            return self._parse_sidecar(self._read_verified(manifest.sidecar), manifest.sidecar)
        except CorruptSnapshot as exc:
            raise CorruptSnapshot(manifest.sequence, exc.problems) from exc

    def resolve(self, spec: str | int = LATEST) -> Resolution:
        """The newest snapshot selected by ``spec`` that verifies, and each newer one skipped.

        ``spec`` is :data:`LATEST`, a sequence (an int or a string of digits) or a tag. The newest
        snapshot it names is tried first, then each older one, whatever its tag: an older snapshot
        plus the acks journaled after it is a valid, earlier state. :class:`SnapshotNotFound` when
        the sequence or tag names no published snapshot; ``snapshot=None`` when nothing verifies
        (or the store is empty and ``spec`` is :data:`LATEST`).
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
        for sequence in (s for s in sequences if s <= target):
            try:
                return Resolution(self.open(self.load(sequence)), skipped)
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

    # --- compaction ---------------------------------------------------------------------------

    def compact(
        self, manifest: Manifest, segments: Sequence[SegmentEntry] | None = None
    ) -> Manifest:
        """``manifest`` with ``segments`` (default: all) merged into one without removed rows.

        The merged segment is written for ``manifest.sequence``; the returned manifest is not
        published. Sources are read back from the store and verified (:class:`CorruptSnapshot`
        when one does not), one at a time, so memory stays bounded by the largest segment.
        """
        listed = manifest.segments if segments is None else segments
        paths = {s.file.path for s in listed}
        if not paths <= {s.file.path for s in manifest.segments}:
            raise ValueError("can only compact segments the manifest lists")
        chosen = [s for s in manifest.segments if s.file.path in paths]  # keeps row order
        if not chosen:
            return manifest
        kept_ids: builtins.list[np.ndarray] = []

        def live_batches() -> Iterator[pa.RecordBatch]:
            for segment in chosen:
                try:
                    reader = self._open_segment(segment)
                except CorruptSnapshot as exc:
                    raise CorruptSnapshot(manifest.sequence, exc.problems) from exc
                for i in range(reader.num_record_batches):
                    batch = reader.get_batch(i)
                    ids = batch.column("row_id").to_numpy()
                    if segment.removed:
                        keep = ~segment.removed.mask(ids)
                        batch, ids = batch.filter(pa.array(keep)), ids[keep]
                    if batch.num_rows:
                        kept_ids.append(ids)
                        yield batch

        name = _name(manifest.sequence, ".arrow")
        entry = self._write_batches(name, live_batches(), FaultPoint.COMPACT_MID)
        ids = np.concatenate(kept_ids) if kept_ids else np.zeros(0, np.int64)
        merged = SegmentEntry(
            entry, int(ids.size), RowIdSet.from_ids(ids), RowIdSet(), manifest.sequence
        )
        at = min(i for i, s in enumerate(manifest.segments) if s.file.path in paths)
        rest = [s for s in manifest.segments if s.file.path not in paths]
        new = rest[:at] + ([merged] if merged.rows else []) + rest[at:]
        return replace(manifest, segments=tuple(new))

    # --- retention ----------------------------------------------------------------------------

    def retire(
        self, keep_latest: int, keep: Callable[[Manifest], bool] | None = None
    ) -> RetireResult:
        """Keep the newest ``keep_latest`` readable snapshots and those ``keep`` selects.

        Retired manifests are moved to ``trash/`` first (each snapshot disappears whole), then
        every segment or sidecar no kept manifest lists is deleted, then the trash is emptied and
        the ack journal pruned up to the oldest kept snapshot's ``acks_through`` (so a fallback to
        any kept snapshot still finds its acks). Unreadable manifests older than the kept window
        are retired too; while one is inside the window nothing else is deleted, since the files
        it lists are unknown. Files of sequences after the newest manifest belong to a snapshot
        still being written and are left alone.
        """
        if keep_latest < 1:
            raise ValueError(f"keep_latest must be at least 1, not {keep_latest}")
        sequences = self.sequences()
        readable: builtins.list[Manifest] = []
        unreadable: builtins.list[int] = []
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

        self._backend.delete([f"{TRASH}/{n}" for n in self._backend.listdir(TRASH)])
        for sequence in sorted(retired):
            self._backend.rename(_manifest_path(sequence), f"{TRASH}/{sequence:020d}.json")
        if retired:
            self._backend.sync_dirs([MANIFESTS])
        fault_point(FaultPoint.RETIRE_MID)

        deleted = 0
        if not blind and sequences:
            referenced = {entry.path for m in kept for entry in m.files()}
            doomed = []
            for prefix in (SEGMENTS, SIDECARS):
                for name in self._backend.listdir(prefix):
                    written = _sequence_of(name)
                    path = f"{prefix}/{name}"
                    if written is not None and written <= sequences[0] and path not in referenced:
                        doomed.append(path)
            if self._backend.local:
                doomed += [f"{TMP}/{n}" for n in self._backend.listdir(TMP)]
            self._backend.delete(doomed)
            deleted = len(doomed)
        self._backend.delete([f"{TRASH}/{n}" for n in self._backend.listdir(TRASH)])

        through = min((m.acks_through for m in kept), default=None)
        if through is not None:
            self.prune_journal(through)
        return RetireResult(
            kept=tuple(m.sequence for m in kept),
            retired=tuple(sorted(retired, reverse=True)),
            deleted_files=deleted,
            pruned_acks_through=through,
        )

    # --- ack journal --------------------------------------------------------------------------

    @property
    def journal_position(self) -> int:
        """Position of the last durable ack record; no I/O (capture it under the exclusive hold)."""
        return self._position

    def append_ack(self, record: Mapping[str, Any]) -> int:
        """Journal ``record`` (JSON-able); it is durable when this returns its position.

        Appends are serialised; locally each costs one ``fdatasync``, on an object store one put.
        """
        with self._journal_lock:
            position = self._position + 1
            try:
                self._journal.append(position, record)
            except OSError:
                self._journal.rotate()  # never append after what may be a torn record
                raise
            self._position = position
        fault_point(FaultPoint.JOURNAL_APPEND)
        return position

    def read_acks(self, after: int = 0) -> builtins.list[JournalEntry]:
        """Records with a position after ``after`` (a manifest's ``acks_through``), in order."""
        with self._journal_lock:
            entries = self._journal.read(after)
        positions = [e.position for e in entries]
        if positions != list(range(after + 1, after + 1 + len(entries))):
            missing = sorted(set(range(after + 1, positions[-1] + 1)) - set(positions))
            raise CorruptJournal(f"{JOURNAL}: records missing after {after}: {missing[:10]}")
        return entries

    def prune_journal(self, through: int) -> int:
        """Delete records at positions up to ``through`` where whole files/objects allow."""
        with self._journal_lock:
            return self._journal.prune(through)


def _manifest_path(sequence: int) -> str:
    return f"{MANIFESTS}/{sequence:020d}.json"
