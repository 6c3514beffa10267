"""Segment files: sample rows as Arrow IPC files, written with their checksum and read back verified.

A segment is immutable once it has its final name. Writing checksums each buffer on its way to the
backend's sink; reading checks the schema and that the rows are those the manifest lists. A
:class:`Snapshot` holds the verified readers of one snapshot's segments, and its sidecar.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, KeysView, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from rolloutd.checkpoint import groups, sidecar
from rolloutd.checkpoint.backends import Backend, CorruptSnapshot, Sink
from rolloutd.checkpoint.checksums import Arrival, ChecksumAlgorithm, Hasher
from rolloutd.checkpoint.faults import FaultPoint, fault_point
from rolloutd.checkpoint.manifest import FileEntry, Manifest, SegmentEntry
from rolloutd.checkpoint.rowids import RowIdSet
from rolloutd.checkpoint.rows import SAMPLE_SCHEMA, Row, SegmentKind, batch_to_rows, rows_to_batches
from rolloutd.domain.buffer import RowSealer, SealedRows
from rolloutd.domain.group import GroupMeta, GroupTable, KeptSamples, Prompt, Sample

log = logging.getLogger(__name__)

WRITE_CHUNK = 1 << 20
"""Bytes Arrow gathers in its own buffer before it hands them to :class:`SegmentWriter`."""


class SegmentWriter:
    """The file Arrow's IPC writer writes to: checksums each chunk on its way to the sink.

    Arrow gathers its buffers into chunks of :data:`WRITE_CHUNK` bytes first (see
    :func:`write_file`), so each byte is touched once by the checksum and once by the write while
    the chunk is still in cache. Both stay on the calling thread: with two busy cores a separate
    writer thread lost more to GIL hand-offs and contention than it overlapped.
    """

    def __init__(self, sink: Sink, algorithm: ChecksumAlgorithm) -> None:
        self._sink = sink
        self._hasher = Hasher(algorithm)
        self.size = 0
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self.closed:  # an abandoned file: Arrow flushes its buffer when it is collected
            return len(view)
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


def write_file(
    backend: Backend,
    path: str,
    batches: Iterator[pa.RecordBatch],
    fault: FaultPoint,
    checksum: ChecksumAlgorithm,
    kind: SegmentKind = SegmentKind.SAMPLES,
) -> FileEntry:
    """Write ``batches`` as the Arrow IPC file ``path``; whole and durable when this returns.

    Arrow writes through a buffer of its own: unbuffered, every column buffer, padding and
    message header was a call into Python, each taking the GIL back from the event loop and
    releasing it again for the checksum and the write (35 calls for a segment of 3,000 rows,
    about 100 hand-offs; a few now). The bytes are the same either way."""
    sink = backend.sink(path)
    out = SegmentWriter(sink, checksum)
    try:
        stream = pa.BufferedOutputStream(pa.PythonFile(out, mode="w"), WRITE_CHUNK)
        with pa.ipc.new_file(stream, kind.schema) as writer:
            for i, batch in enumerate(batches):
                writer.write_batch(batch)
                if i == 0:
                    fault_point(fault)
        stream.close()  # hands the last chunk over
        sink.commit()
    except BaseException:
        out.close()
        sink.abort()
        raise
    return out.entry(path)


def open_reader(
    buffer: pa.Buffer, segment: SegmentEntry, kind: SegmentKind = SegmentKind.SAMPLES
) -> pa.ipc.RecordBatchFileReader:
    """A reader of a segment's bytes, after checking schema and row ids. Restore opens a
    segment while its checksum is still being computed (:class:`Snapshot`), so this must only
    raise on bytes that do not decode, never trust them further."""
    path = segment.file.path
    try:
        reader = pa.ipc.open_file(buffer)
        ids = [reader.get_batch(i).column(kind.id_column) for i in range(reader.num_record_batches)]
    except (pa.ArrowInvalid, KeyError) as exc:
        raise CorruptSnapshot(-1, [f"{path}: not a readable segment: {exc}"]) from exc
    _check_schema(path, reader.schema, kind)
    row_ids = np.concatenate([a.to_numpy() for a in ids]) if ids else np.zeros(0, np.int64)
    if row_ids.size != segment.rows or not segment.row_ids.mask(row_ids).all():
        raise CorruptSnapshot(-1, [f"{path}: rows disagree with the manifest"])
    return reader


_FILE_MAGIC = 8
"""Bytes before the stream in an Arrow IPC file ("ARROW1" and padding)."""
_HEADER_MARGIN = 64 << 10
"""Bytes a record batch's message header is awaited with: its metadata (a few hundred bytes a
column) must have arrived before it is read, and its body before it is used."""


def read_batches(
    buffer: pa.Buffer,
    segment: SegmentEntry,
    arrival: Arrival,
    kind: SegmentKind = SegmentKind.SAMPLES,
) -> Iterator[pa.RecordBatch]:
    """A segment's record batches, each yielded once ``arrival`` says its bytes are in; schema
    and row ids are checked as :func:`open_reader` does (which must wait for the whole file), the
    row count once the last batch is read.

    An Arrow IPC file is the stream format between a magic number and a footer, so reading it
    as a stream goes front to back like the read itself and needs no footer (at the end): what
    has arrived is decoded while the rest is on its way, and no page is asked for out of order.
    Like :func:`open_reader`, this only raises on bytes that do not decode, never trusts them."""
    path = segment.file.path
    rows = 0
    try:
        source = pa.BufferReader(buffer)
        source.seek(_FILE_MAGIC)
        arrival.wait(_FILE_MAGIC + _HEADER_MARGIN)
        reader = pa.ipc.open_stream(source)
        _check_schema(path, reader.schema, kind)
        while True:
            arrival.wait(source.tell() + _HEADER_MARGIN)
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                break
            arrival.wait(source.tell())
            ids = batch.column(kind.id_column).to_numpy()
            rows += ids.size
            if rows > segment.rows or not segment.row_ids.mask(ids).all():
                raise CorruptSnapshot(-1, [f"{path}: rows disagree with the manifest"])
            yield batch
    except (pa.ArrowException, KeyError) as exc:
        raise CorruptSnapshot(-1, [f"{path}: not a readable segment: {exc}"]) from exc
    if rows != segment.rows:
        raise CorruptSnapshot(-1, [f"{path}: rows disagree with the manifest"])


def _check_schema(path: str, schema: pa.Schema, kind: SegmentKind) -> None:
    if schema.remove_metadata() not in [s.remove_metadata() for s in kind.schemas]:
        raise CorruptSnapshot(-1, [f"{path}: schema differs from the {kind.value} schema"])


class KeptRows(SealedRows):
    """Rows left in record batches, indexed by group: the live rows of a snapshot in its verified
    segments, or the rows :class:`ArrowSealer` sealed.

    Built by one vectorised pass over the ``row_id``, ``group_id`` and ``index`` columns (no
    Python object per row): rows are ordered by (group, sibling index) and each group gets one
    :class:`KeptGroup` view over its slice of that order when it is looked up. A :class:`Sample`
    is built from the buffers when it is read, so the buffers (memory-mapped locally) must stay
    alive as long as a view does; the views hold them.
    """

    def __init__(
        self,
        batches: Iterable[tuple[pa.RecordBatch, npt.NDArray[np.bool_] | None]],
        capacity: int,
        resumed: Mapping[int, Any] | None = None,
    ) -> None:
        self._batches: list[pa.RecordBatch] = []
        self.resumed = dict(resumed or {})
        """Row id -> ``partials.ResumedRow`` of the rows resumed or of episodes: row segments do
        not hold where a sample was resumed, the snapshot's partials file does."""
        # Each batch is indexed as it arrives (Snapshot.kept_rows) into columns allocated for
        # ``capacity`` rows (all the segments hold): a full snapshot is written in (group,
        # index) order, so its groups are found batch by batch and nothing is left to do
        # after the last one but a check; rows in another order are sorted at the end.
        cols = np.empty((5, capacity), dtype=np.int64)  # batch, at, group_id, index, row_id
        ordered = True
        self.group_ids: list[int] = []
        self.position: dict[int, int] = {}
        """Group id -> its place in :attr:`group_ids`."""
        starts: list[int] = []
        count = 0
        for n, (batch, keep) in enumerate(batches):
            self._batches.append(batch)
            at = np.arange(batch.num_rows) if keep is None else np.flatnonzero(keep)
            end = count + at.size
            cols[0, count:end] = n
            cols[1, count:end] = at
            cols[2, count:end] = batch.column("group_id").to_numpy()[at]
            cols[3, count:end] = batch.column("index").to_numpy()[at]
            cols[4, count:end] = batch.column("row_id").to_numpy()[at]
            since = max(count - 1, 0)  # the previous batch's last row, to compare across
            group_id, index = cols[2, since:end], cols[3, since:end]
            ordered = ordered and _ordered(group_id, index)
            if ordered and end > count:
                new = (np.flatnonzero(group_id[1:] != group_id[:-1]) + since + 1).tolist()
                new = [0, *new] if count == 0 else new
                ids = cols[2, new].tolist()
                self.position.update(
                    zip(ids, range(len(starts), len(starts) + len(new)), strict=True)
                )
                starts.extend(new)
                self.group_ids.extend(ids)
            count = end
        batch_no, at, group_id, index, row_id = cols[:, :count]
        if not ordered:
            order = np.lexsort((index, group_id))
            batch_no, at, group_id = batch_no[order], at[order], group_id[order]
            index, row_id = index[order], row_id[order]
            first_rows = np.flatnonzero(np.r_[True, group_id[1:] != group_id[:-1]][:count])
            starts = first_rows.tolist()
            self.group_ids = group_id[first_rows].tolist()
            self.position = dict(zip(self.group_ids, range(len(starts)), strict=True))
        self._batch_no, self._at, self._index, self._row_id = batch_no, at, index, row_id
        self._bounds = [*starts, count]
        self._token_counts: dict[int, npt.NDArray[np.int32]] = {}
        """Batch number -> the token count of each of its rows, computed on first use."""

    def __len__(self) -> int:
        return int(self._at.size)

    def groups(self) -> Mapping[int, KeptSamples]:
        """A view per group that has live rows, by group id, each made when it is looked up."""
        return _KeptGroups(self)

    def view(self, n: int) -> KeptGroup:
        """The ``n``-th group's rows (in group id order)."""
        return KeptGroup(self, self._bounds[n], self._bounds[n + 1])

    def indices(self, start: int, stop: int) -> list[int]:
        return self._index[start:stop].tolist()  # type: ignore[no-any-return]

    def row_ids(self, start: int, stop: int) -> dict[int, int]:
        return dict(zip(self.indices(start, stop), self._row_id[start:stop].tolist(), strict=True))

    def sample(self, k: int) -> Sample:
        """The ``k``-th row in (group, index) order, as a fresh :class:`Sample`."""
        batch = self._batches[int(self._batch_no[k])]
        return self._resumed(k, batch_to_rows(batch.slice(int(self._at[k]), 1))[0][2])

    def samples(self, start: int, stop: int) -> list[Sample]:
        """Rows ``[start, stop)`` of the (group, index) order, decoded in one pass when they
        share a batch (a sealed group's rows do unless a batch boundary falls among them)."""
        batch_no = self._batch_no[start:stop]
        if stop - start < 2 or (batch_no != batch_no[0]).any():
            return [self.sample(k) for k in range(start, stop)]
        batch = self._batches[int(batch_no[0])]
        at = self._at[start:stop]
        contiguous = bool((np.diff(at) == 1).all())
        rows = batch_to_rows(
            batch.slice(int(at[0]), stop - start) if contiguous else batch.take(pa.array(at))
        )
        return [self._resumed(k, row[2]) for k, row in zip(range(start, stop), rows, strict=True)]

    def tokens(self, start: int, stop: int) -> int:
        """Generated tokens of rows ``[start, stop)`` of the (group, index) order, read from
        the token lists' offsets."""
        total = 0
        for b, at in zip(self._batch_no[start:stop], self._at[start:stop], strict=True):
            counts = self._token_counts.get(int(b))
            if counts is None:
                column = self._batches[int(b)].column("token_ids")
                counts = pc.list_value_length(column).to_numpy(zero_copy_only=False)
                self._token_counts[int(b)] = counts
            total += int(counts[at])
        return total

    def _resumed(self, k: int, sample: Sample) -> Sample:
        record = self.resumed.get(int(self._row_id[k]))
        if record is not None:
            sample = replace(
                sample,
                resumed_at=None if record.resumed_at < 0 else record.resumed_at,
                parts=record.parts,
                turns=record.turns,
                episode_reward=record.episode_reward,
                retokenization_mismatches=record.retokenization_mismatches,
            )
        return sample

    def batches_of(self, row_ids: RowIdSet) -> Iterator[pa.RecordBatch]:
        """The rows among ``row_ids``, batch by batch: what a snapshot writes of sealed rows."""
        for batch in self._batches:
            keep = row_ids.mask(batch.column("row_id").to_numpy())
            if keep.all():
                yield batch
            elif keep.any():
                yield batch.filter(pa.array(keep))


