"""The journal: what a client was told is durable, before the RPC returns.

Five kinds of record, one sequence of positions: acks, lease grants, accepted submissions,
rewinds, and reservations of group ids (``kind`` in each record; a record without one is an ack). A snapshot
records the last position it includes (``acks_through``) and restore replays the records after
it, on top of nothing when there is no snapshot yet. Retention prunes what every kept snapshot
covers, at each checkpoint.

Group commit: writers that arrive while a sync is in progress queue up; the next sync makes the
whole queue durable at once (one ``fdatasync`` locally, one put on an object store), so the cost
of durability is shared by concurrent acks, lease grants and submissions. Writers queue from the
event loop (:meth:`Journal.enqueue`, behind the domain's ``DeliveryJournal`` port): records cost
no thread until their batch is written, one worker thread per batch, and the position a
checkpoint reads moves in the loop together with the writers' futures, so a capture sees exactly
the records whose writers were told "durable".

Layout: ``journal/<first position>-<token>.jsonl`` locally (JSON lines appended; one file per run
of appends), ``journal/<first>-<last>.jsonl`` on an object store (one object per batch).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
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
from rolloutd.domain.buffer import AckRecord, Lease
from rolloutd.domain.group import Prompt
from rolloutd.domain.sampler import Admission
from rolloutd.domain.state import (
    IdReservation,
    Journaled,
    JournaledAck,
    JournaledLease,
    JournaledRewind,
    JournaledSubmission,
)


class CorruptJournal(StoreError):
    """The journal lost or garbled a record that was acknowledged as durable."""


@dataclass(frozen=True)
class JournalEntry:
    """One durable record at its journal position (positions increase by one per record)."""

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

    def append(self, position: int, records: Sequence[Mapping[str, Any]]) -> None:
        """Appends ``records`` at ``position`` onwards with one ``fdatasync``."""
        if self._fd < 0:
            makedirs(self._dir)
            # first position, then creation time: files sort in the order they were written
            name = f"{position:020d}-{time.time_ns():020d}-{secrets.token_hex(2)}.jsonl"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC
            self._fd = os.open(os.path.join(self._dir, name), flags, 0o644)
            fsync_dir(self._dir)
        data = b"".join(
            _encode_record(position + i, record) + b"\n" for i, record in enumerate(records)
        )
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
    """Object-store journal: one object per batch of records, durable once its put returns.

    An object is named after its first and last position; a batch retried after a failed put
    may overlap an earlier object, and the later one (the one acknowledged) wins on read.
    """

    def __init__(self, backend: ObjectBackend) -> None:
        self._backend = backend

    def _batches(self) -> list[tuple[int, int, str]]:
        batches = []
        for name in self._backend.listdir(JOURNAL):
            stem, _, suffix = name.partition(".")
            if suffix not in ("json", "jsonl"):
                continue
            first, _, last = stem.partition("-")
            batches.append((int(first), int(last or first), name))
        return sorted(batches)

    def last_position(self) -> int:
        return max((last for _, last, _ in self._batches()), default=0)

    def append(self, position: int, records: Sequence[Mapping[str, Any]]) -> None:
        last = position + len(records) - 1
        data = b"".join(
            _encode_record(position + i, record) + b"\n" for i, record in enumerate(records)
        )
        self._backend.put(f"{JOURNAL}/{position:020d}-{last:020d}.jsonl", data)

    def read(self, after: int) -> list[JournalEntry]:
        paths = [f"{JOURNAL}/{n}" for _, last, n in self._batches() if last > after]
        entries: dict[int, JournalEntry] = {}
        for data in self._backend.read_many(paths):
            for line in data.split(b"\n"):
                if line:
                    entry = _decode_record(line)
                    if entry.position > after:
                        entries[entry.position] = entry
        return [entries[p] for p in sorted(entries)]

    def prune(self, through: int) -> int:
        doomed = [f"{JOURNAL}/{n}" for _, last, n in self._batches() if last <= through]
        self._backend.delete(doomed)
        return len(doomed)

    def rotate(self) -> None:
        """Nothing to do: every batch is its own object."""


class Journal:
    """Serialised, durable appends at increasing positions, on the store's backend.

    ``floor`` is the newest snapshot's ``acks_through``: positions continue after it even when
    retention pruned every record.
    """

    def __init__(
        self,
        backend: LocalBackend | ObjectBackend,
        floor: int = 0,
        *,
        guard: Callable[[], None] | None = None,
    ) -> None:
        self._files: _FileJournal | _ObjectJournal = (
            _FileJournal(backend.root)
            if isinstance(backend, LocalBackend)
            else _ObjectJournal(backend)
        )
        self._lock = threading.Lock()
        """Held while the files are written or read."""
        self._position = max(self._files.last_position(), floor)
        """Position of the last record written; moves in the writing thread."""
        self._durable = self._position
        """What :attr:`position` reports (see there)."""
        self._batch: list[tuple[Mapping[str, Any], asyncio.Future[int]]] = []
        """Records queued from the event loop for the next batch, with their writers' futures."""
        self._flushing: asyncio.Task[None] | None = None
        self._guard = guard
        """Raises instead of letting a write through (a process fenced off the store)."""
        self.syncs = 0
        """Syncs (local) or puts (object store) so far: fewer than records under concurrency."""

    @property
    def position(self) -> int:
        """Position of the last durable record whose writer has been told; no I/O (capture it
        under the exclusive hold). It moves in the event loop in the same step as the writers'
        futures resolve: every record at or before it has a resolved future, every record after
        it an unresolved one."""
        return self._durable

    def enqueue(self, record: Mapping[str, Any]) -> asyncio.Future[int]:
        """Queues ``record`` (JSON-able) for the next batch, from the event loop and without
        I/O; the future resolves with its position once it is durable, or with the batch's error.

        One flush task writes batch after batch: whatever is queued while a batch syncs goes in
        the next one, however many writers there are. A failed batch fails every writer in it,
        and nothing after it is appended to the same file (it may end in a torn record).
        """
        loop = asyncio.get_running_loop()
        durable: asyncio.Future[int] = loop.create_future()
        self._batch.append((record, durable))
        if self._flushing is None:
            self._flushing = loop.create_task(self._flush(), name="rolloutd-journal-flush")
        return durable

    async def _flush(self) -> None:
        try:
            while self._batch:
                batch, self._batch = self._batch, []
                try:
                    first = await asyncio.to_thread(self._append, [r for r, _ in batch])
                except Exception as exc:  # delivered to every writer of the batch
                    for _, durable in batch:
                        if not durable.done():
                            durable.set_exception(exc)
                    continue
                fault_point(FaultPoint.JOURNAL_APPEND)
                # no await from here on: the position and the futures move together
                self._durable = max(self._durable, first + len(batch) - 1)
                for i, (_, durable) in enumerate(batch):
                    if not durable.done():
                        durable.set_result(first + i)
        finally:
            self._flushing = None

    def _append(self, records: list[Mapping[str, Any]]) -> int:
        """Writes ``records`` durably after the last position; returns the first one's."""
        with self._lock:
            if self._guard is not None:
                self._guard()
            first = self._position + 1
            try:
                self._files.append(first, records)
            except OSError:
                self._files.rotate()  # never append after what may be a torn record
                raise
            self._position = first + len(records) - 1
            self.syncs += 1
            return first

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

    # --- the domain's DeliveryJournal port -------------------------------------------------

    def ack(self, record: AckRecord, admissions: Mapping[int, Admission]) -> asyncio.Future[int]:
        """Queues an ack with the admission of each of its groups (no I/O); the future
        resolves once it is durable."""
        return self.enqueue(encode_ack(record, admissions))

    def lease(self, lease: Lease, admissions: Mapping[int, Admission]) -> asyncio.Future[int]:
        """Queues a lease grant with the admission of each of its groups (no I/O); the future
        resolves once it is durable."""
        return self.enqueue({"kind": LEASE, **to_json(lease), "groups": _admissions(admissions)})

    async def submit(self, prompts: Sequence[Prompt]) -> None:
        """Journals accepted prompts; durable on return."""
        await self.enqueue({"kind": SUBMIT, "prompts": to_json(list(prompts))})

    async def rewind(self, trainer_step: int) -> None:
        """Journals a ``Rewind(trainer_step)``; durable on return."""
        await self.enqueue({"kind": REWIND, "trainer_step": trainer_step})

    async def reserve_ids(self, through: int) -> None:
        """Journals that group ids up to ``through`` may be handed out; durable on return."""
        await self.enqueue({"kind": IDS, "through": through})

    def events_after(self, after: int) -> list[Journaled]:
        """The events journaled after position ``after``, in order."""
        return [decode(entry.record) for entry in self.read(after)]


