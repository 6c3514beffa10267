"""Partial siblings in a snapshot: the tokens of siblings still generating, one Arrow IPC file.

A snapshot lists at most one partials file (``Manifest.partials``), written in ``buffer_save``
from the cut the exclusive hold took (joining each sibling's deltas happens here, outside the
hold). Unlike segments the file is not shared with later snapshots: partial siblings change at
every checkpoint, so each snapshot writes all of its own, and a snapshot without one restores
every unfinished sibling from its first token.

One row per partial sibling (:data:`PARTIAL_SCHEMA`): the group id and index, the token ids and
logprobs so far, and its parts as two parallel lists (first token offset, policy version).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from rolloutd.checkpoint.backends import Backend, CorruptSnapshot
from rolloutd.checkpoint.faults import FaultPoint, fault_point
from rolloutd.checkpoint.format import ChecksumAlgorithm, FileEntry
from rolloutd.checkpoint.segments import SegmentWriter
from rolloutd.domain.group import SamplePart
from rolloutd.domain.partial import PartialSibling

PARTIALS_FORMAT = 1

PARTIAL_SCHEMA = pa.schema(
    [
        pa.field("group_id", pa.int64(), nullable=False),
        pa.field("index", pa.int32(), nullable=False),
        pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("part_starts", pa.list_(pa.int32()), nullable=False),
        pa.field("part_versions", pa.list_(pa.int64()), nullable=False),
    ],
    metadata={b"rolloutd.partials_format": str(PARTIALS_FORMAT).encode()},
)


def to_batch(partials: Sequence[PartialSibling]) -> pa.RecordBatch:
    """The partial siblings as one record batch; each sibling's deltas are joined here."""
    tokens = [p.token_ids() for p in partials]
    parts = [p.parts() for p in partials]
    return pa.RecordBatch.from_arrays(
        [
            pa.array(np.fromiter((p.group_id for p in partials), np.int64, len(partials))),
            pa.array(np.fromiter((p.index for p in partials), np.int32, len(partials))),
            pa.array([np.frombuffer(t, np.int32) for t in tokens], pa.list_(pa.int32())),
            pa.array(
                [np.frombuffer(p.logprobs(), np.float32) for p in partials],
                pa.list_(pa.float32()),
            ),
            pa.array([[x.start for x in ps] for ps in parts], pa.list_(pa.int32())),
            pa.array([[x.policy_version for x in ps] for ps in parts], pa.list_(pa.int64())),
        ],
        schema=PARTIAL_SCHEMA,
    )


def from_table(table: pa.Table) -> list[PartialSibling]:
    """The partial siblings a file holds; a row that does not hold together raises ValueError."""
    out = []
    for row in table.to_pylist():
        parts = [
            SamplePart(start, version)
            for start, version in zip(row["part_starts"], row["part_versions"], strict=True)
        ]
        out.append(
            PartialSibling.of(
                row["group_id"],
                row["index"],
                array("i", row["token_ids"]),
                array("f", row["logprobs"]),
                parts,
            )
        )
    return out


def write(
    backend: Backend,
    path: str,
    partials: Sequence[PartialSibling],
    checksum: ChecksumAlgorithm,
) -> FileEntry:
    """Write ``partials`` as the Arrow IPC file ``path``; whole and durable when this returns."""
    sink = backend.sink(path)
    out = SegmentWriter(sink, checksum)
    try:
        with pa.ipc.new_file(pa.PythonFile(out, mode="w"), PARTIAL_SCHEMA) as writer:
            writer.write_batch(to_batch(partials))
            fault_point(FaultPoint.BUFFER_SAVE_MID)
        sink.commit()
    except BaseException:
        sink.abort()
        raise
    return out.entry(path)


def read(buffer: pa.Buffer, entry: FileEntry) -> list[PartialSibling]:
    """The partial siblings of a (checksum-verified) file; :class:`CorruptSnapshot` if it is not
    one this format wrote."""
    try:
        table = pa.ipc.open_file(buffer).read_all()
        if table.schema.remove_metadata() != PARTIAL_SCHEMA.remove_metadata():
            raise ValueError("schema differs from the partials schema")
        return from_table(table)
    except (pa.ArrowInvalid, ValueError) as exc:
        raise CorruptSnapshot(-1, [f"{entry.path}: not a readable partials file: {exc}"]) from exc
