"""The ack journal: what a client was told is durable, before the RPC returns.

Each record gets the next position; a snapshot records the last position it includes
(``acks_through``) and restore replays the records after it. Retention prunes records that every
kept snapshot covers. Locally records are JSON lines appended and fdatasynced (one file per run of
appends); on an object store each record is its own object, durable once its put returns.

Layout: ``journal/<position>-<token>.jsonl`` (local) or ``journal/<position>.json`` (object store).
The next issues grow this module to journal lease grants and submissions too.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rolloutd.checkpoint.backends import (
    JOURNAL,
    LocalBackend,
    ObjectBackend,
    StoreError,
    fsync_dir,
    makedirs,
)
from rolloutd.checkpoint.faults import FaultPoint, fault_point
from rolloutd.checkpoint.sidecar import from_json, to_json
from rolloutd.domain.buffer import AckRecord
from rolloutd.domain.group import Group
from rolloutd.domain.sampler import Admission
from rolloutd.domain.state import JournaledAck


class CorruptJournal(StoreError):
    """The ack journal lost or garbled a record that was acknowledged as durable."""


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
            makedirs(self._dir)
            # first position, then creation time: files sort in the order they were written
            name = f"{position:020d}-{time.time_ns():020d}-{secrets.token_hex(2)}.jsonl"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC
            self._fd = os.open(os.path.join(self._dir, name), flags, 0o644)
            fsync_dir(self._dir)
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
            fsync_dir(self._dir)
        return len(doomed)

    def rotate(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _ObjectJournal:
    """Object-store journal: one object per record, durable once its put returns."""

    def __init__(self, backend: ObjectBackend) -> None:
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


class Journal:
    """Serialised, durable appends at increasing positions, on the store's backend.

    ``floor`` is the newest snapshot's ``acks_through``: positions continue after it even when
    retention pruned every record.
    """

    def __init__(self, backend: LocalBackend | ObjectBackend, floor: int = 0) -> None:
        self._files: _FileJournal | _ObjectJournal = (
            _FileJournal(backend.root)
            if isinstance(backend, LocalBackend)
            else _ObjectJournal(backend)
        )
        self._lock = threading.Lock()
        self._position = max(self._files.last_position(), floor)

    @property
    def position(self) -> int:
        """Position of the last durable ack record; no I/O (capture it under the exclusive hold)."""
        return self._position

    def write(self, record: Mapping[str, Any]) -> int:
        """Journal ``record`` (JSON-able); it is durable when this returns its position.

        Appends are serialised; locally each costs one ``fdatasync``, on an object store one put.
        """
        with self._lock:
            position = self._position + 1
            try:
                self._files.append(position, record)
            except OSError:
                self._files.rotate()  # never append after what may be a torn record
                raise
            self._position = position
        fault_point(FaultPoint.JOURNAL_APPEND)
        return position

    def read(self, after: int = 0) -> list[JournalEntry]:
        """Records with a position after ``after`` (a manifest's ``acks_through``), in order."""
        with self._lock:
            entries = self._files.read(after)
        positions = [e.position for e in entries]
        if positions != list(range(after + 1, after + 1 + len(entries))):
            missing = sorted(set(range(after + 1, positions[-1] + 1)) - set(positions))
            raise CorruptJournal(f"{JOURNAL}: records missing after {after}: {missing[:10]}")
        return entries

    def prune(self, through: int) -> int:
        """Delete records at positions up to ``through`` where whole files/objects allow."""
        with self._lock:
            return self._files.prune(through)

    # --- acks (the domain's AckJournal port) --------------------------------------------------

    async def append(self, record: AckRecord, groups: Sequence[Group]) -> None:
        """Journals an ack with the admission of each of its groups; durable on return."""
        await asyncio.to_thread(self.write, encode_ack(record, groups))

    def acks_after(self, after: int) -> list[JournaledAck]:
        """The acks journaled after position ``after``, in order."""
        return [decode_ack(entry.record) for entry in self.read(after)]


def encode_ack(record: AckRecord, groups: Sequence[Group]) -> dict[str, Any]:
    return {
        **to_json(record),
        "groups": [
            {"group_id": g.group_id, **to_json(Admission(g.meta.prompt, g.meta.position))}
            for g in groups
        ],
    }


def decode_ack(d: Mapping[str, Any]) -> JournaledAck:
    return JournaledAck(
        from_json(AckRecord, d),
        {int(g["group_id"]): from_json(Admission, g) for g in d["groups"]},
    )
