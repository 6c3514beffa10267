"""Segment rows in Arrow: the schemas of sample and group segments, and the sample row codec.

Sample segments hold :data:`SAMPLE_SCHEMA`; group segments :data:`GROUP_SCHEMA` (groups.py holds
their codec). Encoding and decoding work on whole buffers (one ``bytes.join`` per column and
batch on write, one slice per row on read), never token by token, so they run near memory speed.
"""

from __future__ import annotations

import enum
import itertools
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from rolloutd.checkpoint.format import FORMAT_VERSION, FormatError
from rolloutd.domain.episode import EpisodeEnd
from rolloutd.domain.group import Sample

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
        pa.field("scores", pa.string()),
        pa.field("source", pa.int32()),
        pa.field("prompt_generation", pa.string()),
        pa.field("generation", pa.string()),
        pa.field("prompt_tools", pa.string()),
    ],
    metadata={b"rolloutd.format_version": str(FORMAT_VERSION).encode()},
)
"""One row per group whose metadata changed, a column per ``GroupMeta`` field (groups.py holds
the codec, which refuses to load if a field has no column): a restore reads whole columns, not
one JSON document per group. ``position`` is ``epoch`` and ``offset`` (null: none); the prompt's
``metadata`` (any JSON value) and ``messages`` are JSON text, null when None or empty.
``group_id`` is the row id: a later snapshot that changes or drops a group lists it as removed
from the segment that held it, so each group is live in one segment. ``scores`` (format 4) is
the finishing stage's record as JSON, ``{"mean", "std", "samples": [[reward, status, info]]}``
(null: unscored). Format 5 adds the position's ``source`` (null: 0), the prompt's own
``prompt_generation`` settings (JSON, null: none) and the group's effective sampling settings
``generation`` (JSON of ``SamplingParams``; null: the service's configured ones). Format 6 adds
the prompt's ``prompt_tools`` (JSON list of tool schemas; null: none)."""


def _without(schema: pa.Schema, names: tuple[str, ...], version: int) -> pa.Schema:
    for name in names:
        schema = schema.remove(schema.get_field_index(name))
    return schema.with_metadata({b"rolloutd.format_version": str(version).encode()})


GROUP_SCHEMA_V5 = _without(GROUP_SCHEMA, ("prompt_tools",), 5)
"""Group segments of format 5: no tools; read as prompts without tools."""
FORMAT_5_COLUMNS = ("source", "prompt_generation", "generation")
GROUP_SCHEMA_V4 = _without(GROUP_SCHEMA_V5, FORMAT_5_COLUMNS, 4)
"""Group segments of format 4: no per-prompt settings; read as the only source's, with the
service's configured settings."""
GROUP_SCHEMA_V3 = _without(GROUP_SCHEMA_V4, ("scores",), 3)
"""Group segments of format 3: format 4's columns but ``scores``; read as unscored groups."""

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
        if self is SegmentKind.SAMPLES:
            return (self.schema,)
        return (GROUP_SCHEMA, GROUP_SCHEMA_V5, GROUP_SCHEMA_V4, GROUP_SCHEMA_V3, GROUP_SCHEMA_V2)

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
                # a row stores an episode's end as its finish reason
                episode_end=EpisodeEnd.of_finish_reason(finish_reason[i]),
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
