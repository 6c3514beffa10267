"""Partial siblings in a snapshot: the tokens of siblings still generating, one Arrow IPC file.

A snapshot lists at most one partials file (``Manifest.partials``), written in ``buffer_save``
from the cut the exclusive hold took (joining each sibling's deltas happens here, outside the
hold). Unlike segments the file is not shared with later snapshots: partial siblings change at
every checkpoint, so each snapshot writes all of its own, and a snapshot without one restores
every unfinished sibling from its first token.

One row per partial sibling (:data:`PARTIAL_SCHEMA`): the group id and index, the token ids and
logprobs so far, and its parts as two parallel lists (first token offset, policy version). The
same file carries, for every live row whose sample was resumed, where it was resumed and its
parts, so a second restart still delivers them (the checkpointer keeps that small table and
writes it whole with each snapshot).
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa

from rolloutd.checkpoint import episode_records
from rolloutd.checkpoint.backends import Backend, CorruptSnapshot
from rolloutd.checkpoint.checksums import ChecksumAlgorithm
from rolloutd.checkpoint.faults import FaultPoint, fault_point
from rolloutd.checkpoint.manifest import FileEntry
from rolloutd.checkpoint.rows import Row
from rolloutd.checkpoint.segments import SegmentWriter
from rolloutd.domain.group import SamplePart, TurnKind, TurnSpan
from rolloutd.domain.partial import PartialSibling

PARTIALS_FORMAT = 2
"""Format 2 adds ``turn`` and ``episode`` (a sibling's episode records); files of format 1 are
read as siblings that are no episodes."""

PARTIAL_SCHEMA = pa.schema(
    [
        pa.field("row_id", pa.int64(), nullable=False),
        pa.field("group_id", pa.int64(), nullable=False),
        pa.field("index", pa.int32(), nullable=False),
        pa.field("resumed_at", pa.int32(), nullable=False),
        pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("part_starts", pa.list_(pa.int32()), nullable=False),
        pa.field("part_versions", pa.list_(pa.int64()), nullable=False),
        pa.field("turn", pa.int32()),
        pa.field("episode", pa.string()),
    ],
    metadata={b"rolloutd.partials_format": str(PARTIALS_FORMAT).encode()},
)
PARTIAL_SCHEMA_V1 = pa.schema(list(PARTIAL_SCHEMA)[:-2])
"""Format 1: no episodes."""
"""A partial sibling has ``row_id`` 0 (it is no row yet), its tokens and logprobs and its parts.
A live row whose sample was resumed has its ``row_id``, ``resumed_at`` and parts, and no tokens:
those are in its segment, whose schema does not hold where a sample was resumed. An episode's
sibling has the model ``turn`` its tokens belong to and its durable records so far
(``episode``: a JSON list, ``checkpoint/episode_records.py``), or nulls when it is no episode;
a resumed row also carries its episode's spans, reward and mismatches there (JSON object)."""


@dataclass(frozen=True)
class ResumedRow:
    """Where a staged sample was resumed and the policy version of each part (see ``Sample``),
    and an episode's spans, reward and mismatches (segments hold none of these)."""

    resumed_at: int
    """-1: an episode's sample that was not resumed."""
    parts: tuple[SamplePart, ...]
    turns: tuple[TurnSpan, ...] = ()
    episode_reward: float | None = None
    retokenization_mismatches: int = 0

    def episode_json(self) -> str | None:
        if not self.turns:
            return None
        return json.dumps(
            {
                "turns": [[t.start, t.kind.value] for t in self.turns],
                "reward": self.episode_reward,
                "mismatches": self.retokenization_mismatches,
            }
        )


def resumed_rows(rows: Iterable[Row]) -> dict[int, ResumedRow]:
    """Row id -> resume record of the resumed samples and episodes among ``rows``."""
    return {
        row_id: ResumedRow(
            -1 if s.resumed_at is None else s.resumed_at,
            s.parts,
            s.turns,
            s.episode_reward,
            s.retokenization_mismatches,
        )
        for row_id, _, s in rows
        if s.resumed_at is not None or s.turns
    }


def _episode_json(p: PartialSibling) -> str | None:
    if p.turn is None and not p.episode_count:
        return None
    return json.dumps([episode_records.to_json(r) for r in p.episode_records])


def to_batch(
    partials: Sequence[PartialSibling], resumed: Mapping[int, ResumedRow]
) -> pa.RecordBatch:
    """Partial siblings then resumed rows, as one record batch; each sibling's deltas are joined
    here."""
    tokens = [np.frombuffer(p.token_ids(), np.int32) for p in partials]
    logprobs = [np.frombuffer(p.logprobs(), np.float32) for p in partials]
    parts = [p.parts() for p in partials] + [r.parts for r in resumed.values()]
    empty_i, empty_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
    return pa.RecordBatch.from_arrays(
        [
            pa.array([0] * len(partials) + list(resumed), pa.int64()),
            pa.array([p.group_id for p in partials] + [0] * len(resumed), pa.int64()),
            pa.array([p.index for p in partials] + [0] * len(resumed), pa.int32()),
            pa.array([0] * len(partials) + [r.resumed_at for r in resumed.values()], pa.int32()),
            pa.array(tokens + [empty_i] * len(resumed), pa.list_(pa.int32())),
            pa.array(logprobs + [empty_f] * len(resumed), pa.list_(pa.float32())),
            pa.array([[x.start for x in ps] for ps in parts], pa.list_(pa.int32())),
            pa.array([[x.policy_version for x in ps] for ps in parts], pa.list_(pa.int64())),
            pa.array([p.turn for p in partials] + [None] * len(resumed), pa.int32()),
            pa.array(
                [_episode_json(p) for p in partials] + [r.episode_json() for r in resumed.values()],
                pa.string(),
            ),
        ],
        schema=PARTIAL_SCHEMA,
    )


def from_table(table: pa.Table) -> tuple[list[PartialSibling], dict[int, ResumedRow]]:
    """The partial siblings and resumed rows a file holds; a row that does not hold together
    raises ValueError."""
    partials, resumed = [], {}
    for row in table.to_pylist():
        parts = tuple(
            SamplePart(start, version)
            for start, version in zip(row["part_starts"], row["part_versions"], strict=True)
        )
        episode = json.loads(row["episode"]) if row.get("episode") else None
        if row["row_id"]:
            resumed[row["row_id"]] = ResumedRow(
                row["resumed_at"],
                parts,
                *(
                    (
                        tuple(TurnSpan(a, TurnKind(k)) for a, k in episode["turns"]),
                        episode["reward"],
                        int(episode["mismatches"]),
                    )
                    if episode
                    else ()
                ),
            )
            continue
        records = tuple(map(episode_records.from_json, episode or ()))
        if row["token_ids"]:
            partial = PartialSibling.of(
                row["group_id"],
                row["index"],
                array("i", row["token_ids"]),
                array("f", row["logprobs"]),
                parts,
            )
        else:
            partial = PartialSibling(row["group_id"], row["index"], (), 0)
        partials.append(
            replace(partial, turn=row.get("turn"), episode=records, episode_count=len(records))
        )
    return partials, resumed


def write(
    backend: Backend,
    path: str,
    partials: Sequence[PartialSibling],
    resumed: Mapping[int, ResumedRow],
    checksum: ChecksumAlgorithm,
) -> FileEntry:
    """Write ``partials`` and ``resumed`` as the Arrow IPC file ``path``; whole and durable when
    this returns."""
    sink = backend.sink(path)
    out = SegmentWriter(sink, checksum)
    try:
        with pa.ipc.new_file(pa.PythonFile(out, mode="w"), PARTIAL_SCHEMA) as writer:
            writer.write_batch(to_batch(partials, resumed))
            fault_point(FaultPoint.BUFFER_SAVE_MID)
        sink.commit()
    except BaseException:
        sink.abort()
        raise
    return out.entry(path)


def read(buffer: pa.Buffer, entry: FileEntry) -> tuple[list[PartialSibling], dict[int, ResumedRow]]:
    """The partial siblings and resumed rows of a (checksum-verified) file;
    :class:`CorruptSnapshot` if it is not one this format wrote."""
    try:
        table = pa.ipc.open_file(buffer).read_all()
        if table.schema.remove_metadata() not in (
            PARTIAL_SCHEMA.remove_metadata(),
            PARTIAL_SCHEMA_V1.remove_metadata(),
        ):
            raise ValueError("schema differs from the partials schema")
        return from_table(table)
    except (pa.ArrowInvalid, ValueError) as exc:
        raise CorruptSnapshot(-1, [f"{entry.path}: not a readable partials file: {exc}"]) from exc
