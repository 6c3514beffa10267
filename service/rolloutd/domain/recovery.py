"""Recovery: the controller's state in and out of snapshots, and what a restart resumes.

``capture()`` takes a consistent cut under the checkpoint's exclusive hold. A restore
(``checkpoint/restore.py``) resolves, verifies and reads a snapshot and the journal after it, and
hands them to :meth:`Recovery.recover` once, as one :class:`Recovered` value, before the
controller starts. ``recover`` times its own phases (``replay_metadata``, ``recovery_ledger``,
``redispatch``):

* the whole state goes in: leases that have not expired stay granted (their ack succeeds after
  the restart), the groups of expired ones become available again, or are evicted (after the
  journal's replay) when they are too stale;
* what was journaled after the snapshot is applied in journal order: acks and rewinds through
  the one ack and rewind paths, live lease grants granted again, accepted prompts queued again,
  the id counter moved past every reserved and journaled id, episode groups the snapshot does
  not hold built again from their journaled admission (same id; their prompt is not admitted
  again);
* unfinished groups resume: staged siblings are reused and missing ones continue from the tokens
  the snapshot held (granularity ``token``), start again (``sibling``), or the whole group is
  generated again (``group``); a FINISHING group goes to the finishing stage again.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from rolloutd.domain.buffer import RolloutBuffer, restored_groups
from rolloutd.domain.episode_log import EpisodeRecord, RecordKind, merged
from rolloutd.domain.errors import RestoreRefused
from rolloutd.domain.group import UNFINISHED, Group, GroupMeta, GroupState, GroupTable
from rolloutd.domain.journal import (
    IdReservation,
    Journaled,
    JournaledAck,
    JournaledAdmission,
    JournaledDrop,
    JournaledEpisode,
    JournaledLease,
    JournaledRewind,
    JournaledSubmission,
)
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.partial import PartialSibling
from rolloutd.domain.report import (
    Disposition,
    PhaseClock,
    RecoveryState,
    RestorePhase,
    TokenDisposition,
)
from rolloutd.domain.rooms import Rooms
from rolloutd.domain.sampler import Admission
from rolloutd.domain.snapshot import ControllerState

log = logging.getLogger(__name__)

Named = TypeVar("Named", JournaledAck, JournaledLease)
"""A journal record that may name its groups' prompts by reference."""


class Granularity(enum.Enum):
    """What a restore generates again of an unfinished group (``recovery.granularity``)."""

    TOKEN = "token"
    """Missing siblings continue from the tokens the snapshot captured."""
    SIBLING = "sibling"
    """Missing siblings start again from their first token."""
    GROUP = "group"
    """The whole group is generated again."""


@dataclass(frozen=True)
class Recovered:
    """What a restore read, handed to the controller once."""

    state: ControllerState | None
    """The snapshot's whole state, partial siblings included (None: no snapshot; the journal
    alone is replayed into the fresh controller)."""
    buffer: RolloutBuffer | None
    """The state's buffer from :meth:`Recovery.prepare`, its verified rows kept (None: built
    from ``state`` here)."""
    journal: Callable[[], Sequence[Journaled]]
    """Reads what the journal holds after the snapshot, in journal order: called once, on a
    thread, in the ``recovery_ledger`` phase."""
    granularity: Granularity = Granularity.TOKEN


@dataclass
class RecoveryCounts:
    """What :meth:`Recovery.recover` found and did, for the restore's report."""

    groups: dict[RecoveryState, int] = field(default_factory=dict)
    siblings: dict[Disposition, int] = field(default_factory=dict)
    tokens: dict[TokenDisposition, int] = field(default_factory=dict)
    redispatch_s: float = 0.0
    events: int = 0
    """Journal records replayed."""


@dataclass(frozen=True)
class Resumption:
    """What resuming one unfinished group did."""

    rerun: list[int]
    """Siblings generated (again or continued)."""
    continued: list[int]
    """Of those, the ones continued from their partial tokens."""
    reused_tokens: int
    """Partial tokens continued from."""
    regenerated_tokens: int
    """Partial tokens the snapshot held but that are generated again."""


