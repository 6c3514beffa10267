"""The journal: what a client was told is durable, before the RPC returns.

Kinds of record, one sequence of positions: acks, lease grants, accepted submissions,
rewinds, reservations of group ids, drops, and episode records (``admit``, ``episode_reset``,
``episode_turn``, ``episode_step``: docs/design.md, "Episodes") (``kind`` in each record; a
record without one is an ack). A snapshot records the last position it includes
(``acks_through``) and restore replays the records after it, on top of nothing when there is
no snapshot yet. Retention prunes what every kept snapshot covers, at each checkpoint.

Group commit: writers that arrive while a sync is in progress queue up; the next sync makes the
whole queue durable at once (one ``fdatasync`` locally, one put on an object store), so the cost
of durability is shared by concurrent acks, lease grants and submissions. Writers queue from the
event loop (:meth:`Journal.enqueue`, behind the domain's ``DeliveryJournal`` port): records cost
no thread until their batch is written, one worker thread per batch, and the position a
checkpoint reads moves in the loop together with the writers' futures, so a capture sees exactly
the records whose writers were told "durable".

Layout: ``journal/<first position>-<token>.jsonl`` locally (framed records appended, see
``journal_frames.py``; one file per run of appends), ``journal/<first>-<last>.jsonl`` on an
object store (one object per batch).

Damage (docs/operations.md, "A damaged journal"): a local file's torn tail is an append that
never returned and is discarded with a warning naming the file, offset and bytes; the
*acknowledged mark* (``journal/acknowledged``, the last position whose writers were told, written
after the syncs, off their path) tells when such a tail held records that were acknowledged, and
restore reports them lost. Damage followed by whole records refuses a replay that needs it, with
the way out: ``rolloutd checkpoints repair-journal`` moves the damaged part, and everything after
it, aside to ``journal-damaged/``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rolloutd.checkpoint import journal_records as records
from rolloutd.checkpoint.backends import (
    JOURNAL,
    LocalBackend,
    ObjectBackend,
    StoreError,
    fsync_dir,
    makedirs,
)
from rolloutd.checkpoint.faults import FaultPoint, fault_point
from rolloutd.checkpoint.journal_frames import Damage, JournalEntry, Scan, encode, scan
from rolloutd.domain.group import GroupMeta, Prompt
from rolloutd.domain.journal import AckRecord, Journaled, JournaledDrop, Lease
from rolloutd.domain.sampler import Admission

__all__ = ["CorruptJournal", "Journal", "JournalEntry", "JournalReport"]

log = logging.getLogger(__name__)

DAMAGED = "journal-damaged"
"""Where ``repair`` moves the damaged part of a journal (kept for a post-mortem, never read)."""
MARK = "acknowledged"
"""The acknowledged mark's file in ``journal/`` (local stores)."""
MARK_EVERY_S = 1.0
"""The mark is written when the queue drains, and at least this often while it never does."""


class CorruptJournal(StoreError):
    """The journal lost or garbled a record that was acknowledged as durable."""


@dataclass
class JournalReport:
    """What :meth:`Journal.check` found (``rolloutd checkpoints verify``)."""

    files: int = 0
    records: int = 0
    first: int | None = None
    last: int | None = None
    tails: list[str] = field(default_factory=list)
    """Torn tails: appends that never returned, discarded (not a problem by themselves)."""
    problems: list[str] = field(default_factory=list)


def _mark_bytes(position: int) -> bytes:
    text = f"{position:020d}".encode()
    return text + b" %08x\n" % zlib.crc32(text)


def _read_mark(data: bytes) -> int | None:
    text, _, checksum = data.strip().partition(b" ")
    if not text.isdigit() or checksum != b"%08x" % zlib.crc32(text):
        return None
    return int(text)


def _refusal(where: str, damage: Damage, root: str) -> str:
    return (
        f"the journal is damaged: {damage.describe(where)}, and whole records follow it (from "
        f"position {damage.before}), so what it held was acknowledged and cannot be replayed "
        f"after position {damage.after or 0}; move the damaged part aside with `rolloutd "
        f"checkpoints repair-journal --dir {root}` and start again (it keeps every record "
        "before the damage; see docs/operations.md, a damaged journal), or start afresh with "
        "--restore none"
    )


