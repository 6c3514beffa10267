"""Snapshot format: the Arrow schema of a sample row, row-id sets, checksums and the manifest.

A snapshot is a manifest that lists immutable files: Arrow IPC *segments* holding sample rows,
one JSON *sidecar* holding controller state, and JSON Lines *submissions pieces* holding the
submitted prompts (submissions.py), and Arrow IPC *ledger pieces* holding the finalized-lease
ledger (ledger.py). Segments use the IPC file format, uncompressed, with
:data:`SAMPLE_SCHEMA`, so ``pyarrow.ipc.open_file``, ``polars.read_ipc`` and duckdb open them as
they are. Snapshots are incremental: a segment written by one snapshot is listed again by later
ones, each listing also the ids of its rows that are no longer live.

Encoding and decoding work on whole buffers (one ``bytes.join`` per column and batch on write, one
slice per row on read), never token by token, so they run near memory speed.

Checksums are CRC-32 (the zlib/gzip/zip polynomial) by default, computed by zlib-ng: the same
values as the standard library's ``zlib.crc32`` at ~30 GB/s here against ~6 GB/s (2 ms for a
64 MB segment instead of 11, on the path of every save and restore), and ~1.7 GB/s for SHA-256 with
SHA-NI. The corruption it guards against is
accidental (torn writes, truncation, bit rot), not adversarial; sizes are checked separately. The
algorithm is part of every checksum string (``crc32:1a2b3c4d``), so SHA-256 is available as an
option and a future algorithm needs no format change.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import json
import threading
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
from zlib_ng import zlib_ng

from rolloutd.domain.group import Sample

FORMAT_VERSION = 3
"""Version of the manifest and segment layout; readers refuse a newer one. Format 3 keeps group
metadata as typed columns (:data:`GROUP_SCHEMA`); format 2 kept it as one JSON string per group
(:data:`GROUP_SCHEMA_V2`) and format 1 in the sidecar. Both are still read: a snapshot taken
after an upgrade lists the group segments of earlier ones until compaction rewrites them."""

Row = tuple[int, int, Sample]
"""One buffered sample as the checkpointer hands it over: ``(row_id, group_id, sample)``."""

if array("i").itemsize != 4 or array("f").itemsize != 4:
    raise ImportError("rolloutd needs a platform where array('i') and array('f') are 4 bytes")

_INT32_LIST = pa.list_(pa.int32())
_FLOAT32_LIST = pa.list_(pa.float32())

SAMPLE_SCHEMA = pa.schema(
    [
        pa.field("row_id", pa.int64(), nullable=False),
        pa.field("group_id", pa.int64(), nullable=False),
        pa.field("index", pa.int32(), nullable=False),
        pa.field("token_ids", _INT32_LIST, nullable=False),
        pa.field("logprobs", _FLOAT32_LIST, nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("prompt_token_ids", _INT32_LIST, nullable=False),
        pa.field("seed", pa.int64(), nullable=False),
        pa.field("started_at", pa.float64(), nullable=False),
        pa.field("finished_at", pa.float64(), nullable=False),
    ],
    metadata={b"rolloutd.format_version": str(FORMAT_VERSION).encode()},
)
"""One row per finished sibling. ``row_id`` is unique in a store; times are wall-clock seconds."""

GROUP_SCHEMA = pa.schema(
    [
        pa.field("group_id", pa.int64(), nullable=False),
        pa.field("state", pa.string(), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("prompt_text", pa.string(), nullable=False),
        pa.field("prompt_metadata", pa.string()),
        pa.field("prompt_messages", pa.string()),
        pa.field("epoch", pa.int64()),
        pa.field("offset", pa.int64()),
        pa.field("group_size", pa.int32(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("admitted_at", pa.float64(), nullable=False),
        pa.field("seed", pa.int64(), nullable=False),
        pa.field("committed_at", pa.float64()),
        pa.field("lease_id", pa.string()),
        pa.field("ack_step", pa.int64()),
    ],
    metadata={b"rolloutd.format_version": str(FORMAT_VERSION).encode()},
)
"""One row per group whose metadata changed, a column per ``GroupMeta`` field (groups.py holds
the codec, which refuses to load if a field has no column): a restore reads whole columns, not
one JSON document per group. ``position`` is ``epoch`` and ``offset`` (null: none); the prompt's
``metadata`` (any JSON value) and ``messages`` are JSON text, null when None or empty.
``group_id`` is the row id: a later snapshot that changes or drops a group lists it as removed
from the segment that held it, so each group is live in one segment."""

GROUP_SCHEMA_V2 = pa.schema(
    [
        pa.field("group_id", pa.int64(), nullable=False),
        pa.field("state", pa.string(), nullable=False),
        pa.field("meta", pa.string(), nullable=False),
    ],
    metadata={b"rolloutd.format_version": b"2"},
)
"""Group segments of format 2: ``meta`` is the sidecar codec's JSON of the ``GroupMeta``. Read,
never written."""


class SegmentKind(enum.Enum):
    """What a segment holds: sample rows (by ``row_id``) or group metadata (by ``group_id``)."""

    SAMPLES = "samples"
    GROUPS = "groups"

    @property
    def schema(self) -> pa.Schema:
        return SAMPLE_SCHEMA if self is SegmentKind.SAMPLES else GROUP_SCHEMA

    @property
    def schemas(self) -> tuple[pa.Schema, ...]:
        """Every schema a segment of this kind may have (the current one first)."""
        return (self.schema,) if self is SegmentKind.SAMPLES else (GROUP_SCHEMA, GROUP_SCHEMA_V2)

    @property
    def id_column(self) -> str:
        return "row_id" if self is SegmentKind.SAMPLES else "group_id"


BATCH_ROWS = 4096
"""Most rows in one record batch."""

BATCH_VALUES = 1 << 20
"""Most list values (token ids, logprobs, prompt ids) in one record batch, whatever the row count.