class Recovery:
    """Capture and restore of the controller's state; see the module docstring. It composes
    the rooms' own ``capture`` and ``restore`` and hands each journal record to the room that
    applies it; it writes none of their state itself."""

    def __init__(self, rooms: Rooms) -> None:
        self._rooms = rooms
        self._partials: dict[tuple[int, int], PartialSibling] = {}
        """Episodes' partial siblings a restore found, until their group resumes (or the restore
        ends). A plain sibling's partial tokens wait in the accounting's staging instead, where
        they count as buffered (domain/fate.py); an episode's are counted with its sample."""
        self._episodes: dict[tuple[int, int], list[EpisodeRecord]] = {}
        """Episode records the journal held after the snapshot, until their group resumes."""
        self._rebuilt: list[int] = []
        """Groups no snapshot held that the journal's admission records built again."""

    # --- out -------------------------------------------------------------------------------

    def capture(self) -> ControllerState:
        """The changes since the last capture and the rest of the state, no I/O: pointer work
        proportional to the changed rows and groups, plus copies of the lease and ack tables and
        of the sampler's queues (bounded by leases and acks outstanding, not by the buffer), plus
        one reference and one length per generating sibling (its partial tokens, whole).
        Call only while holding the barrier exclusively."""
        r = self._rooms
        if not r.barrier.exclusive_held:
            raise RuntimeError("capture() needs the exclusive hold of the barrier")
        r.acking.apply_durable_acks()
        counters, partials = r.accounting.capture()
        return ControllerState(
            buffer=r.buffer.capture(),
            ledger=r.ledger.capture(),
            sampler=r.sampler.capture(),
            counters=counters,
            next_group_id=r.ids.capture(),
            policy=r.policy.capture(),
            partials=partials + r.flight.episode_partials(),
            concurrency=r.admitter.capture(),
        )

    def capture_failed(self, state: ControllerState) -> None:
        """Hands back a capture whose snapshot failed, so the next capture includes it."""
        self._rooms.buffer.restore_uncaptured(state.buffer)
        self._rooms.ledger.restore_uncaptured(state.ledger)

    # --- in --------------------------------------------------------------------------------

    def prepare(self, state: ControllerState) -> RolloutBuffer:
        """The buffer of ``state``, built apart from the controller, so that a restore builds it
        while the snapshot's rows are still being read and verified (the state holds none of
        them yet: :meth:`RolloutBuffer.keep_rows` gives them once they verify). Touches nothing
        of the controller.

        Raises :class:`RestoreRefused` when the sampler's cursor is not ahead of every group's
        position that it does not skip (admission would create a second group for a buffered
        position).
        """
        groups = restored_groups(state.buffer.groups)
        # a position the sampler skips (an episode group built again from the journal) is
        # never admitted again either
        skipped = set(state.sampler.skip)
        for cursor in state.sampler.cursors or (state.sampler.cursor,):
            ahead = sorted(
                str(p)
                for p in groups.positions_from(cursor.epoch, cursor.offset, cursor.source)
                if p not in skipped
            )
            if ahead:
                raise RestoreRefused(
                    f"sampler cursor {cursor} is not ahead of restored group positions "
                    + ", ".join(ahead[:10])
                    + (" ..." if len(ahead) > 10 else "")
                )
        buffer = RolloutBuffer(self._rooms.buffer.sealer)
        buffer.load(replace(state.buffer, groups=groups))
        return buffer

    async def recover(self, recovered: Recovered, clock: PhaseClock) -> RecoveryCounts:
        """Rebuilds the controller from what a restore read, before ``start()``; see the module
        docstring. Raises :class:`RestoreRefused` as :meth:`prepare` does."""
        counts = RecoveryCounts()
        state = recovered.state
        if state is None:
            with clock.phase(RestorePhase.RECOVERY_LEDGER):
                counts.events = await self._replay(recovered.journal)
            if self._rebuilt:
                with clock.phase(RestorePhase.REDISPATCH):
                    await self._resume(self._rebuilt, recovered.granularity, counts)
            return counts
        table = restored_groups(state.buffer.groups)
        counts.groups = _found(table)
        with clock.phase(RestorePhase.REPLAY_METADATA):
            await self._load(state, recovered.buffer or self.prepare(state))
        with clock.phase(RestorePhase.RECOVERY_LEDGER):
            counts.events = await self._replay(recovered.journal)
            # after the replay, which may ack a group whose lease expired: groups the
            # snapshot held leased come back committed, and the stale ones must not be delivered
            await self._rooms.policy.evict_stale()
        with clock.phase(RestorePhase.REDISPATCH):
            started = time.perf_counter()
            # a journal replay can end a group's generation and start only the episode groups
            # it builds again: with the snapshot's unfinished groups, that is all to look at
            unfinished = table.unfinished() + self._rebuilt
            await self._resume(unfinished, recovered.granularity, counts)
            counts.redispatch_s = time.perf_counter() - started
        return counts

    async def _load(self, state: ControllerState, prepared: RolloutBuffer) -> None:
        r = self._rooms
        async with r.barrier.mutation(MutationKind.RESTORE):
            r.sampler.restore(state.sampler)
            r.buffer.take_over(prepared)
            r.ids.restore(state.next_group_id)
            r.ledger.load(state.ledger)
            r.leasing.requeue_expired()
            r.accounting.load(
                state.counters, (p for p in state.partials if _plain(p)), r.buffer.groups
            )
            self._partials = {(p.group_id, p.index): p for p in state.partials if not _plain(p)}
        await r.policy.restore(state.policy)
        r.admitter.restore(state.concurrency)

    async def _replay(self, journal: Callable[[], Sequence[Journaled]]) -> int:
        """Applies what was journaled after the restored snapshot (see the module docstring);
        returns how many records."""
        r = self._rooms
        events = await asyncio.to_thread(journal)
        now = r.clock()
        async with r.barrier.mutation(MutationKind.RESTORE):
            for event in events:
                if isinstance(event, IdReservation):
                    r.ids.seen_reservation(event.through)
                elif isinstance(event, JournaledSubmission):
                    r.intake.replay(event)
                elif isinstance(event, JournaledDrop):
                    r.ids.seen([event.group_id])
                    r.drops.replay(event)
                elif isinstance(event, JournaledAdmission):
                    r.ids.seen([event.meta.group_id])
                    self._rebuild(event.meta)
                elif isinstance(event, JournaledEpisode):
                    key = (event.group_id, event.index)
                    self._episodes.setdefault(key, []).append(event.record)
                elif isinstance(event, JournaledRewind):
                    r.acking.apply_rewind(event.trainer_step)
                elif isinstance(event, JournaledLease):
                    r.ids.seen(event.lease.group_ids)
                    if event.lease.expires_at > now:
                        r.leasing.regrant(self._resolved(event))
                else:
                    r.ids.seen(event.record.group_ids)
                    r.acking.apply_ack(self._resolved(event))
        return len(events)

    def _resolved(self, event: Named) -> Named:
        """``event`` with the prompts its record names by reference resolved, at its place in
        the replay (after the submissions journaled before it). Only the groups no snapshot
        held need them, but a record does not say which those are."""
        if not event.refs:
            return event
        sampler = self._rooms.sampler
        try:
            found = {gid: sampler.resolve(r.prompt_id, r.position) for gid, r in event.refs.items()}
        except KeyError as exc:
            raise RestoreRefused(
                f"the journal names a prompt that neither the dataset nor a submission holds "
                f"({exc.args[0]}): was the dataset changed under the store?"
            ) from None
        return replace(event, admissions={**event.admissions, **found}, refs={})

    def _rebuild(self, meta: GroupMeta) -> None:
        """An episode group admitted after the snapshot: built again under its id when the
        snapshot does not hold it, so that the episode records journaled for it are reused,
        and its prompt is never admitted again (inside the RESTORE mutation). What the journal
        holds after this (a drop, a lease, an ack) applies to it as to a group the snapshot
        held."""
        r = self._rooms
        if meta.group_id in r.buffer.groups:
            return
        r.buffer.add(Group(meta))
        r.sampler.taken(Admission(meta.prompt, meta.position))
        r.accounting.admitted()
        self._rebuilt.append(meta.group_id)

    async def _resume(
        self, unfinished: list[int], granularity: Granularity, counts: RecoveryCounts
    ) -> None:
        reused = rerun = tokens_reused = tokens_regenerated = 0
        groups = self._rooms.buffer.groups
        for g in (groups[gid] for gid in unfinished if gid in groups):
            if g.state is GroupState.FINISHING:
                self._rooms.finisher.finish_later(g)
                continue
            staged = len(g.samples)
            done = await self.resume_group(
                g,
                rerun_all=granularity is Granularity.GROUP,
                from_tokens=granularity is Granularity.TOKEN,
            )
            rerun += len(done.rerun)
            reused += staged if granularity is not Granularity.GROUP else 0
            tokens_reused += done.reused_tokens
            tokens_regenerated += done.regenerated_tokens
        counts.siblings = {Disposition.REUSED: reused, Disposition.RERUN: rerun}
        counts.tokens = {
            TokenDisposition.REUSED: tokens_reused,
            TokenDisposition.REGENERATED: tokens_regenerated,
        }
        self._partials = {}
        self._episodes = {}
        self._rebuilt = []

    async def resume_group(
        self, group: Group, *, rerun_all: bool, from_tokens: bool = False
    ) -> Resumption:
        """Generates a GENERATING group's missing siblings (or all of them). With
        ``from_tokens`` a missing sibling whose partial tokens the snapshot held continues from
        them; otherwise they are discarded and the sibling starts again. A group whose siblings
        are all staged (a snapshot taken before the finishing stage existed) is finished."""
        r = self._rooms
        if rerun_all and group.samples:
            async with r.barrier.mutation(MutationKind.RESTORE):
                r.accounting.regenerated(group.generated_tokens)
                r.buffer.drop_samples(group.group_id)
        missing = group.missing
        gid = group.group_id
        plain = {
            i: PartialSibling(gid, i, deltas, len(deltas))
            for i in range(group.meta.group_size)
            if (deltas := r.accounting.take((gid, i))) is not None
        }
        found = {i: self._partials.pop((gid, i), None) for i in range(group.meta.group_size)}
        held = {**{i: p for i, p in found.items() if p is not None}, **plain}
        episodes = {
            i: merged(
                held[i].episode_records if i in held else (),
                self._episodes.pop((gid, i), ()),
            )
            for i in missing
        }
        episodes = {i: records for i, records in episodes.items() if records}
        prefixes = {
            i: p
            for i, p in held.items()
            if from_tokens
            and i in missing
            and len(p)
            and (p.turn is None or not any(_is_turn(r, p.turn) for r in episodes.get(i, ())))
        }
        if not missing:
            async with r.barrier.mutation(MutationKind.RESTORE):
                r.buffer.finish(group.group_id)
            r.finisher.finish_later(group)
        else:
            r.generation.dispatch(group, missing, prefixes, episodes)
        total = sum(len(p) for p in held.values())
        reused = sum(len(p) for p in prefixes.values())
        # only a plain sibling's partial tokens were counted as generated
        r.accounting.regenerated(sum(len(p) for i, p in plain.items() if i not in prefixes))
        return Resumption(missing, sorted(prefixes), reused, total - reused)


def _is_turn(record: EpisodeRecord, turn: int) -> bool:
    """Whether ``record`` is model turn ``turn`` (a partial of a turn that finished is stale)."""
    return record.kind is RecordKind.TURN and record.turn == turn


def _found(table: GroupTable) -> dict[RecoveryState, int]:
    """Groups by the state the snapshot found them in (leases are requeued after)."""
    found = table.counts()
    return {
        RecoveryState.COMMITTED: found[GroupState.COMMITTED],
        RecoveryState.LEASED: found[GroupState.LEASED],
        RecoveryState.ACKED: found[GroupState.ACKED],
        RecoveryState.UNFINISHED: sum(found[s] for s in UNFINISHED),
    }


def _plain(partial: PartialSibling) -> bool:
    """A plain sibling's partial tokens, not an episode's."""
    return partial.turn is None and not partial.episode_records
