"""The rollout buffer: groups from admission to finalization, with change tracking for snapshots.

Every method is a synchronous step called inside a barrier mutation. Besides the groups, the buffer
records what changed since the last ``capture()`` — rows (staged samples) added, rows removed, and
groups whose metadata changed — so a checkpoint's exclusive hold does pointer work proportional to
that delta only: lists are swapped, and immutable samples and the frozen metadata of changed
groups are shared by reference (a change replaces a group's ``GroupMeta``, never edits it).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

from rolloutd.domain.errors import FailedPrecondition, InvariantError, NotFound
from rolloutd.domain.group import (
    TERMINAL,
    UNFINISHED,
    Group,
    GroupMeta,
    GroupScores,
    GroupState,
    GroupTable,
    KeptSamples,
    RestoredGroup,
    Sample,
    check_transition,
)

ACKED_LEASES_REMEMBERED = 65_536
"""Finalized leases remembered so that a late retry of their ack still succeeds."""


def remember_finalized(
    ledger: OrderedDict[str, int], finalized: Mapping[str, int]
) -> OrderedDict[str, int]:
    """Adds newly finalized leases (lease id -> trainer step) to ``ledger``, in place, and
    forgets the oldest beyond :data:`ACKED_LEASES_REMEMBERED`: the one place the cap holds."""
    ledger.update(finalized)
    while len(ledger) > ACKED_LEASES_REMEMBERED:
        ledger.popitem(last=False)
    return ledger


@dataclass(frozen=True)
class Lease:
    lease_id: str
    group_ids: tuple[int, ...]
    consumer: str
    created_at: float
    expires_at: float


@dataclass(frozen=True)
class AckRecord:
    lease_id: str
    group_ids: tuple[int, ...]
    trainer_step: int
    acked_at: float


Row = tuple[int, int, Sample]
"""(row_id, group_id, sample)"""

SEAL_HELD_ROWS = 16_384
"""Rows of finished groups the buffer holds as objects before it seals the oldest (see
:class:`RowSealer`). Below it a full collection stays short, and a group is delivered as it was
generated: one sealed is decoded from its batch first (~50 us a group, an eighth of the event
loop's time per group under 64 trainers), so a buffer that trainers keep drained never seals."""
SEAL_HELD_VALUES = 8 << 20
"""... or token ids, logprobs and prompt ids among them (32 MiB), whichever comes first."""
SEAL_ROWS = 2048
"""Rows one seal takes (the oldest first, whole groups) ..."""
SEAL_VALUES = 1 << 20
"""... or values, whichever comes first: a seal runs on the event loop, and this bounds it to a
few milliseconds however long the samples are."""


class SealedRows(ABC):
    """Rows of whole groups that a :class:`RowSealer` encoded into columnar buffers."""

    @abstractmethod
    def groups(self) -> Mapping[int, KeptSamples]:
        """Group id -> its rows, read from the buffers."""


class RowSealer(ABC):
    """Encodes committed groups' siblings into the columns a snapshot segment holds.

    A sample as Python objects costs about twice its payload in memory, and 100k of them made a
    full collection take 150 ms: a pause of the event loop. Sealed, a group keeps one view over
    the shared buffers (:class:`KeptSamples`), and a checkpoint writes its rows without encoding
    them again. ``checkpoint/segments.py`` implements it over Arrow record batches.
    """

    @abstractmethod
    def seal(self, rows: Sequence[Row]) -> SealedRows:
        """``rows`` of whole groups, each group's rows together in sibling order."""


@dataclass(frozen=True)
class BufferState:
    """The buffer's part of a snapshot. A capture holds what changed since the previous one:
    ``groups`` maps id -> meta, or None if removed; ``finalized_leases`` holds the leases
    finalized since then, oldest first (copying the whole ledger would make the hold grow with the
    run's length). A state to restore from is whole: every group and live row, the whole ledger."""

    new_rows: Collection[Row]
    """Rows staged since the previous capture and still live (a view: no copy under the hold)."""
    removed_rows: list[int]
    groups: Mapping[int, GroupMeta | None]
    leases: Mapping[str, Lease]
    acks: Mapping[str, AckRecord]
    finalized_leases: Mapping[str, int]
    next_row_id: int
    kept_rows: Mapping[int, KeptSamples] = field(default_factory=dict)
    """In a state to restore from: group id -> the rows a snapshot kept in its buffers (besides
    ``new_rows``, which a restore leaves empty). Never part of a capture."""
    new_sealed: Sequence[SealedRows] = ()
    """The sealed rows among which ``new_sealed_ids`` are: staged since the previous capture like
    ``new_rows``, but held in columns (a snapshot writes them as they are)."""
    new_sealed_ids: Collection[int] = frozenset()

    @property
    def empty(self) -> bool:
        return not (self.new_rows or self.new_sealed_ids or self.removed_rows or self.groups)


@dataclass
class BufferCounts:
    generating: int = 0
    committed: int = 0
    leased: int = 0
    acked: int = 0
    finishing: int = 0

    @property
    def total(self) -> int:
        return self.generating + self.finishing + self.committed + self.leased + self.acked


@dataclass
class RolloutBuffer:
    sealer: RowSealer | None = None
    """Seals committed rows (none: every row stays an object, as in unit tests)."""
    groups: dict[int, Group] = field(default_factory=dict)
    leases: dict[str, Lease] = field(default_factory=dict)
    acks: dict[str, AckRecord] = field(default_factory=dict)
    """Acked leases whose groups wait for finalization."""
    finalized_leases: OrderedDict[str, int] = field(default_factory=OrderedDict)
    """Lease id -> trainer step, for idempotent acks after finalization."""
    _ready: deque[int] = field(default_factory=deque)
    _row_ids: dict[tuple[int, int], int] = field(default_factory=dict)
    _next_row_id: int = 1
    _new_rows: dict[int, Row] = field(default_factory=dict)
    """Rows staged since the last capture, by row id. A row removed before it was captured is
    dropped from here and never reported, so without checkpoints this stays bounded by the live
    rows instead of holding every sample ever generated."""
    _removed_rows: list[int] = field(default_factory=list)
    """Captured rows removed since the last capture."""
    _sealed_new: list[SealedRows] = field(default_factory=list)
    _sealed_new_ids: set[int] = field(default_factory=set)
    """Rows staged since the last capture and sealed since, still live: ``_new_rows`` for sealed
    rows (a row is in one or the other)."""
    _unsealed: OrderedDict[int, tuple[int, int]] = field(default_factory=OrderedDict)
    """Finished groups whose rows are objects, oldest commit first: id -> (rows, values)."""
    _unsealed_rows: int = 0
    _unsealed_values: int = 0
    _dirty: dict[int, Group | None] = field(default_factory=dict)
    _uncaptured_groups: set[int] = field(default_factory=set)
    """Groups added since the last capture; their removal leaves nothing to report."""
    _finalized_new: OrderedDict[str, int] = field(default_factory=OrderedDict)
    _acked_groups: int = 0
    """Groups listed by ``acks``, kept as a count: admission asks for it before every group."""
    _table: GroupTable | None = None
    """The groups a restore loaded, whose rows :meth:`keep_rows` gives them."""

    # --- queries ---------------------------------------------------------------------------

    def get(self, group_id: int) -> Group:
        try:
            return self.groups[group_id]
        except KeyError:
            raise NotFound(f"group {group_id} is not in the buffer") from None

    @property
    def acked_groups(self) -> int:
        return self._acked_groups

    @property
    def ready_count(self) -> int:
        return len(self._ready)

    def counts(self) -> BufferCounts:
        n = Counter(g.state for g in self.groups.values())
        return BufferCounts(
            n[GroupState.GENERATING],
            n[GroupState.COMMITTED],
            n[GroupState.LEASED],
            n[GroupState.ACKED],
            n[GroupState.FINISHING],
        )

    # --- mutations -------------------------------------------------------------------------

    def _change(self, g: Group, **fields: object) -> None:
        """Every metadata change goes through here: a new frozen value, marked for the capture.
        A change of state must be one of the life cycle's :data:`TRANSITIONS`."""
        state = fields.get("state")
        if state is not None:
            check_transition(g.group_id, g.state, state)  # type: ignore[arg-type]
        g.meta = g.meta.evolve(**fields)
        self._dirty[g.group_id] = g

    def add(self, group: Group) -> None:
        if group.group_id in self.groups:
            raise InvariantError(f"group {group.group_id} admitted twice")
        self.groups[group.group_id] = group
        for sample in group.samples.values():
            self._add_row(group.group_id, sample)
        self._dirty[group.group_id] = group
        self._uncaptured_groups.add(group.group_id)

    def stage(self, group_id: int, sample: Sample) -> Group:
        """Adds a finished sibling; returns the group (complete when all siblings are staged)."""
        g = self.get(group_id)
        if g.state is not GroupState.GENERATING:
            raise InvariantError(f"sample staged into group {group_id} in state {g.state.value}")
        if sample.index in g.samples:
            raise InvariantError(f"sibling {sample.index} of group {group_id} staged twice")
        g.samples[sample.index] = sample
        self._add_row(group_id, sample)
        self._dirty[group_id] = g
        return g

    def finish(self, group_id: int) -> Group:
        """A generating group whose siblings are all staged goes to the finishing stage."""
        g = self.get(group_id)
        if not g.complete:
            raise InvariantError(
                f"group {group_id} finished with {len(g.samples)}/{g.meta.group_size} siblings"
            )
        self._change(g, state=GroupState.FINISHING)
        return g

    def commit(self, group_id: int, now: float, scores: GroupScores | None = None) -> Group:
        """A finished group becomes training-ready, with what its finishing stage recorded."""
        g = self.get(group_id)
        if not g.complete:
            raise InvariantError(
                f"group {group_id} committed with {len(g.samples)}/{g.meta.group_size} siblings"
            )
        self._change(g, state=GroupState.COMMITTED, committed_at=now, scores=scores)
        self._ready.append(group_id)
        # where a sibling was resumed is not a column: such a group stays as objects
        if self.sealer is not None and all(s.resumed_at is None for s in g.samples.values()):
            held = (
                len(g.samples),
                sum(2 * len(s.token_ids) + len(s.prompt_token_ids) for s in g.samples.values()),
            )
            self._unsealed[group_id] = held
            self._unsealed_rows += held[0]
            self._unsealed_values += held[1]
            while (
                self._unsealed_rows >= SEAL_HELD_ROWS or self._unsealed_values >= SEAL_HELD_VALUES
            ):
                self.seal(SEAL_ROWS, SEAL_VALUES)
        return g

    def seal(self, max_rows: float = math.inf, max_values: float = math.inf) -> None:
        """Seals the finished groups held as objects, oldest first: whole groups until
        ``max_rows`` rows or ``max_values`` values are sealed (by default every one). A sealed
        row not yet captured moves from ``_new_rows`` to the sealed ones."""
        if self.sealer is None:
            return
        groups: list[Group] = []
        sealed_rows = sealed_values = 0
        while self._unsealed and sealed_rows < max_rows and sealed_values < max_values:
            gid, (n, v) = self._unsealed.popitem(last=False)
            groups.append(self.groups[gid])
            sealed_rows += n
            sealed_values += v
        self._unsealed_rows -= sealed_rows
        self._unsealed_values -= sealed_values
        rows = [
            (self._row_ids[(g.group_id, i)], g.group_id, g.samples[i])
            for g in groups
            for i in sorted(g.samples)
        ]
        if not rows:
            return
        sealed = self.sealer.seal(rows)
        views = sealed.groups()
        uncaptured = False
        for row_id, gid, sample in rows:
            del self._row_ids[(gid, sample.index)]
            if self._new_rows.pop(row_id, None) is not None:
                self._sealed_new_ids.add(row_id)
                uncaptured = True
        for g in groups:
            g.samples = views[g.group_id]
        if uncaptured:
            self._sealed_new.append(sealed)

    def ready_ids(self) -> Iterator[int]:
        """The committed groups in the order they are leased (do not change the buffer while
        iterating)."""
        return iter(self._ready)

    def lease(
        self, lease_id: str, max_groups: int, consumer: str, now: float, timeout_s: float
    ) -> Lease | None:
        if not self._ready:
            return None
        taken = tuple(self._ready.popleft() for _ in range(min(max_groups, len(self._ready))))
        for gid in taken:
            self._change(self.groups[gid], state=GroupState.LEASED, lease_id=lease_id)
        lease = Lease(lease_id, taken, consumer, now, now + timeout_s)
        self.leases[lease_id] = lease
        return lease

    def grant(self, lease: Lease) -> None:
        """Grants a lease again after a restart (journal replay); its groups are COMMITTED."""
        for gid in lease.group_ids:
            self._ready.remove(gid)
            self._change(self.groups[gid], state=GroupState.LEASED, lease_id=lease.lease_id)
        self.leases[lease.lease_id] = lease

    def ack(self, record: AckRecord) -> list[int] | None:
        """Applies an ack, live or replayed from the journal; None when its lease was acked
        already (idempotent; with another trainer step it is a conflict: the groups were consumed
        by one step, not two). Returns the ids of its groups the buffer does not hold: admitted
        and acked after the snapshot a restore started from.

        Live, every group of the lease is LEASED. In replay a group may also be COMMITTED (its
        lease was granted after the snapshot) or GENERATING or FINISHING: it finished, was leased and acked
        after the snapshot, but its siblings were never all durable, so it is gone like an
        unheld one.
        """
        if record.lease_id in self.acks:
            check_same_step(
                record.lease_id, self.acks[record.lease_id].trainer_step, record.trainer_step
            )
            return None
        if record.lease_id in self.finalized_leases:
            check_same_step(
                record.lease_id, self.finalized_leases[record.lease_id], record.trainer_step
            )
            return None
        for gid in record.group_ids:
            if gid in self.groups and self.groups[gid].state in UNFINISHED:
                self.remove(gid, GroupState.LOST)
        present = tuple(gid for gid in record.group_ids if gid in self.groups)
        for gid in present:
            g = self.groups[gid]
            if g.state is GroupState.COMMITTED:
                self._ready.remove(gid)
            elif g.state is not GroupState.LEASED:
                raise InvariantError(f"ack of group {gid} in state {g.state.value}")
            self._change(
                g,
                state=GroupState.ACKED,
                lease_id=record.lease_id,
                ack_step=record.trainer_step,
            )
        self.leases.pop(record.lease_id, None)
        self.acks[record.lease_id] = replace(record, group_ids=present)
        self._acked_groups += len(present)
        return [gid for gid in record.group_ids if gid not in self.groups]

    def expired_leases(
        self, now: float, paused_since: Callable[[float], float] = lambda _: 0.0
    ) -> list[Lease]:
        """Leases past their deadline at ``now``, each deadline moved on by the time the service
        did not run since the lease was granted (``paused_since(created_at)``, pauses.py)."""
        return [
            lease
            for lease in self.leases.values()
            if lease.expires_at + paused_since(lease.created_at) <= now
        ]

    def requeue(self, lease_id: str) -> list[int]:
        """Makes a lease's groups available again, ahead of newer groups, in their order."""
        lease = self.leases.pop(lease_id)
        for gid in reversed(lease.group_ids):
            self._change(self.groups[gid], state=GroupState.COMMITTED, lease_id=None)
            self._ready.appendleft(gid)
        return list(lease.group_ids)

    def finalize(self, through_step: int) -> list[Group]:
        """Drops groups acked at steps <= ``through_step``."""
        done = [r for r in self.acks.values() if r.trainer_step <= through_step]
        dropped: list[Group] = []
        for record in done:
            del self.acks[record.lease_id]
            self._acked_groups -= len(record.group_ids)
            dropped.extend(self.remove(gid, GroupState.FINALIZED) for gid in record.group_ids)
        ledger = {r.lease_id: r.trainer_step for r in done}
        remember_finalized(self.finalized_leases, ledger)
        remember_finalized(self._finalized_new, ledger)
        return dropped

    def rewind(self, after_step: int) -> list[Group]:
        """Groups acked at steps > ``after_step`` become available again, oldest first."""
        undone = sorted(
            (r for r in self.acks.values() if r.trainer_step > after_step), key=lambda r: r.acked_at
        )
        groups: list[Group] = []
        for record in undone:
            del self.acks[record.lease_id]
            self._acked_groups -= len(record.group_ids)
            for gid in record.group_ids:
                g = self.groups[gid]
                self._change(g, state=GroupState.COMMITTED, lease_id=None, ack_step=None)
                groups.append(g)
        self._ready.extendleft(reversed([g.group_id for g in groups]))
        return groups

    def remove(self, group_id: int, fate: GroupState) -> Group:
        """Removes a group and its rows; ``fate`` is the terminal state it leaves in."""
        g = self.groups[group_id]
        if fate not in TERMINAL:
            raise InvariantError(f"group {group_id} removed as {fate.value}, not a terminal state")
        check_transition(group_id, g.state, fate)
        del self.groups[group_id]
        held = self._unsealed.pop(group_id, None)
        if held is not None:
            self._unsealed_rows -= held[0]
            self._unsealed_values -= held[1]
        if isinstance(g.samples, KeptSamples):
            for row_id in g.samples.row_ids().values():
                self._forget_row(row_id)
        else:
            for index in g.samples:
                self._forget_row(self._row_ids.pop((group_id, index)))
        if g.state is GroupState.COMMITTED:
            self._ready.remove(group_id)
        if group_id in self._uncaptured_groups:
            self._uncaptured_groups.discard(group_id)
            del self._dirty[group_id]
        else:
            self._dirty[group_id] = None
        return g

    def drop_samples(self, group_id: int) -> None:
        """Forgets a generating group's staged siblings so the whole group is generated again."""
        g = self.get(group_id)
        for index in list(g.samples):
            self._forget_row(self._row_ids.pop((group_id, index)))
        g.samples.clear()
        self._dirty[group_id] = g

    def _add_row(self, group_id: int, sample: Sample) -> None:
        row_id = self._next_row_id
        self._next_row_id += 1
        self._row_ids[(group_id, sample.index)] = row_id
        self._new_rows[row_id] = (row_id, group_id, sample)

    def _forget_row(self, row_id: int) -> None:
        if self._new_rows.pop(row_id, None) is not None:
            return
        if row_id in self._sealed_new_ids:
            self._sealed_new_ids.remove(row_id)
        else:
            self._removed_rows.append(row_id)

    # --- snapshots -------------------------------------------------------------------------

    def capture(self) -> BufferState:
        """Takes the changes since the last capture. O(changes), and no group is copied (its
        metadata is a frozen value): call under the exclusive hold."""
        new_rows, self._new_rows = self._new_rows, {}
        sealed, self._sealed_new = self._sealed_new, []
        sealed_ids, self._sealed_new_ids = self._sealed_new_ids, set()
        self._uncaptured_groups.clear()
        removed, self._removed_rows = self._removed_rows, []
        dirty, self._dirty = self._dirty, {}
        finalized, self._finalized_new = self._finalized_new, OrderedDict()
        return BufferState(
            new_rows.values(),
            removed,
            {gid: None if g is None else g.meta for gid, g in dirty.items()},
            dict(self.leases),
            dict(self.acks),
            finalized,
            self._next_row_id,
            new_sealed=sealed,
            new_sealed_ids=sealed_ids,
        )

    def restore_uncaptured(self, delta: BufferState) -> None:
        """Puts a captured delta back (its snapshot failed) so the next capture includes it."""
        self._new_rows = {**{row[0]: row for row in delta.new_rows}, **self._new_rows}
        self._sealed_new[:0] = delta.new_sealed
        self._sealed_new_ids.update(delta.new_sealed_ids)
        self._removed_rows[:0] = delta.removed_rows
        for gid in delta.groups:
            self._dirty.setdefault(gid, self.groups.get(gid))
        newer, self._finalized_new = self._finalized_new, OrderedDict(delta.finalized_leases)
        remember_finalized(self._finalized_new, newer)

    def load(self, state: BufferState) -> None:
        """Rebuilds the buffer from a whole state; nothing is marked as changed. Each group is a
        :class:`RestoredGroup` over the state's :class:`GroupTable` (nothing decoded per
        group); its rows are ``state.kept_rows`` (see :meth:`keep_rows`), which a restore
        gives once the snapshot's rows have verified, after loading the rest."""
        if self.groups:
            raise InvariantError("restore into a non-empty buffer")
        table = restored_groups(state.groups)
        self.groups.update(zip(table.ids, RestoredGroup.build(table), strict=True))
        self._table = table
        self.leases, self.acks = dict(state.leases), dict(state.acks)
        self._acked_groups = sum(len(r.group_ids) for r in self.acks.values())
        self.finalized_leases = OrderedDict(state.finalized_leases)
        self._next_row_id = state.next_row_id
        self._ready = deque(table.committed_order())
        self.keep_rows(state.kept_rows)
        for row_id, gid, sample in state.new_rows:
            self.groups[gid].samples[sample.index] = sample
            self._row_ids[(gid, sample.index)] = row_id

    def keep_rows(self, kept_rows: Mapping[int, KeptSamples]) -> None:
        """Gives the loaded groups the rows a snapshot kept in its buffers: a finished group
        reads its own when they are first read (no object per row); a generating group's
        become plain samples now, since its missing siblings are staged next."""
        table = self._table
        if table is None or not table.holds(kept_rows.keys()):
            raise InvariantError("restore from a state with rows of groups it does not hold")
        table.kept = kept_rows
        for gid in table.unfinished():
            kept = kept_rows.get(gid)
            if kept is not None:  # staged into again: rows become objects
                self.groups[gid].samples = dict(kept)
                self._row_ids.update(((gid, i), r) for i, r in kept.row_ids().items())


def restored_groups(groups: Mapping[int, GroupMeta | None]) -> GroupTable:
    """The groups of a whole state as a table: a restore's own, or one over metadata decoded
    already (a state built in memory). A whole state removes no group."""
    if isinstance(groups, GroupTable):
        return groups
    metas = list(groups.values())
    if any(m is None for m in metas):
        raise InvariantError("restore from a state that removes a group")
    return GroupTable.of(metas)  # type: ignore[arg-type]


def check_same_step(lease_id: str, acked_step: int, trainer_step: int) -> None:
    """A repeated ack is idempotent only at the step it was first made at."""
    if acked_step != trainer_step:
        raise FailedPrecondition(
            f"lease {lease_id!r} was acked with trainer_step {acked_step}, not {trainer_step}"
        )