def _ordered(group_id: npt.NDArray[np.int64], index: npt.NDArray[np.int64]) -> bool:
    """Whether rows are already in (group, index) order: checking is linear, sorting is not."""
    same = group_id[1:] == group_id[:-1]
    return bool(np.all((group_id[1:] > group_id[:-1]) | (same & (index[1:] > index[:-1]))))


class _KeptGroups(Mapping[int, KeptSamples]):
    """:meth:`KeptRows.groups`: group id -> a fresh :class:`KeptGroup`, made on lookup (a
    restore looks up only the groups it delivers or stages into)."""

    def __init__(self, rows: KeptRows) -> None:
        self._rows = rows
        self._at = rows.position

    def keys(self) -> KeysView[int]:
        return self._at.keys()

    def __getitem__(self, group_id: int) -> KeptSamples:
        return self._rows.view(self._at[group_id])

    def __iter__(self) -> Iterator[int]:
        return iter(self._rows.group_ids)

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._at


class KeptGroup(KeptSamples):
    """One group's rows of :class:`KeptRows`: positions ``[start, stop)`` of its order."""

    __slots__ = ("_rows", "_start", "_stop")

    def __init__(self, rows: KeptRows, start: int, stop: int) -> None:
        self._rows, self._start, self._stop = rows, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    def __iter__(self) -> Iterator[int]:
        return iter(self._rows.indices(self._start, self._stop))

    def __contains__(self, index: object) -> bool:
        return index in self._rows.indices(self._start, self._stop)

    def __getitem__(self, index: int) -> Sample:
        indices = self._rows.indices(self._start, self._stop)
        try:
            return self._rows.sample(self._start + indices.index(index))
        except ValueError:
            raise KeyError(index) from None

    def row_ids(self) -> dict[int, int]:
        return self._rows.row_ids(self._start, self._stop)

    def ordered(self) -> list[Sample]:
        return self._rows.samples(self._start, self._stop)

    def tokens(self) -> int:
        return self._rows.tokens(self._start, self._stop)