ACK, LEASE, SUBMIT, REWIND, IDS = "ack", "lease", "submit", "rewind", "ids"


def _admissions(admissions: Mapping[int, Admission]) -> list[dict[str, Any]]:
    return [{"group_id": gid, **to_json(a)} for gid, a in admissions.items()]


def _decode_admissions(d: Mapping[str, Any]) -> dict[int, Admission]:
    return {int(g["group_id"]): from_json(Admission, g) for g in d["groups"]}


def encode_ack(record: AckRecord, admissions: Mapping[int, Admission]) -> dict[str, Any]:
    return {"kind": ACK, **to_json(record), "groups": _admissions(admissions)}


def decode(d: Mapping[str, Any]) -> Journaled:
    """One journal record as a domain event; records from before ``kind`` existed are acks."""
    kind = d.get("kind", ACK)
    if kind == ACK:
        return decode_ack(d)
    if kind == LEASE:
        return JournaledLease(from_json(Lease, d), _decode_admissions(d))
    if kind == SUBMIT:
        return JournaledSubmission(tuple(from_json(tuple[Prompt, ...], d["prompts"])))
    if kind == REWIND:
        return JournaledRewind(int(d["trainer_step"]))
    if kind == IDS:
        return IdReservation(int(d["through"]))
    raise CorruptJournal(f"{JOURNAL}: a record of unknown kind {kind!r}")


def decode_ack(d: Mapping[str, Any]) -> JournaledAck:
    return JournaledAck(from_json(AckRecord, d), _decode_admissions(d))