About 4 MiB of buffers per batch, so encoding, checksum and write of a batch run in cache: on the
development machine 4096-row batches of 1280-token rows (40 MiB) took twice the CPU time, and
batches of 32k values four times (per-batch overhead).
"""


class FormatError(ValueError):
    """A manifest or segment does not follow this format (or comes from a newer one)."""


# --- rows <-> Arrow ---------------------------------------------------------------------------


def _list_array(
    arrays: Sequence[array[int]] | Sequence[array[float]], type_: pa.DataType
) -> pa.Array:
    """A list array from typed buffers: one join for the values, one cumsum for the offsets."""
    lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = pa.py_buffer(b"".join(arrays))
    child = pa.Array.from_buffers(type_.value_type, int(offsets[-1]), [None, values])
    return pa.Array.from_buffers(
        type_, len(arrays), [None, pa.py_buffer(offsets)], children=[child]
    )


def _encode_batch(rows: Sequence[Row]) -> pa.RecordBatch:
    n = len(rows)
    samples = [row[2] for row in rows]
    columns = [
        pa.array(np.fromiter((row[0] for row in rows), dtype=np.int64, count=n)),
        pa.array(np.fromiter((row[1] for row in rows), dtype=np.int64, count=n)),
        pa.array(np.fromiter((s.index for s in samples), dtype=np.int32, count=n)),
        _list_array([s.token_ids for s in samples], _INT32_LIST),
        _list_array([s.logprobs for s in samples], _FLOAT32_LIST),
        pa.array([s.text for s in samples], type=pa.string()),
        pa.array([s.finish_reason for s in samples], type=pa.string()),
        pa.array(np.fromiter((s.policy_version for s in samples), dtype=np.int64, count=n)),
        _list_array([s.prompt_token_ids for s in samples], _INT32_LIST),
        pa.array(np.fromiter((s.seed for s in samples), dtype=np.int64, count=n)),
        pa.array(np.fromiter((s.started_at for s in samples), dtype=np.float64, count=n)),
        pa.array(np.fromiter((s.finished_at for s in samples), dtype=np.float64, count=n)),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=SAMPLE_SCHEMA)


def _batch_bounds(rows: Sequence[Row], batch_rows: int, batch_values: int) -> list[int]:
    """Batch boundaries from 0 to ``len(rows)``: a new batch every ``batch_rows`` rows, or sooner
    once ``batch_values`` list values are reached (a single larger row gets a batch to itself)."""
    sizes = np.fromiter(
        (len(s.token_ids) + len(s.logprobs) + len(s.prompt_token_ids) for _, _, s in rows),
        dtype=np.int64,
        count=len(rows),
    )
    bounds = [0]
    cumulative = np.cumsum(sizes)
    while bounds[-1] < len(rows):
        start = bounds[-1]
        base = cumulative[start - 1] if start else 0
        fit = int(np.searchsorted(cumulative, base + batch_values, side="right"))
        bounds.append(min(max(fit, start + 1), start + batch_rows, len(rows)))
    return bounds


def rows_to_batches(
    rows: Sequence[Row], *, batch_rows: int = BATCH_ROWS, batch_values: int = BATCH_VALUES
) -> Iterator[pa.RecordBatch]:
    """Record batches of :data:`SAMPLE_SCHEMA`, built lazily so a writer holds one at a time.

    Rows keep their order. A batch has at most ``batch_rows`` rows and, unless a single row is
    larger, at most ``batch_values`` token ids, logprobs and prompt ids together: small enough
    to stay in cache between encoding, checksum and write, far from the int32 offset limit.
    """
    bounds = _batch_bounds(rows, batch_rows, batch_values)
    for start, stop in itertools.pairwise(bounds):
        yield _encode_batch(rows[start:stop])


def rows_to_table(rows: Sequence[Row], **batching: int) -> pa.Table:
    """All ``rows`` as one table (several record batches); see :func:`rows_to_batches`."""
    return pa.Table.from_batches(list(rows_to_batches(rows, **batching)), schema=SAMPLE_SCHEMA)


def _typed_column(column: pa.Array, typecode: str, indices: Sequence[int]) -> list[array[Any]]:
    """A fresh ``array`` per selected row of a list column: one byte slice each, no per-token work."""
    values = column.values
    itemsize = values.type.bit_width // 8
    offsets = ((column.offsets.to_numpy() + values.offset) * itemsize).tolist()
    data = values.buffers()[1]
    view = memoryview(data if data is not None else b"").cast("B")
    out = []
    for i in indices:
        typed = array(typecode)
        typed.frombytes(view[offsets[i] : offsets[i + 1]])
        out.append(typed)
    return out


_SCALARS = ("row_id", "group_id", "index", "policy_version", "seed", "started_at", "finished_at")


def batch_to_rows(batch: pa.RecordBatch, keep: npt.NDArray[np.bool_] | None = None) -> list[Row]:
    """Rows of one batch (those where ``keep`` is true), with fresh ``array`` buffers per sample."""
    if batch.schema.remove_metadata() != SAMPLE_SCHEMA.remove_metadata():
        raise FormatError(f"segment schema differs from the sample schema: {batch.schema}")
    indices = list(range(batch.num_rows)) if keep is None else np.flatnonzero(keep).tolist()
    col = {name: batch.column(name) for name in SAMPLE_SCHEMA.names}
    scalars = {name: col[name].to_numpy().tolist() for name in _SCALARS}
    text = col["text"].to_pylist()
    finish_reason = col["finish_reason"].to_pylist()
    tokens = _typed_column(col["token_ids"], "i", indices)
    logprobs = _typed_column(col["logprobs"], "f", indices)
    prompts = _typed_column(col["prompt_token_ids"], "i", indices)
    row_id, group_id, index = scalars["row_id"], scalars["group_id"], scalars["index"]
    policy_version, seed = scalars["policy_version"], scalars["seed"]
    started_at, finished_at = scalars["started_at"], scalars["finished_at"]
    return [
        (
            row_id[i],
            group_id[i],
            Sample(
                index=index[i],
                token_ids=token_ids,
                logprobs=lps,
                text=text[i],
                finish_reason=finish_reason[i],
                policy_version=policy_version[i],
                prompt_token_ids=prompt,
                seed=seed[i],
                started_at=started_at[i],
                finished_at=finished_at[i],
            ),
        )
        for i, token_ids, lps, prompt in zip(indices, tokens, logprobs, prompts, strict=True)
    ]


def table_to_rows(table: pa.Table) -> list[Row]:
    """The inverse of :func:`rows_to_table`: ``(row_id, group_id, Sample)`` in table order."""
    rows: list[Row] = []
    for batch in table.to_batches():
        rows.extend(batch_to_rows(batch))
    return rows


# --- row-id sets ------------------------------------------------------------------------------


def sorted_unique(ids: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """``np.unique`` of int64 ids by a sort and a comparison: numpy 2's ``unique`` hashes
    first and took 7 ms for the 100k ids of a full snapshot (this: under 1 ms)."""
    values = np.sort(np.asarray(ids, dtype=np.int64), axis=None)
    if values.size < 2:
        return values
    return values[np.concatenate(([True], values[1:] != values[:-1]))]


@dataclass(frozen=True)
class RowIdSet:
    """A set of row ids as sorted, disjoint, non-adjacent half-open ranges ``[start, stop)``.

    Row ids are handed out in order, so the rows of a segment are a few ranges and the manifest
    stays small even at 100k rows; an arbitrary set still works, only less compactly.
    """

    ranges: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        previous = None
        for start, stop in self.ranges:
            if start >= stop or (previous is not None and start <= previous):
                raise FormatError(f"row id ranges are not sorted, disjoint and non-empty: {self}")
            previous = stop

    @classmethod
    def from_ids(cls, ids: npt.ArrayLike) -> RowIdSet:
        values = sorted_unique(ids)
        if values.size == 0:
            return cls()
        breaks = np.flatnonzero(np.diff(values) != 1) + 1
        starts = values[np.concatenate(([0], breaks))]
        stops = values[np.concatenate((breaks - 1, [values.size - 1]))] + 1
        return cls(tuple(zip(starts.tolist(), stops.tolist(), strict=True)))

    def __len__(self) -> int:
        return sum(stop - start for start, stop in self.ranges)

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def mask(self, ids: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Membership of each id in ``ids``, vectorised."""
        values = np.asarray(ids, dtype=np.int64)
        if not self.ranges:
            return np.zeros(values.shape, dtype=np.bool_)
        bounds = np.asarray(self.ranges, dtype=np.int64)
        at = np.searchsorted(bounds[:, 0], values, side="right") - 1
        return (at >= 0) & (values < bounds[np.maximum(at, 0), 1])

    def ids(self) -> npt.NDArray[np.int64]:
        if not self.ranges:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in self.ranges])

    def union(self, other: RowIdSet) -> RowIdSet:
        merged: list[tuple[int, int]] = []
        for start, stop in sorted(self.ranges + other.ranges):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
            else:
                merged.append((start, stop))
        return RowIdSet(tuple(merged))

    def to_json(self) -> list[list[int]]:
        return [[start, stop] for start, stop in self.ranges]

    @classmethod
    def from_json(cls, value: Any) -> RowIdSet:
        return cls(tuple((int(start), int(stop)) for start, stop in value))


