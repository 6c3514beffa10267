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
import pyarrow.compute as pc

from rolloutd.checkpoint import sidecar
from rolloutd.checkpoint.format import FormatError
from rolloutd.checkpoint.rows import (
    BATCH_ROWS,
    GROUP_SCHEMA,
    GROUP_SCHEMA_V2,
    GROUP_SCHEMA_V3,
    GROUP_SCHEMA_V4,
    GROUP_SCHEMA_V5,
)
from rolloutd.domain.group import (
    STATES,
    UNFINISHED,
    GroupMeta,
    GroupScores,
    GroupState,
    GroupTable,
    Position,
    Prompt,
    SampleScore,
    ScoreFailure,
    ScoreStatus,
)
from rolloutd.domain.spec import EMPTY, GenerationSpec, SamplingParams

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
    "scores",
    "params",
)
"""``GroupMeta``'s fields in declaration order, as :func:`batch_to_metas` fills them."""

_PROMPT_FIELDS = ("prompt_id", "text", "metadata", "messages", "generation", "tools")
_POSITION_FIELDS = ("epoch", "offset", "source")

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
_STATE_VALUES = pa.array([s.value for s in STATES])
"""State names in the order of their codes in a :class:`GroupTable`."""


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
        pa.array(
            [None if m.scores is None else _scores_json(m.scores) for m in metas], pa.string()
        ),
        pa.array([None if p is None else p.source for p in positions], pa.int32()),
        pa.array([_json(p.generation.to_json()) if p.generation else None for p in prompts]),
        pa.array([None if m.params is None else _params_json(m.params) for m in metas]),
        pa.array([_json(list(p.tools)) if p.tools else None for p in prompts], pa.string()),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=GROUP_SCHEMA)


def _scores_json(scores: GroupScores) -> str:
    samples = [
        [s.reward, s.status.value, s.info]
        if s.failure is None
        else [s.reward, s.status.value, s.info, s.failure.value]
        for s in scores.samples
    ]
    return _json({"mean": scores.mean, "std": scores.std, "samples": samples})


def _score(reward: float | None, status: str, info: str, *failure: str) -> SampleScore:
    """A score as ``_scores_json`` wrote it: ``[reward, status, info]`` and, for a failure of a
    known kind, its kind. A snapshot written before scores carried their kind has it only as the
    start of the failed score's ``info`` (``"<kind>: ..."``), read back here."""
    if failure:
        return SampleScore(reward, ScoreStatus(status), info, ScoreFailure(failure[0]))
    if status == ScoreStatus.FAILED.value:
        kind = info.partition(":")[0]
        known = {f.value: f for f in ScoreFailure}.get(kind)
        return SampleScore(reward, ScoreStatus.FAILED, info, known)
    return SampleScore(reward, ScoreStatus(status), info)


def _scores(record: dict[str, Any] | None) -> GroupScores | None:
    if record is None:
        return None
    samples = tuple(_score(*r) for r in record["samples"])
    return GroupScores(samples, record["mean"], record["std"])


def _params_json(params: SamplingParams) -> str:
    return _json(dataclasses.asdict(params))


_PARAMS: dict[str, SamplingParams] = {}
"""Settings by their JSON: groups share a few, and a restore decodes each only once."""


def _params(text: str | None) -> SamplingParams | None:
    if text is None:
        return None
    params = _PARAMS.get(text)
    if params is None:
        record = json.loads(text)
        params = SamplingParams(**{**record, "stop": tuple(record["stop"])})
        if len(_PARAMS) < 4096:
            _PARAMS[text] = params
    return params


