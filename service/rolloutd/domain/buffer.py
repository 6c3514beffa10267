"""The rollout buffer: the groups from admission to finalization, and their rows.

Every method is a synchronous step called inside a barrier mutation. Each group is in one state of
the declared life cycle (``group.TRANSITIONS``), which every change is checked against; committed
groups wait in the order they are leased. Every change is recorded in the buffer's
:class:`ChangeLog`, so a checkpoint's exclusive hold does pointer work proportional to what changed
(``capture``). Finished groups' rows are sealed into columns once enough of them are held as
objects (:class:`RowSealer`). Who holds a lease and what was acked is the delivery ledger's
(``domain/ledger.py``); the buffer knows each group's state and lease id.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from rolloutd.domain.changes import ChangeLog, Changes, Row
from rolloutd.domain.errors import InvariantError, NotFound
from rolloutd.domain.group import (
    TERMINAL,
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

__all__ = ["BufferCounts", "BufferState", "RolloutBuffer", "Row", "RowSealer", "SealedRows"]

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
    ``groups`` maps id -> meta, or None if removed. A state to restore from is whole: every
    group and live row."""

    new_rows: Collection[Row]
    """Rows staged since the previous capture and still live (a view: no copy under the hold)."""
    removed_rows: list[int]
    groups: Mapping[int, GroupMeta | None]
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