# --- checksums --------------------------------------------------------------------------------


class ChecksumAlgorithm(enum.Enum):
    CRC32 = "crc32"
    SHA256 = "sha256"


class Hasher:
    """Incremental checksum; :attr:`value` is the self-describing string kept in manifests."""

    def __init__(self, algorithm: ChecksumAlgorithm = ChecksumAlgorithm.CRC32) -> None:
        self.algorithm = algorithm
        self._crc = 0
        self._sha = hashlib.sha256() if algorithm is ChecksumAlgorithm.SHA256 else None

    def update(self, data: bytes | bytearray | memoryview) -> None:
        if self._sha is None:
            self._crc = zlib_ng.crc32(data, self._crc)
        else:
            self._sha.update(data)

    @property
    def crc(self) -> int:
        """The CRC-32 so far, as a number (to combine parts of a file checksummed apart)."""
        return self._crc

    @property
    def value(self) -> str:
        digest = f"{self._crc:08x}" if self._sha is None else self._sha.hexdigest()
        return f"{self.algorithm.value}:{digest}"


def checksum_algorithm(checksum: str) -> ChecksumAlgorithm:
    """The algorithm named by a checksum string; unknown ones are a :class:`FormatError`."""
    name, _, digest = checksum.partition(":")
    try:
        algorithm = ChecksumAlgorithm(name)
    except ValueError:
        raise FormatError(f"unknown checksum algorithm in {checksum!r}") from None
    if not digest:
        raise FormatError(f"checksum {checksum!r} has no digest")
    return algorithm