class _FileJournal:
    """Local journal: framed records appended and fsynced, one file per run of appends.

    A file is named after its first position; a new file starts after each :meth:`prune` and
    each process start, so no append follows a torn tail. A torn (unsynced) tail of a file is
    not a record: it was never acknowledged, unless the mark says so. Files are deleted whole
    once every record is pruned.
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self._dir = os.path.join(root, JOURNAL)
        self._fd = -1

    def _files(self) -> list[tuple[int, str]]:
        try:
            names = os.listdir(self._dir)
        except FileNotFoundError:
            return []
        return sorted((int(n.split("-", 1)[0]), n) for n in names if n.endswith(".jsonl"))

    def _scan(self, name: str) -> Scan:
        with open(os.path.join(self._dir, name), "rb") as f:
            return scan(f.read())

    def last_position(self) -> int:
        """The last whole record's position (damage anywhere is left to :meth:`read`)."""
        for _, name in reversed(self._files()):
            entries = self._scan(name).entries
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
        data = b"".join(encode(position + i, record) for i, record in enumerate(records))
        done = 0
        while done < len(data):
            done += os.write(self._fd, data[done:])
        os.fdatasync(self._fd)

    def scans(self, after: int) -> list[tuple[str, Scan]]:
        """The files that may hold records after ``after``, scanned, oldest first."""
        files = self._files()
        return [
            (f"{JOURNAL}/{name}", self._scan(name))
            for i, (_, name) in enumerate(files)
            if not (i + 1 < len(files) and files[i + 1][0] <= after + 1)
        ]

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

    def acknowledged(self) -> int | None:
        """The acknowledged mark; None when there is none, or it does not verify (logged)."""
        try:
            with open(os.path.join(self._dir, MARK), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        position = _read_mark(data)
        if position is None:
            log.warning(
                "%s/%s does not verify; records lost from a torn tail go unreported", JOURNAL, MARK
            )
        return position

    def mark(self, position: int) -> None:
        """Overwrites the acknowledged mark in place (30 bytes, one sector) and syncs it. The file
        is not kept open: a disk with a file open to write cannot be remounted read-only."""
        makedirs(self._dir)
        fd = os.open(os.path.join(self._dir, MARK), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.pwrite(fd, _mark_bytes(position), 0)
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def set_aside(self, where: str, damage: Damage, later: Sequence[str]) -> list[str]:
        """Moves the damaged file ``where`` (its whole records before ``damage`` kept in its
        place) and the ``later`` files to ``journal-damaged/``; returns what was moved."""
        name = where.rsplit("/", 1)[1]
        aside = os.path.join(self.root, DAMAGED)
        makedirs(aside)
        kept = os.path.join(self._dir, name)
        with open(kept, "rb") as f:
            head = f.read(damage.offset)
        os.rename(kept, os.path.join(aside, name))
        for other in later:
            os.rename(
                os.path.join(self._dir, other.rsplit("/", 1)[1]),
                os.path.join(aside, other.rsplit("/", 1)[1]),
            )
        fsync_dir(aside)
        if head:
            tmp = kept + ".tmp"
            with open(tmp, "wb") as f:
                f.write(head)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, kept)
        fsync_dir(self._dir)
        return [where, *later]


class _ObjectJournal:
    """Object-store journal: one object per batch of records, durable once its put returns.

    An object is named after its first and last position; a batch retried after a failed put
    may overlap an earlier object, and the later one (the one acknowledged) wins on read. A put
    is whole, so any damage in an object is damage to acknowledged records.
    """

    def __init__(self, backend: ObjectBackend) -> None:
        self._backend = backend
        self.root = backend.url

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
        data = b"".join(encode(position + i, record) for i, record in enumerate(records))
        self._backend.put(f"{JOURNAL}/{position:020d}-{last:020d}.jsonl", data)

    def scans(self, after: int) -> list[tuple[str, Scan]]:
        paths = [f"{JOURNAL}/{n}" for _, last, n in self._batches() if last > after]
        found = []
        for path, data in zip(paths, self._backend.read_many(paths), strict=True):
            scanned = scan(data)
            if scanned.tail is not None:  # a put is whole: nothing is torn
                scanned.middle.append(scanned.tail)
                scanned.tail = None
            found.append((path, scanned))
        return found

    def prune(self, through: int) -> int:
        doomed = [f"{JOURNAL}/{n}" for _, last, n in self._batches() if last <= through]
        self._backend.delete(doomed)
        return len(doomed)

    def rotate(self) -> None:
        """Nothing to do: every batch is its own object."""

    def acknowledged(self) -> int | None:
        """None: every put is whole, so no tail is torn (a deleted object shows as a gap)."""
        return None

    def mark(self, position: int) -> None:
        """Nothing to do (see :meth:`acknowledged`)."""

    def set_aside(self, where: str, damage: Damage, later: Sequence[str]) -> list[str]:
        """Moves the damaged object and the ``later`` ones to ``journal-damaged/``, the whole
        records before the damage put again in their place."""
        head = bytes(self._backend.read(where))[: damage.offset]
        for path in (where, *later):
            self._backend.rename(path, f"{DAMAGED}/{path.rsplit('/', 1)[1]}")
        if head and damage.after is not None:
            first = scan(head).entries[0].position
            self._backend.put(f"{JOURNAL}/{first:020d}-{damage.after:020d}.jsonl", head)
        return [where, *later]


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
        self._floor = floor
        self._position = max(self._files.last_position(), floor)
        """Position of the last record written; moves in the writing thread."""
        self._durable = self._position
        """What :attr:`position` reports (see there)."""
        self._batch: list[tuple[Mapping[str, Any], asyncio.Future[int]]] = []
        """Records queued from the event loop for the next batch, with their writers' futures."""
        self._flushing: asyncio.Task[None] | None = None
        self._marked = self._durable
        """The acknowledged mark last written (or found at start, as far as it matters)."""
        self._marking: asyncio.Task[None] | None = None
        self._mark_lock = threading.Lock()
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
                if self._marking is None:
                    self._marking = asyncio.get_running_loop().create_task(
                        self._mark(), name="rolloutd-journal-mark"
                    )
        finally:
            self._flushing = None

    async def _mark(self) -> None:
        """Writes the acknowledged mark until it is up to date: after the writers were told,
        beside the next batch's sync, one at a time (so one mark covers every batch synced
        meanwhile). A mark is a report's evidence, not the records': failing to write it is
        logged and changes nothing for the writers."""
        try:
            while self._marked < self._durable:
                position = self._durable
                await asyncio.to_thread(self._write_mark, position)
                self._marked = position
        except OSError as exc:
            log.warning("the journal's acknowledged mark was not written: %s", exc)
        finally:
            self._marking = None

    async def marked(self) -> None:
        """Returns once the acknowledged mark covers every durable record (or its write failed):
        a writer that must not leave before its mark is written waits for this."""
        while self._marking is not None:
            await asyncio.shield(self._marking)

    def _write_mark(self, position: int) -> None:
        with self._mark_lock:
            if self._guard is not None:
                self._guard()
            self._files.mark(position)

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
        """Records with a position after ``after`` (a manifest's ``acks_through``), in order.

        A torn tail is discarded with a warning (file, offset, bytes); records the acknowledged
        mark says were acknowledged but that are not there are reported at ERROR. Damage
        followed by whole records, or a missing position, raises :class:`CorruptJournal` saying
        what to do, unless the snapshot covers every record the damage may have held.
        A position written twice (an append that failed and was retried in a later file) keeps
        its later record, the one that was acknowledged."""
        with self._lock:
            scans = self._files.scans(after)
            mark = self._files.acknowledged()
        entries: dict[int, JournalEntry] = {}
        tails = []
        for where, found in scans:
            for damage in found.middle:
                if damage.before is not None and damage.before - 1 <= after:
                    log.warning(
                        "%s; ignored: the snapshot covers every record it may have held",
                        damage.describe(where),
                    )
                    continue
                raise CorruptJournal(_refusal(where, damage, self._files.root))
            if found.tail is not None:
                tails.append(found.tail.describe(where))
                log.warning("%s: discarded, a torn tail (an append that never returned)", tails[-1])
            entries.update((e.position, e) for e in found.entries if e.position > after)
        positions = sorted(entries)
        if positions != list(range(after + 1, after + 1 + len(entries))):
            missing = sorted(set(range(after + 1, positions[-1] + 1)) - set(positions))
            raise CorruptJournal(
                f"the journal is missing records after position {after}: {missing[:10]} (a "
                f"file of {JOURNAL}/ deleted or moved?); `rolloutd checkpoints repair-journal "
                f"--dir {self._files.root}` sets aside what follows the gap (docs/operations.md, "
                "a damaged journal), or start afresh with --restore none"
            )
        last = positions[-1] if positions else after
        if mark is not None and mark > last:
            log.error(
                "the journal lost acknowledged records: positions %d to %d were acknowledged as "
                "durable (%s/%s) but are not in it (%s); what they told clients (acks, lease "
                "grants, accepted prompts, rewinds) is lost: their groups may be delivered again",
                last + 1,
                mark,
                JOURNAL,
                MARK,
                "; ".join(tails) or "no torn tail found",
            )
        return [entries[p] for p in positions]

    def check(self) -> JournalReport:
        """Every record of every file read and checked (``rolloutd checkpoints verify``)."""
        with self._lock:
            scans = self._files.scans(0)
            mark = self._files.acknowledged()
        report = JournalReport(files=len(scans))
        positions: set[int] = set()
        for where, found in scans:
            report.problems += [
                f"{d.describe(where)}, and whole records follow it" for d in found.middle
            ]
            if found.tail is not None:
                report.tails.append(found.tail.describe(where))
            positions.update(e.position for e in found.entries)
        report.records = len(positions)
        if positions:
            report.first, report.last = min(positions), max(positions)
            missing = sorted(set(range(report.first, report.last + 1)) - positions)
            if missing:
                report.problems.append(f"{JOURNAL}: records missing: {missing[:10]}")
        last = report.last or 0
        if mark is not None and mark > max(last, self._floor):
            report.problems.append(
                f"{JOURNAL}: positions {last + 1} to {mark} were acknowledged ({JOURNAL}/{MARK}) "
                "but are not in the journal"
            )
        return report

    def repair(self) -> tuple[list[str], int, int] | None:
        """Moves the first damaged file or object of the journal, from its damage on, and every
        later one to ``journal-damaged/``, keeping the whole records before the damage, and
        lowers the acknowledged mark to what is left; returns what was moved, the last position
        kept and how many whole records were set aside. None when nothing is damaged.
        Run with the store claimed (no service writing it)."""
        with self._lock:
            scans = self._files.scans(0)
            damaged = [i for i, (_, found) in enumerate(scans) if found.middle]
            if not damaged:
                return None
            i = damaged[0]
            where, found = scans[i]
            damage = found.middle[0]
            cut = sum(1 for e in found.entries if damage.after is None or e.position > damage.after)
            cut += sum(len(f.entries) for _, f in scans[i + 1 :])
            moved = self._files.set_aside(where, damage, [w for w, _ in scans[i + 1 :]])
            kept = self._files.last_position()
            self._files.mark(kept)
            self._position = self._durable = self._marked = max(kept, self._floor)
            return moved, kept, cut

    def prune(self, through: int) -> int:
        """Delete records at positions up to ``through`` where whole files/objects allow."""
        with self._lock:
            return self._files.prune(through)

    # --- the domain's DeliveryJournal port -------------------------------------------------

    def ack(self, record: AckRecord, admissions: Mapping[int, Admission]) -> asyncio.Future[int]:
        """Queues an ack with the admission of each of its groups (no I/O); the future
        resolves once it is durable."""
        return self.enqueue(records.ack(record, admissions))

    def lease(self, lease: Lease, admissions: Mapping[int, Admission]) -> asyncio.Future[int]:
        """Queues a lease grant with the admission of each of its groups (no I/O); the future
        resolves once it is durable."""
        return self.enqueue(records.lease(lease, admissions))

    async def submit(self, prompts: Sequence[Prompt]) -> None:
        """Journals accepted prompts; durable on return."""
        await self.enqueue(records.submission(prompts))

    async def rewind(self, trainer_step: int) -> None:
        """Journals a ``Rewind(trainer_step)``; durable on return."""
        await self.enqueue(records.rewind(trainer_step))

    async def reserve_ids(self, through: int) -> None:
        """Journals that group ids up to ``through`` may be handed out; durable on return."""
        await self.enqueue(records.ids(through))

    async def drop(self, drop: JournaledDrop) -> None:
        """Journals a group dropped before delivery; durable on return."""
        await self.enqueue(records.drop(drop))

    def episode(self, group_id: int, index: int, record: Any) -> asyncio.Future[int]:
        """Queues an episode record (a model turn, a step's result); the future resolves once
        it is durable."""
        return self.enqueue(records.episode(group_id, index, record))

    def admit(self, meta: GroupMeta) -> asyncio.Future[int]:
        """Queues an episode group's admission; the future resolves once it is durable."""
        return self.enqueue(records.admission(meta))

    def events_after(self, after: int) -> list[Journaled]:
        """The events journaled after position ``after``, in order."""
        try:
            return [records.decode(entry.record) for entry in self.read(after)]
        except records.UnknownRecord as exc:
            raise CorruptJournal(f"{JOURNAL}: {exc}") from exc
