"""The rollout buffer: groups from admission to finalization, with change tracking for snapshots.

Every method is a synchronous step called inside a barrier mutation. Besides the groups, the buffer
records what changed since the last ``capture()`` — rows (staged samples) added, rows removed, and
groups whose metadata changed — so a checkpoint's exclusive hold does pointer work proportional to
that delta only: lists are swapped, immutable samples are shared by reference, and only changed
groups are copied into small frozen records.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from rolloutd.domain.errors import FailedPrecondition, InvariantError, NotFound
from rolloutd.domain.group import Group, GroupState, Position, Prompt, Sample

ACKED_LEASES_REMEMBERED = 65_536
"""Finalized leases remembered so that a late retry of their ack still succeeds."""


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


@dataclass(frozen=True)
class GroupMeta:
    """Everything about a group except its samples, frozen at capture time."""

    group_id: int
    prompt: Prompt
    position: Position | None
    group_size: int
    policy_version: int
    admitted_at: float
    seed: int
    state: GroupState
    committed_at: float | None
    lease_id: str | None
    ack_step: int | None

    @classmethod
    def of(cls, g: Group) -> GroupMeta:
        return cls(
            g.group_id,
            g.prompt,
            g.position,
            g.group_size,
            g.policy_version,
            g.admitted_at,
            g.seed,
            g.state,
            g.committed_at,
            g.lease_id,
            g.ack_step,
        )


Row = tuple[int, int, Sample]
"""(row_id, group_id, sample)"""


@dataclass
class BufferDelta:
    """What changed since the previous capture. ``groups`` maps id -> meta, or None if removed;
    ``finalized_leases`` holds the leases finalized since then, oldest first (the checkpointer
    keeps the whole ledger: copying it here would make the hold grow with the run's length)."""

    new_rows: Collection[Row]
    """Rows staged since the previous capture and still live (a view: no copy under the hold)."""
    removed_rows: list[int]
    groups: dict[int, GroupMeta | None]
    leases: dict[str, Lease]
    acks: dict[str, AckRecord]
    finalized_leases: dict[str, int]
    next_row_id: int

    @property
    def empty(self) -> bool:
        return not (self.new_rows or self.removed_rows or self.groups)


@dataclass
class BufferCounts:
    generating: int = 0
    committed: int = 0
    leased: int = 0
    acked: int = 0

    @property
    def total(self) -> int:
        return self.generating + self.committed + self.leased + self.acked


@dataclass
class RolloutBuffer:
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
    _dirty: dict[int, Group | None] = field(default_factory=dict)
    _uncaptured_groups: set[int] = field(default_factory=set)
    """Groups added since the last capture; their removal leaves nothing to report."""
    _finalized_new: OrderedDict[str, int] = field(default_factory=OrderedDict)

    # --- queries ---------------------------------------------------------------------------

    def get(self, group_id: int) -> Group:
        try:
            return self.groups[group_id]
        except KeyError:
            raise NotFound(f"group {group_id} is not in the buffer") from None

    @property
    def acked_groups(self) -> int:
        return sum(len(r.group_ids) for r in self.acks.values())

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
        )

    def positions(self) -> set[Position]:
        return {g.position for g in self.groups.values() if g.position is not None}

    # --- mutations -------------------------------------------------------------------------

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

    def commit(self, group_id: int, now: float) -> Group:
        g = self.get(group_id)
        if not g.complete or g.state is not GroupState.GENERATING:
            raise InvariantError(
                f"group {group_id} committed with {len(g.samples)}/{g.group_size} "
                f"siblings in state {g.state.value}"
            )
        g.state, g.committed_at = GroupState.COMMITTED, now
        self._ready.append(group_id)
        self._dirty[group_id] = g
        return g

    def lease(
        self, lease_id: str, max_groups: int, consumer: str, now: float, timeout_s: float
    ) -> Lease | None:
        if not self._ready:
            return None
        taken = tuple(self._ready.popleft() for _ in range(min(max_groups, len(self._ready))))
        for gid in taken:
            g = self.groups[gid]
            g.state, g.lease_id = GroupState.LEASED, lease_id
            self._dirty[gid] = g
        lease = Lease(lease_id, taken, consumer, now, now + timeout_s)
        self.leases[lease_id] = lease
        return lease

    def ack(self, lease_id: str, trainer_step: int, now: float) -> tuple[AckRecord | None, bool]:
        """Returns (record, already_acked). ``record`` is None for a finalized earlier ack.

        Repeating an ack is idempotent; repeating it with another trainer step is a conflict
        (the groups were consumed by one step, not two).
        """
        if lease_id in self.acks:
            _same_step(lease_id, self.acks[lease_id].trainer_step, trainer_step)
            return self.acks[lease_id], True
        if lease_id in self.finalized_leases:
            _same_step(lease_id, self.finalized_leases[lease_id], trainer_step)
            return None, True
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            raise NotFound(f"lease {lease_id!r} is unknown or expired")
        record = AckRecord(lease_id, lease.group_ids, trainer_step, now)
        for gid in lease.group_ids:
            g = self.groups[gid]
            g.state, g.ack_step = GroupState.ACKED, trainer_step
            self._dirty[gid] = g
        self.acks[lease_id] = record
        return record, False

    def apply_journaled_ack(self, record: AckRecord) -> list[int]:
        """Replays an ack found in the journal after a restore; returns ids of groups no snapshot
        held (they were admitted and acked after it). Idempotent."""
        if record.lease_id in self.acks or record.lease_id in self.finalized_leases:
            return []
        for gid in record.group_ids:
            # Still generating in the snapshot: finished, leased and acked after it. The trainer
            # consumed it; its siblings were never all durable, so it is gone like an unheld one.
            if gid in self.groups and self.groups[gid].state is GroupState.GENERATING:
                self.remove(gid)
        present = tuple(gid for gid in record.group_ids if gid in self.groups)
        for gid in present:
            g = self.groups[gid]
            if g.state is GroupState.COMMITTED:
                self._ready.remove(gid)
            elif g.state is not GroupState.LEASED:
                raise InvariantError(f"journaled ack of group {gid} in state {g.state.value}")
            g.state, g.lease_id, g.ack_step = GroupState.ACKED, record.lease_id, record.trainer_step
            self._dirty[gid] = g
        self.leases.pop(record.lease_id, None)
        self.acks[record.lease_id] = AckRecord(
            record.lease_id, present, record.trainer_step, record.acked_at
        )
        return [gid for gid in record.group_ids if gid not in self.groups]

    def expired_leases(self, now: float) -> list[Lease]:
        return [lease for lease in self.leases.values() if lease.expires_at <= now]

    def requeue(self, lease_id: str) -> list[int]:
        """Makes a lease's groups available again, ahead of newer groups, in their order."""
        lease = self.leases.pop(lease_id)
        for gid in reversed(lease.group_ids):
            g = self.groups[gid]
            g.state, g.lease_id = GroupState.COMMITTED, None
            self._ready.appendleft(gid)
            self._dirty[gid] = g
        return list(lease.group_ids)

    def finalize(self, through_step: int) -> list[Group]:
        """Drops groups acked at steps <= ``through_step``."""
        done = [r for r in self.acks.values() if r.trainer_step <= through_step]
        dropped: list[Group] = []
        for record in done:
            del self.acks[record.lease_id]
            self.finalized_leases[record.lease_id] = record.trainer_step
            self._finalized_new[record.lease_id] = record.trainer_step
            dropped.extend(self.remove(gid) for gid in record.group_ids)
        for ledger in (self.finalized_leases, self._finalized_new):
            while len(ledger) > ACKED_LEASES_REMEMBERED:
                ledger.popitem(last=False)
        return dropped

    def rewind(self, after_step: int) -> list[Group]:
        """Groups acked at steps > ``after_step`` become available again, oldest first."""
        undone = sorted(
            (r for r in self.acks.values() if r.trainer_step > after_step), key=lambda r: r.acked_at
        )
        groups: list[Group] = []
        for record in undone:
            del self.acks[record.lease_id]
            for gid in record.group_ids:
                g = self.groups[gid]
                g.state, g.lease_id, g.ack_step = GroupState.COMMITTED, None, None
                self._dirty[gid] = g
                groups.append(g)
        self._ready.extendleft(reversed([g.group_id for g in groups]))
        return groups

    def remove(self, group_id: int) -> Group:
        """Removes a group and its rows (finalized or evicted)."""
        g = self.groups.pop(group_id)
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
        if self._new_rows.pop(row_id, None) is None:
            self._removed_rows.append(row_id)

    # --- snapshots -------------------------------------------------------------------------

    def capture(self) -> BufferDelta:
        """Takes the changes since the last capture. O(changes); call under the exclusive hold."""
        new_rows, self._new_rows = self._new_rows, {}
        self._uncaptured_groups.clear()
        removed, self._removed_rows = self._removed_rows, []
        dirty, self._dirty = self._dirty, {}
        finalized, self._finalized_new = self._finalized_new, OrderedDict()
        metas = {gid: None if g is None else GroupMeta.of(g) for gid, g in dirty.items()}
        return BufferDelta(
            new_rows.values(),
            removed,
            metas,
            dict(self.leases),
            dict(self.acks),
            finalized,
            self._next_row_id,
        )

    def restore_uncaptured(self, delta: BufferDelta) -> None:
        """Puts a captured delta back (its snapshot failed) so the next capture includes it."""
        self._new_rows = {**{row[0]: row for row in delta.new_rows}, **self._new_rows}
        self._removed_rows[:0] = delta.removed_rows
        for gid in delta.groups:
            self._dirty.setdefault(gid, self.groups.get(gid))
        finalized = OrderedDict(delta.finalized_leases)
        finalized.update(self._finalized_new)
        while len(finalized) > ACKED_LEASES_REMEMBERED:
            finalized.popitem(last=False)
        self._finalized_new = finalized

    def load(
        self,
        metas: Iterable[GroupMeta],
        rows: Iterable[Row],
        leases: dict[str, Lease],
        acks: dict[str, AckRecord],
        finalized: dict[str, int],
        next_row_id: int,
    ) -> None:
        """Rebuilds the buffer from a snapshot; nothing is marked as changed."""
        if self.groups:
            raise InvariantError("restore into a non-empty buffer")
        for m in metas:
            self.groups[m.group_id] = Group(
                group_id=m.group_id,
                prompt=m.prompt,
                position=m.position,
                group_size=m.group_size,
                policy_version=m.policy_version,
                admitted_at=m.admitted_at,
                seed=m.seed,
                state=m.state,
                committed_at=m.committed_at,
                lease_id=m.lease_id,
                ack_step=m.ack_step,
            )
        for row_id, gid, sample in rows:
            self.groups[gid].samples[sample.index] = sample
            self._row_ids[(gid, sample.index)] = row_id
        self.leases, self.acks = dict(leases), dict(acks)
        self.finalized_leases = OrderedDict(finalized)
        self._next_row_id = next_row_id
        ready = sorted(
            (g for g in self.groups.values() if g.state is GroupState.COMMITTED),
            key=lambda g: (g.committed_at or 0.0, g.group_id),
        )
        self._ready = deque(g.group_id for g in ready)


def _same_step(lease_id: str, acked_step: int, trainer_step: int) -> None:
    if acked_step != trainer_step:
        raise FailedPrecondition(
            f"lease {lease_id!r} was acked with trainer_step {acked_step}, not {trainer_step}"
        )