def checksum_parts(
    view: memoryview, algorithm: ChecksumAlgorithm, parts: int, pool: Executor
) -> str:
    """The checksum of ``view``; CRC-32 is computed over ``parts`` slices at once on ``pool``
    (zlib releases the GIL) and combined, so verifying a large file is not one core's work."""
    if algorithm is not ChecksumAlgorithm.CRC32 or parts < 2:
        return checksum_of(view, algorithm)
    return checksum_started(view, algorithm, parts, pool)()


ARRIVAL_STEP = 4 << 20
"""Bytes checksummed between two reports of :class:`Arrival`: small enough that decoding follows
the read closely, large enough that the checksum thread rarely waits for the GIL between them."""


class Arrival:
    """How much of a file, from its start, has been read and checksummed, while that goes on.

    A restore decodes a sample segment's record batches as their bytes arrive rather than after
    the whole file: touching a memory-mapped page the sequential read has not reached yet reads
    the disk out of order and slowed the whole read by half. ``lengths`` are the parts checksummed
    at once; each reports its own progress and the prefix that is done is what has arrived.
    Decoding what has arrived is not trusting it: the checksum still decides whether it is used.
    """

    def __init__(self, lengths: Sequence[int]) -> None:
        self._lengths = list(lengths)
        self._done = [0] * len(self._lengths)
        self._changed = threading.Condition()

    def advance(self, part: int, done: int) -> None:
        """Part ``part`` has been read and checksummed through its ``done``-th byte."""
        with self._changed:
            self._done[part] = done
            self._changed.notify_all()

    def through(self) -> int:
        """Bytes from the file's start that have arrived."""
        total = 0
        for length, done in zip(self._lengths, self._done, strict=True):
            total += done
            if done < length:
                break
        return total

    def wait(self, offset: int) -> None:
        """Returns once the first ``offset`` bytes (or the whole file) have arrived, or their
        checksum has failed: a part reports itself done whatever happens to it."""
        offset = min(offset, sum(self._lengths))
        with self._changed:
            self._changed.wait_for(lambda: self.through() >= offset)