class ArrowSealer(RowSealer):
    """Seals committed rows into record batches of the sample schema, as a segment holds them."""

    def seal(self, rows: Sequence[Row]) -> KeptRows:
        return KeptRows(((batch, None) for batch in rows_to_batches(rows)), len(rows))


def sealed_batches(sealed: Sequence[SealedRows], row_ids: RowIdSet) -> Iterator[pa.RecordBatch]:
    """The rows among ``row_ids`` of rows an :class:`ArrowSealer` sealed, batch by batch."""
    for rows in sealed:
        if not isinstance(rows, KeptRows):
            raise TypeError(f"rows sealed by {type(rows).__name__}, not by an ArrowSealer")
        yield from rows.batches_of(row_ids)


class Started(NamedTuple):
    """A file whose reading and checksum have started: its bytes (memory-mapped locally, so
    they fill in as the disk delivers them), what waits for the checksum, and how far it got."""

    buffer: pa.Buffer
    checksum: Callable[[], str]
    arrival: Arrival


@dataclass
class Snapshot:
    """A published snapshot whose every file verified (or is verifying), holding the verified
    bytes, and the prompts of its submitted-prompt pieces.

    Decoding reads the same bytes that were checked, so a restore reads each file once. The
    bytes (memory-mapped locally, in memory from an object store) are held until it is dropped.
    The sample segments of a snapshot opened by a restore may still be verifying (``_pending``):
    their row index is built meanwhile, and :meth:`verify` says whether they may be used.
    """

    manifest: Manifest
    sidecar: dict[str, Any]
    _segments: list[tuple[SegmentEntry, list[pa.RecordBatch]]] = field(repr=False)
    _groups: list[tuple[SegmentEntry, pa.ipc.RecordBatchFileReader]] = field(
        default_factory=list, repr=False
    )
    submitted: list[Prompt] = field(default_factory=list, repr=False)
    """Every prompt submitted up to this snapshot, in order (submissions.py)."""
    finalized_leases: Mapping[str, int] = field(default_factory=dict, repr=False)
    """The finalized-lease ledger of the snapshot's ledger pieces, oldest first (ledger.py);
    empty when its sidecar holds the ledger itself (earlier versions)."""
    _started: list[tuple[SegmentEntry, Future[Started]]] = field(default_factory=list, repr=False)
    """Every sample segment whose reading and checksum were started, each with what that
    started: being read and checksummed (``_pending``) and not read yet (``_unopened``) at
    first, and always counted by :meth:`progress`."""
    _pending: list[tuple[SegmentEntry, Future[Started]]] = field(init=False, repr=False)
    """Sample segments whose checksum :meth:`verify` has not waited for yet."""
    _unopened: list[tuple[SegmentEntry, Future[Started]]] = field(init=False, repr=False)
    """Sample segments whose record batches are not read yet: :meth:`kept_rows` reads them as
    their bytes arrive (:func:`read_batches`)."""

    def __post_init__(self) -> None:
        self._pending, self._unopened = list(self._started), list(self._started)

    def progress(self) -> tuple[int, int]:
        """Bytes of the sample segments read and checksummed so far, and in all (a file still
        being opened, or fetched whole from an object store, counts nothing yet)."""
        done = total = 0
        for segment, started in self._started:
            total += segment.file.size
            if started.done() and started.exception() is None:
                done += started.result().arrival.through()
        return done, total

    def verify(self) -> None:
        """Waits for the checksums still being computed and opens every sample segment;
        :class:`CorruptSnapshot` (with this snapshot's sequence) when a checksum differs from
        the manifest or a segment does not decode. Then every file has verified."""
        pending, self._pending = self._pending, []
        for n, (segment, started) in enumerate(pending, 1):
            try:
                value = started.result().checksum()
            except CorruptSnapshot as exc:
                raise CorruptSnapshot(self.manifest.sequence, exc.problems) from exc
            if value != segment.file.checksum:
                problem = f"{segment.file.path}: checksum {value}, manifest says "
                raise CorruptSnapshot(self.manifest.sequence, [problem + segment.file.checksum])
            log.info(
                "snapshot %d: segment %d/%d verified (%.1f MB)",
                self.manifest.sequence,
                n,
                len(pending),
                segment.file.size / 1e6,
            )
        self._readers()

    def _readers(self) -> list[tuple[SegmentEntry, list[pa.RecordBatch]]]:
        """Every sample segment's record batches, reading those not read yet."""
        for _, batches in self._sample_segments():
            for _ in batches:
                pass
        return self._segments

    def _sample_segments(self) -> Iterator[tuple[SegmentEntry, Iterable[pa.RecordBatch]]]:
        yield from list(self._segments)
        while self._unopened:
            segment, started = self._unopened.pop(0)
            yield segment, self._arriving(segment, started.result())

    def _arriving(self, segment: SegmentEntry, begun: Started) -> Iterator[pa.RecordBatch]:
        """A segment's batches as they arrive (:func:`read_batches`); kept once all are read."""
        batches = []
        try:
            for batch in read_batches(begun.buffer, segment, begun.arrival):
                batches.append(batch)
                yield batch
        except CorruptSnapshot as exc:
            self.verify()  # a checksum that differs says more than bytes that do not decode
            raise CorruptSnapshot(self.manifest.sequence, exc.problems) from exc
        self._segments.append((segment, batches))

    def _batches(
        self, kind: SegmentKind = SegmentKind.SAMPLES
    ) -> Iterator[tuple[pa.RecordBatch, np.ndarray | None]]:
        if kind is SegmentKind.SAMPLES:
            sources = self._sample_segments()
        else:
            sources = (
                (s, (r.get_batch(i) for i in range(r.num_record_batches))) for s, r in self._groups
            )
        for segment, batches in sources:
            for batch in batches:
                keep = None
                if segment.removed:
                    keep = ~segment.removed.mask(batch.column(kind.id_column).to_numpy())
                yield batch, keep

    def group_table(self) -> GroupTable:
        """Every live group, its metadata left in the group segments' columns until read."""
        return groups.table_of(list(self._batches(SegmentKind.GROUPS)))

    def group_metas(self) -> list[GroupMeta]:
        """Every live group, segment by segment (format 3 typed columns or format 2 JSON)."""
        metas: list[GroupMeta] = []
        for batch, keep in self._batches(SegmentKind.GROUPS):
            metas.extend(groups.batch_to_metas(batch, keep))
        return metas

    def group_json(self) -> list[str]:
        """Every live group as the JSON of its metadata (``sidecar.encode_group``): for tools
        and tests that inspect a snapshot."""
        return [sidecar.encode_group(m).decode() for m in self.group_metas()]

    def rows(self) -> list[Row]:
        """Live rows as ``(row_id, group_id, Sample)``, segment by segment in file order."""
        rows: list[Row] = []
        for batch, keep in self._batches():
            rows.extend(batch_to_rows(batch, keep))
        return rows

    def kept_rows(self, resumed: Mapping[int, Any] | None = None) -> KeptRows:
        """Live rows left in the verified buffers, indexed by group (what a restore keeps), with
        the resume records of ``resumed`` (row id -> (resumed_at, parts)) put back when read."""
        capacity = sum(s.rows for s in self.manifest.segments)
        return KeptRows(self._batches(), capacity, resumed)

    def table(self) -> pa.Table:
        """Live rows as one Arrow table of :data:`SAMPLE_SCHEMA`."""
        batches = [b if keep is None else b.filter(pa.array(keep)) for b, keep in self._batches()]
        return pa.Table.from_batches(batches, schema=SAMPLE_SCHEMA)
