"""Group segments: ``GroupMeta`` <-> Arrow record batches of :data:`GROUP_SCHEMA`, one typed column
per field.

A restore decodes every live group, so decoding works on whole columns (one ``to_pylist`` or
numpy ``tolist`` per column) and fills each ``GroupMeta`` directly; nothing is parsed per group
but the prompt's ``metadata`` and ``messages``, and only where they are set. Group segments of
format 2 (:data:`GROUP_SCHEMA_V2`, a JSON document per group) are still read, with one JSON
parse for a whole batch.

Invariant: every field of ``GroupMeta``, ``Prompt`` and ``Position`` has its column. The module
refuses to load when a field was added without one, so a new field cannot be silently dropped
from snapshots.
"""

from __future__ import annotations

import dataclasses
import json
from collections import deque
from collections.abc import Iterator, Sequence
from itertools import repeat
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from rolloutd.checkpoint import sidecar
from rolloutd.checkpoint.format import BATCH_ROWS, GROUP_SCHEMA, GROUP_SCHEMA_V2, FormatError
from rolloutd.domain.group import GroupMeta, GroupState, Position, Prompt

_META_FIELDS = (
    "group_id",
    "prompt",
    "position",
    "group_size",
    "policy_version",
    "admitted_at",
    "seed",
    "state",
    "committed_at",
    "lease_id",
    "ack_step",
)
"""``GroupMeta``'s fields in declaration order, as :func:`batch_to_metas` fills them."""

_PROMPT_FIELDS = ("prompt_id", "text", "metadata", "messages")
_POSITION_FIELDS = ("epoch", "offset")

for _kind, _expected in (
    (GroupMeta, _META_FIELDS),
    (Prompt, _PROMPT_FIELDS),
    (Position, _POSITION_FIELDS),
):
    _declared = tuple(f.name for f in dataclasses.fields(_kind))
    if _declared != _expected or hasattr(_kind, "__post_init__"):
        raise ImportError(
            f"{_kind.__name__} declares {_declared}, group segments hold {_expected}: give each "
            "new field a column in GROUP_SCHEMA and in checkpoint/groups.py"
        )

_STATES = {s.value: s for s in GroupState}


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def _encode(metas: Sequence[GroupMeta]) -> pa.RecordBatch:
    prompts = [m.prompt for m in metas]
    positions = [m.position for m in metas]
    columns = [
        pa.array([m.group_id for m in metas], pa.int64()),
        pa.array([m.state.value for m in metas], pa.string()),
        pa.array([p.prompt_id for p in prompts], pa.string()),
        pa.array([p.text for p in prompts], pa.string()),
        pa.array([None if p.metadata is None else _json(p.metadata) for p in prompts], pa.string()),
        pa.array([_json(list(p.messages)) if p.messages else None for p in prompts], pa.string()),
        pa.array([None if p is None else p.epoch for p in positions], pa.int64()),
        pa.array([None if p is None else p.offset for p in positions], pa.int64()),
        pa.array([m.group_size for m in metas], pa.int32()),
        pa.array([m.policy_version for m in metas], pa.int64()),
        pa.array([m.admitted_at for m in metas], pa.float64()),
        pa.array([m.seed for m in metas], pa.int64()),
        pa.array([m.committed_at for m in metas], pa.float64()),
        pa.array([m.lease_id for m in metas], pa.string()),
        pa.array([m.ack_step for m in metas], pa.int64()),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=GROUP_SCHEMA)


def metas_to_batches(
    metas: Sequence[GroupMeta], *, batch_rows: int = BATCH_ROWS
) -> Iterator[pa.RecordBatch]:
    """Record batches of :data:`GROUP_SCHEMA`, one row per group, in the order given."""
    for start in range(0, len(metas), batch_rows):
        yield _encode(metas[start : start + batch_rows])


def _values(column: pa.Array) -> list[Any]:
    """A column as Python values: through numpy when it has no nulls (several times faster)."""
    if column.null_count == 0 and pa.types.is_primitive(column.type):
        return column.to_numpy().tolist()  # type: ignore[no-any-return]
    return column.to_pylist()  # type: ignore[no-any-return]


def _parsed(column: pa.Array, empty: Any) -> list[Any]:
    """JSON text per row, parsed; ``empty`` where null. The parse is one call for the batch."""
    if column.null_count == len(column):
        return [empty] * len(column)
    texts = column.to_pylist()
    values = iter(json.loads("[" + ",".join(t for t in texts if t is not None) + "]"))
    return [empty if t is None else next(values) for t in texts]


def _filled(kind: type, names: tuple[str, ...], columns: Sequence[Sequence[Any]]) -> list[Any]:
    """One instance of the frozen dataclass ``kind`` per row of ``columns`` (one per field of
    ``names``), each dict set directly: the loop runs in C (``map``, ``zip``, ``dict``), which
    costs half of a Python loop and a third of ``__init__`` per group. ``kind`` must run nothing
    after ``__init__``, and ``names`` must be all of its fields."""
    values = map(dict, map(zip, repeat(names), zip(*columns, strict=True)))
    instances: list[Any] = list(map(object.__new__, repeat(kind, len(columns[0]))))
    deque(map(object.__setattr__, instances, repeat("__dict__"), values), maxlen=0)
    return instances


def is_legacy(schema: pa.Schema) -> bool:
    """Whether a group segment has the JSON layout of format 2."""
    return bool(schema.remove_metadata() == GROUP_SCHEMA_V2.remove_metadata())


def batch_to_metas(
    batch: pa.RecordBatch, keep: npt.NDArray[np.bool_] | None = None
) -> list[GroupMeta]:
    """The groups of one batch of either layout (those where ``keep`` is true), in row order."""
    if keep is not None:
        batch = batch.filter(pa.array(keep))
    if is_legacy(batch.schema):
        return sidecar.decode_groups(batch.column("meta").to_pylist())
    if batch.schema.remove_metadata() != GROUP_SCHEMA.remove_metadata():
        raise FormatError(f"group segment schema differs from the group schema: {batch.schema}")
    col = batch.column
    metadata = _parsed(col("prompt_metadata"), None)
    messages = [tuple(m) for m in _parsed(col("prompt_messages"), ())]
    prompt_ids = col("prompt_id").to_pylist()
    prompts = _filled(
        Prompt, _PROMPT_FIELDS, (prompt_ids, col("prompt_text").to_pylist(), metadata, messages)
    )
    epochs, offsets = _values(col("epoch")), _values(col("offset"))
    if col("epoch").null_count == 0:
        positions = _filled(Position, _POSITION_FIELDS, (epochs, offsets))
    else:
        positions = [
            None if e is None else Position(e, o) for e, o in zip(epochs, offsets, strict=True)
        ]
    columns = (
        _values(col("group_id")),
        prompts,
        positions,
        _values(col("group_size")),
        _values(col("policy_version")),
        _values(col("admitted_at")),
        _values(col("seed")),
        list(map(_STATES.__getitem__, col("state").to_pylist())),
        _values(col("committed_at")),
        _values(col("lease_id")),
        _values(col("ack_step")),
    )
    metas: list[GroupMeta] = _filled(GroupMeta, _META_FIELDS, columns)
    return metas