def _checksum_part(view: memoryview, hasher: Hasher, arrival: Arrival | None, part: int) -> Hasher:
    try:
        for start in range(0, len(view), ARRIVAL_STEP):
            hasher.update(view[start : start + ARRIVAL_STEP])
            if arrival is not None:
                arrival.advance(part, min(start + ARRIVAL_STEP, len(view)))
    finally:
        if arrival is not None:
            arrival.advance(part, len(view))
    return hasher


def checksum_started(
    view: memoryview,
    algorithm: ChecksumAlgorithm,
    parts: int,
    pool: Executor,
    arrival: Arrival | None = None,
) -> Callable[[], str]:
    """Starts the checksum of ``view`` on ``pool`` (in ``parts`` slices for CRC-32) and returns
    what waits for it: the caller decodes while the pool reads and checks the same bytes, each
    slice front to back, reporting to ``arrival`` (made by :func:`arrival_for`) as it goes."""
    lengths = _part_lengths(len(view), algorithm, parts)
    starts = itertools.accumulate(lengths, initial=0)
    slices = [view[start : start + n] for start, n in zip(starts, lengths, strict=False)]
    futures = [
        pool.submit(_checksum_part, piece, Hasher(algorithm), arrival, n)
        for n, piece in enumerate(slices)
    ]
    if len(futures) == 1:
        return lambda: futures[0].result().value

    def result() -> str:
        crc = futures[0].result().crc
        for piece, future in zip(slices[1:], futures[1:], strict=True):
            crc = zlib_ng.crc32_combine(crc, future.result().crc, len(piece))
        return f"{algorithm.value}:{crc:08x}"

    return result


def _part_lengths(size: int, algorithm: ChecksumAlgorithm, parts: int) -> list[int]:
    """How a file of ``size`` bytes is checksummed at once: ``parts`` about equal slices for
    CRC-32 (whose values combine), whole for any other algorithm or a single part."""
    if algorithm is not ChecksumAlgorithm.CRC32 or parts < 2:
        return [size]
    step = -(-size // parts)
    return [min(step, size - i) for i in range(0, size, step)]


def arrival_for(size: int, algorithm: ChecksumAlgorithm, parts: int) -> Arrival:
    """The :class:`Arrival` of a file of ``size`` bytes checksummed by :func:`checksum_started`
    with the same ``algorithm`` and ``parts``."""
    return Arrival(_part_lengths(size, algorithm, parts))


def checksum_of(
    data: bytes | bytearray | memoryview, algorithm: ChecksumAlgorithm = ChecksumAlgorithm.CRC32
) -> str:
    hasher = Hasher(algorithm)
    hasher.update(data)
    return hasher.value


# --- manifest ---------------------------------------------------------------------------------


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
