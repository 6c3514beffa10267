"""The finalized-lease ledger in snapshots: immutable pieces that later snapshots list again.

The ledger maps each finalized lease to its trainer step, so that a trainer re-acking a lease
after a restart gets the answer it got before (exactly-once acks). It holds the newest
:data:`ACKED_LEASES_REMEMBERED` leases, tens of thousands under many trainers; rewriting it in
every sidecar made each checkpoint cost the run's age (megabytes of JSON and copying on the event
loop). A snapshot instead writes only the leases finalized since its parent, as a piece of its
own, and lists its parent's pieces unchanged; the sidecar holds none of it.

Layout: ``ledger/<sequence>-<token>.arrow``, an Arrow IPC stream of :data:`SCHEMA` (lease id,
trainer step), rows oldest first; ``pyarrow.ipc.open_stream`` reads it. Arrow rather than JSON
Lines: 65,536 leases encode in a few milliseconds instead of tens. A manifest lists its pieces
oldest first (:class:`LedgerEntry`) with their size and checksum: a piece that is missing or does
not verify makes the snapshot corrupt, and restore falls back to an older one.

Merging bounds the number of pieces as submissions.py does: the new piece absorbs the newest
parent pieces while the older one is at most twice the bytes merged so far. Unlike submitted
prompts the ledger is bounded, so a merged piece keeps only its newest ``ACKED_LEASES_REMEMBERED``
rows, and the oldest pieces are no longer listed once the newer ones hold that many rows. Restore
rebuilds the ledger oldest first and keeps the newest ``ACKED_LEASES_REMEMBERED`` leases, as the
live buffer does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import replace

import pyarrow as pa

from rolloutd.checkpoint.backends import LEDGER, Backend, CorruptSnapshot, file_name
from rolloutd.checkpoint.checksums import ChecksumAlgorithm
from rolloutd.checkpoint.manifest import LedgerEntry
from rolloutd.checkpoint.submissions import merge_from, read_verified, write_piece
from rolloutd.domain.ledger import ACKED_LEASES_REMEMBERED, remember_finalized
from rolloutd.domain.snapshot import ControllerState

SCHEMA = pa.schema([("lease_id", pa.string()), ("trainer_step", pa.int64())])


def table(finalized: Mapping[str, int]) -> pa.Table:
    """Leases in their order, one row each."""
    return pa.table(
        [pa.array(finalized.keys(), pa.string()), pa.array(finalized.values(), pa.int64())],
        schema=SCHEMA,
    )


def encode(rows: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, SCHEMA) as writer:
        writer.write_table(rows)
    return sink.getvalue().to_pybytes()


def decode(data: bytes, piece: LedgerEntry) -> pa.Table:
    """The rows of a verified piece; :class:`CorruptSnapshot` if they are not what it lists."""
    path = piece.file.path
    try:
        rows = pa.ipc.open_stream(data).read_all()
    except (pa.ArrowInvalid, OSError) as exc:
        raise CorruptSnapshot(-1, [f"{path}: not a ledger piece: {exc}"]) from exc
    if not rows.schema.equals(SCHEMA):
        raise CorruptSnapshot(-1, [f"{path}: schema {rows.schema}, expected {SCHEMA}"])
    if rows.num_rows != piece.count:
        raise CorruptSnapshot(-1, [f"{path}: {rows.num_rows} leases, manifest says {piece.count}"])
    return rows


def _rows(backend: Backend, pieces: Sequence[LedgerEntry]) -> pa.Table:
    tables = [decode(read_verified(backend, p.file), p) for p in pieces]
    return pa.concat_tables(tables) if tables else table({})


def _newest(rows: pa.Table, bound: int) -> pa.Table:
    return rows.slice(max(0, rows.num_rows - bound))


def read(
    backend: Backend, pieces: Sequence[LedgerEntry], bound: int = ACKED_LEASES_REMEMBERED
) -> OrderedDict[str, int]:
    """The ledger the pieces hold, oldest first, at most ``bound`` newest leases; each piece is
    verified."""
    rows = _newest(_rows(backend, pieces), bound)
    ledger: OrderedDict[str, int] = OrderedDict()
    return remember_finalized(
        ledger,
        dict(zip(rows["lease_id"].to_pylist(), rows["trainer_step"].to_pylist(), strict=True)),
    )


def extend(
    backend: Backend,
    checksum: ChecksumAlgorithm,
    sequence: int,
    parent: Sequence[LedgerEntry],
    finalized: Mapping[str, int],
    bound: int = ACKED_LEASES_REMEMBERED,
) -> tuple[LedgerEntry, ...]:
    """The pieces of snapshot ``sequence``: ``parent``'s, plus one written for ``finalized``
    (the leases finalized since, oldest first), merged with the newest parent pieces it absorbs,
    without the oldest pieces whose every lease is beyond ``bound``. The new file is whole and
    durable on return but listed by no manifest yet; retention collects it if the snapshot is
    never published. Parent pieces being merged are read back verified (:class:`CorruptSnapshot`
    when one does not)."""
    if not finalized:
        return tuple(parent)
    rows = _newest(table(finalized), bound)
    data = encode(rows)
    start = merge_from(parent, len(data))  # the encoded size: small pieces are mostly header
    absorbed = parent[start:]
    if absorbed:
        rows = _newest(pa.concat_tables([_rows(backend, absorbed), rows]), bound)
        data = encode(rows)
    entry = write_piece(backend, checksum, f"{LEDGER}/{file_name(sequence, '.arrow')}", data)
    kept = list(parent[:start])
    newer = rows.num_rows
    while kept and newer + sum(p.count for p in kept[1:]) >= bound:
        kept.pop(0)
    return (*kept, LedgerEntry(entry, rows.num_rows, sequence))


def attach(state: ControllerState, ledger: Mapping[str, int]) -> ControllerState:
    """``state`` (a decoded sidecar) with the ledger of its snapshot's pieces. A sidecar of an
    earlier version holds its ledger itself and its snapshot has no pieces: it stays as it is."""
    if not ledger:
        return state
    return replace(state, ledger=replace(state.ledger, finalized_leases=ledger))
