"""Segment files: sample rows as Arrow IPC files, written with their checksum and read back verified.

A segment is immutable once it has its final name. Writing checksums each buffer on its way to the
backend's sink; reading checks the schema and that the rows are those the manifest lists. A
:class:`Snapshot` holds the verified readers of one snapshot's segments, and its sidecar.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from rolloutd.checkpoint.backends import Backend, CorruptSnapshot, Sink
from rolloutd.checkpoint.faults import FaultPoint, fault_point
from rolloutd.checkpoint.format import (
    SAMPLE_SCHEMA,
    ChecksumAlgorithm,
    FileEntry,
    Hasher,
    Manifest,
    Row,
    SegmentEntry,
    batch_to_rows,
)
from rolloutd.domain.group import Prompt


class SegmentWriter:
    """The file Arrow's IPC writer writes to: checksums each buffer on its way to the sink.

    Arrow hands over body buffers without copying them, so each byte is touched once by the
    checksum and once by the write, while the batch is still in cache. Both stay on the calling
    thread: with two busy cores a separate writer thread lost more to GIL hand-offs and
    contention than it overlapped.
    """

    def __init__(self, sink: Sink, algorithm: ChecksumAlgorithm) -> None:
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


def write_file(
    backend: Backend,
    path: str,
    batches: Iterator[pa.RecordBatch],
    fault: FaultPoint,
    checksum: ChecksumAlgorithm,
) -> FileEntry:
    """Write ``batches`` as the Arrow IPC file ``path``; whole and durable when this returns."""
    sink = backend.sink(path)
    out = SegmentWriter(sink, checksum)
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


def open_reader(buffer: pa.Buffer, segment: SegmentEntry) -> pa.ipc.RecordBatchFileReader:
    """A reader of a segment's (checksum-verified) bytes, after checking schema and row ids."""
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


@dataclass
class Snapshot:
    """A published snapshot whose every file verified, holding the verified bytes, and the
    prompts of its submitted-prompt pieces.

    Decoding reads the same bytes that were checked, so a restore reads each file once. The
    bytes (memory-mapped locally, in memory from an object store) are held until it is dropped.
    """

    manifest: Manifest
    sidecar: dict[str, Any]
    _segments: list[tuple[SegmentEntry, pa.ipc.RecordBatchFileReader]] = field(repr=False)
    submitted: list[Prompt] = field(default_factory=list, repr=False)
    """Every prompt submitted up to this snapshot, in order (submissions.py)."""

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