class RolloutBuffer:
    """The groups buffered and their rows; see the module docstring."""

    def __init__(self, sealer: RowSealer | None = None) -> None:
        self._sealer = sealer
        """Seals committed rows (none: every row stays an object, as in unit tests)."""
        self._groups: dict[int, Group] = {}
        self._ready: deque[int] = deque()
        self._acked = 0
        """Groups ACKED, kept as a count: admission asks for it before every group."""
        self._row_ids: dict[tuple[int, int], int] = {}
        self._next_row_id = 1
        self._changes = ChangeLog()
        self._unsealed: OrderedDict[int, tuple[int, int]] = OrderedDict()
        """Finished groups whose rows are objects, oldest commit first: id -> (rows, values)."""
        self._unsealed_rows = 0
        self._unsealed_values = 0
        self._table: GroupTable | None = None
        """The groups a restore loaded, whose rows :meth:`keep_rows` gives them."""

    # --- queries ---------------------------------------------------------------------------

    @property
    def sealer(self) -> RowSealer | None:
        """What seals committed rows (a restore prepares its buffer with the same one)."""
        return self._sealer

    @property
    def groups(self) -> Mapping[int, Group]:
        """Every buffered group by id (read-only: changes go through the methods)."""
        return self._groups

    def get(self, group_id: int) -> Group:
        try:
            return self._groups[group_id]
        except KeyError:
            raise NotFound(f"group {group_id} is not in the buffer") from None

    @property
    def acked_groups(self) -> int:
        return self._acked

    @property
    def held(self) -> int:
        """Groups held against ``limits.buffer_capacity``: all but the acked ones, which wait
        for finalization (the rewind window bounds them)."""
        return len(self._groups) - self._acked

    @property
    def ready_count(self) -> int:
        return len(self._ready)

    def ready_ids(self) -> Iterator[int]:
        """The committed groups in the order they are leased (do not change the buffer while
        iterating)."""
        return iter(self._ready)

    def counts(self) -> BufferCounts:
        n = {s: 0 for s in GroupState}
        for g in self._groups.values():
            n[g.state] += 1
        return BufferCounts(
            n[GroupState.GENERATING],
            n[GroupState.COMMITTED],
            n[GroupState.LEASED],
            n[GroupState.ACKED],
            n[GroupState.FINISHING],
        )

    # --- the life of a group ---------------------------------------------------------------

    def _change(self, g: Group, **fields: object) -> None:
        """Every metadata change goes through here: a new frozen value, marked for the capture.
        A change of state must be one of the life cycle's :data:`TRANSITIONS`."""
        state = fields.get("state")
        if state is not None:
            check_transition(g.group_id, g.state, state)  # type: ignore[arg-type]
            self._acked += (state is GroupState.ACKED) - (g.state is GroupState.ACKED)
        g.meta = g.meta.evolve(**fields)
        self._changes.group_changed(g)

    def add(self, group: Group) -> None:
        if group.group_id in self._groups:
            raise InvariantError(f"group {group.group_id} admitted twice")
        self._groups[group.group_id] = group
        for sample in group.samples.values():
            self._add_row(group.group_id, sample)
        self._changes.group_added(group)

    def stage(self, group_id: int, sample: Sample) -> Group:
        """Adds a finished sibling; returns the group (complete when all siblings are staged)."""
        g = self.get(group_id)
        if g.state is not GroupState.GENERATING:
            raise InvariantError(f"sample staged into group {group_id} in state {g.state.value}")
        if sample.index in g.samples:
            raise InvariantError(f"sibling {sample.index} of group {group_id} staged twice")
        g.samples[sample.index] = sample
        self._add_row(group_id, sample)
        self._changes.group_changed(g)
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
        if self._sealer is not None and all(s.resumed_at is None for s in g.samples.values()):
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

    def lease(self, lease_id: str, count: int) -> tuple[int, ...]:
        """The first ``count`` ready groups, leased under ``lease_id``."""
        taken = tuple(self._ready.popleft() for _ in range(min(count, len(self._ready))))
        for gid in taken:
            self._change(self._groups[gid], state=GroupState.LEASED, lease_id=lease_id)
        return taken

    def grant(self, lease_id: str, group_ids: Iterable[int]) -> None:
        """Leases committed groups again after a restart (journal replay)."""
        for gid in group_ids:
            self._ready.remove(gid)
            self._change(self._groups[gid], state=GroupState.LEASED, lease_id=lease_id)

    def ack(self, lease_id: str, group_ids: Sequence[int], step: int) -> tuple[int, ...]:
        """Groups acked at ``step`` under ``lease_id``; returns them. Live, every one is LEASED;
        in journal replay one may also be COMMITTED (its lease was granted after the snapshot)."""
        for gid in group_ids:
            g = self._groups[gid]
            if g.state is GroupState.COMMITTED:
                self._ready.remove(gid)
            elif g.state is not GroupState.LEASED:
                raise InvariantError(f"ack of group {gid} in state {g.state.value}")
            self._change(g, state=GroupState.ACKED, lease_id=lease_id, ack_step=step)
        return tuple(group_ids)

    def requeue(self, group_ids: Sequence[int]) -> list[int]:
        """Makes a lease's groups available again, ahead of newer groups, in their order."""
        for gid in reversed(group_ids):
            self._change(self._groups[gid], state=GroupState.COMMITTED, lease_id=None)
            self._ready.appendleft(gid)
        return list(group_ids)

    def recommit(self, group_ids: Sequence[int]) -> list[Group]:
        """Acked groups become available again (a rewind), ahead of newer groups, in order."""
        groups: list[Group] = []
        for gid in group_ids:
            g = self._groups[gid]
            self._change(g, state=GroupState.COMMITTED, lease_id=None, ack_step=None)
            groups.append(g)
        self._ready.extendleft(reversed([g.group_id for g in groups]))
        return groups

    def remove(self, group_id: int, fate: GroupState) -> Group:
        """Removes a group and its rows; ``fate`` is the terminal state it leaves in."""
        g = self._groups[group_id]
        if fate not in TERMINAL:
            raise InvariantError(f"group {group_id} removed as {fate.value}, not a terminal state")
        check_transition(group_id, g.state, fate)
        del self._groups[group_id]
        self._acked -= g.state is GroupState.ACKED
        held = self._unsealed.pop(group_id, None)
        if held is not None:
            self._unsealed_rows -= held[0]
            self._unsealed_values -= held[1]
        if isinstance(g.samples, KeptSamples):
            for row_id in g.samples.row_ids().values():
                self._changes.row_removed(row_id)
        else:
            for index in g.samples:
                self._changes.row_removed(self._row_ids.pop((group_id, index)))
        if g.state is GroupState.COMMITTED:
            self._ready.remove(group_id)
        self._changes.group_removed(group_id)
        return g

    def drop_samples(self, group_id: int) -> None:
        """Forgets a generating group's staged siblings so the whole group is generated again."""
        g = self.get(group_id)
        for index in list(g.samples):
            self._changes.row_removed(self._row_ids.pop((group_id, index)))
        g.samples.clear()
        self._changes.group_changed(g)

    def _add_row(self, group_id: int, sample: Sample) -> None:
        row_id = self._next_row_id
        self._next_row_id += 1
        self._row_ids[(group_id, sample.index)] = row_id
        self._changes.row_added((row_id, group_id, sample))

    # --- sealing ---------------------------------------------------------------------------

    def seal(self, max_rows: float = math.inf, max_values: float = math.inf) -> None:
        """Seals the finished groups held as objects, oldest first: whole groups until
        ``max_rows`` rows or ``max_values`` values are sealed (by default every one). A sealed
        row not yet captured moves from the new rows to the sealed ones."""
        if self._sealer is None:
            return
        groups: list[Group] = []
        sealed_rows = sealed_values = 0
        while self._unsealed and sealed_rows < max_rows and sealed_values < max_values:
            gid, (n, v) = self._unsealed.popitem(last=False)
            groups.append(self._groups[gid])
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
        sealed = self._sealer.seal(rows)
        views = sealed.groups()
        uncaptured = False
        for row_id, gid, sample in rows:
            del self._row_ids[(gid, sample.index)]
            uncaptured |= self._changes.row_sealed(row_id)
        for g in groups:
            g.samples = views[g.group_id]
        if uncaptured:
            self._changes.sealed(sealed)

    # --- snapshots -------------------------------------------------------------------------

    def capture(self) -> BufferState:
        """Takes the changes since the last capture. O(changes), and no group is copied (its
        metadata is a frozen value): call under the exclusive hold."""
        changes = self._changes.take()
        return BufferState(
            changes.new_rows,
            changes.removed_rows,
            changes.groups,
            self._next_row_id,
            new_sealed=changes.new_sealed,  # type: ignore[arg-type]
            new_sealed_ids=changes.new_sealed_ids,
        )

    def restore_uncaptured(self, delta: BufferState) -> None:
        """Puts a captured delta back (its snapshot failed) so the next capture includes it."""
        self._changes.put_back(
            Changes(
                delta.new_rows,
                delta.removed_rows,
                dict(delta.groups),
                delta.new_sealed,
                delta.new_sealed_ids,
            ),
            self._groups,
        )

    def load(self, state: BufferState) -> None:
        """Rebuilds the buffer from a whole state; nothing is marked as changed. Each group is a
        :class:`RestoredGroup` over the state's :class:`GroupTable` (nothing decoded per
        group); its rows are ``state.kept_rows`` (see :meth:`keep_rows`), which a restore
        gives once the snapshot's rows have verified, after loading the rest."""
        if self._groups:
            raise InvariantError("restore into a non-empty buffer")
        table = restored_groups(state.groups)
        self._groups.update(zip(table.ids, RestoredGroup.build(table), strict=True))
        self._table = table
        self._acked = table.counts()[GroupState.ACKED]
        self._next_row_id = state.next_row_id
        self._ready = deque(table.committed_order())
        self.keep_rows(state.kept_rows)
        for row_id, gid, sample in state.new_rows:
            self._groups[gid].samples[sample.index] = sample
            self._row_ids[(gid, sample.index)] = row_id

    def take_over(self, prepared: RolloutBuffer) -> None:
        """Becomes ``prepared``, a buffer a restore loaded apart (while the snapshot's rows were
        still verifying), so that everything holding this buffer sees the restored groups."""
        if self._groups:
            raise InvariantError("restore into a non-empty buffer")
        if prepared.sealer is not self._sealer:
            raise InvariantError("a restore prepared the buffer with another sealer")
        self.__dict__.update(prepared.__dict__)

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
                self._groups[gid].samples = dict(kept)
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