def _current(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A batch of :data:`GROUP_SCHEMA`: one of an earlier format gets null columns for what it
    lacks (format 3: ``scores``; formats 3 and 4: the source and the generation settings;
    formats 3 to 5: the prompt's tools)."""
    schema = batch.schema.remove_metadata()
    if schema in (
        GROUP_SCHEMA_V3.remove_metadata(),
        GROUP_SCHEMA_V4.remove_metadata(),
        GROUP_SCHEMA_V5.remove_metadata(),
    ):
        columns = [
            batch.column(f.name) if f.name in schema.names else pa.nulls(batch.num_rows, f.type)
            for f in GROUP_SCHEMA
        ]
        return pa.RecordBatch.from_arrays(columns, schema=GROUP_SCHEMA)
    if schema != GROUP_SCHEMA.remove_metadata():
        raise FormatError(f"group segment schema differs from the group schema: {batch.schema}")
    return batch


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
    col = _current(batch).column
    metadata = _parsed(col("prompt_metadata"), None)
    messages = [tuple(m) for m in _parsed(col("prompt_messages"), ())]
    prompt_ids = col("prompt_id").to_pylist()
    specs = [
        GenerationSpec.from_json(g) if g else EMPTY for g in _parsed(col("prompt_generation"), None)
    ]
    tools = [tuple(t) for t in _parsed(col("prompt_tools"), ())]
    prompts = _filled(
        Prompt,
        _PROMPT_FIELDS,
        (prompt_ids, col("prompt_text").to_pylist(), metadata, messages, specs, tools),
    )
    epochs, offsets = _values(col("epoch")), _values(col("offset"))
    sources = _values(col("source").fill_null(0))
    if col("epoch").null_count == 0:
        positions = _filled(Position, _POSITION_FIELDS, (epochs, offsets, sources))
    else:
        positions = [
            None if e is None else Position(e, o, s)
            for e, o, s in zip(epochs, offsets, sources, strict=True)
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
        list(map(_scores, _parsed(col("scores"), None))),
        list(map(_params, col("generation").to_pylist())),
    )
    metas: list[GroupMeta] = _filled(GroupMeta, _META_FIELDS, columns)
    return metas


def table_of(batches: Sequence[tuple[pa.RecordBatch, npt.NDArray[np.bool_] | None]]) -> GroupTable:
    """The live groups of group-segment batches (those each ``keep`` mask keeps) as a
    :class:`GroupTable` over their columns, each group's metadata decoded from its row when
    first read. Batches of format 2 (JSON per group) are decoded whole."""
    if any(is_legacy(b.schema) for b, _ in batches):
        return GroupTable.of([m for b, keep in batches for m in batch_to_metas(b, keep)])
    kept = [_current(b if keep is None else b.filter(pa.array(keep))) for b, keep in batches]
    whole = pa.concat_batches(kept) if kept else pa.RecordBatch.from_pylist([], GROUP_SCHEMA)
    return _Columns(whole)


def _array(column: pa.Array, dtype: type[np.generic], null: Any = None) -> npt.NDArray[Any]:
    if null is not None:
        column = column.fill_null(null)
    return column.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


class _Columns(GroupTable):
    """:func:`table_of`: a table over one batch of :data:`GROUP_SCHEMA`, answering from numpy
    views of its columns and decoding a group from its row when it is read. A missing position
    has epoch -1; a missing commit time is NaN."""

    def __init__(self, batch: pa.RecordBatch) -> None:
        col = batch.column
        codes = pc.index_in(col("state"), value_set=_STATE_VALUES)
        if codes.null_count:
            raise FormatError(f"group segment holds an unknown state: {col('state').unique()}")
        self._ids = _array(col("group_id"), np.int64)
        self._states = _array(codes, np.int8)
        self._epochs = _array(col("epoch"), np.int64, -1)
        self._offsets = _array(col("offset"), np.int64, -1)
        self._sources = _array(col("source"), np.int64, 0)
        self._committed_at = _array(col("committed_at"), np.float64)
        policy_versions = _array(col("policy_version"), np.int64)
        super().__init__(self._ids.tolist(), self._states.tolist(), policy_versions.tolist())
        self._batch = batch

    def meta_at(self, row: int) -> GroupMeta:
        [meta] = batch_to_metas(self._batch.slice(row, 1))
        return meta

    def counts(self) -> dict[GroupState, int]:
        n = np.bincount(self._states, minlength=len(STATES)).tolist()
        return dict(zip(STATES, n, strict=True))

    def positions_from(self, epoch: int, offset: int, source: int = 0) -> list[Position]:
        e, o = self._epochs, self._offsets
        at = ((e > epoch) | ((e == epoch) & (o >= offset))) & (self._sources == source)
        return [Position(e, o, source) for e, o in zip(e[at].tolist(), o[at].tolist(), strict=True)]

    def unfinished(self) -> list[int]:
        at = np.isin(self._states, [STATES.index(s) for s in UNFINISHED])
        return self._ids[at].tolist()  # type: ignore[no-any-return]

    def committed_order(self) -> list[int]:
        at = self._states == STATES.index(GroupState.COMMITTED)
        ids, committed = self._ids[at], np.nan_to_num(self._committed_at[at], nan=0.0)
        return ids[np.lexsort((ids, committed))].tolist()  # type: ignore[no-any-return]
