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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from rolloutd.domain.buffer import RolloutBuffer, restored_groups
from rolloutd.domain.core import Core
from rolloutd.domain.delivery import Delivery
from rolloutd.domain.episode_log import EpisodeRecord, RecordKind, merged
from rolloutd.domain.errors import InvariantError, RestoreRefused
from rolloutd.domain.generation import Generation
from rolloutd.domain.group import UNFINISHED, Group, GroupMeta, GroupState, GroupTable
from rolloutd.domain.ids import ID_BITS, local_id
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.partial import PartialSibling
from rolloutd.domain.report import (
    Disposition,
    PhaseClock,
    RecoveryState,
    RestorePhase,
    TokenDisposition,
)
from rolloutd.domain.sampler import Admission
from rolloutd.domain.state import (
    ControllerState,
    IdReservation,
    Journaled,
    JournaledAck,
    JournaledAdmission,
    JournaledDrop,
    JournaledEpisode,
    JournaledLease,
    JournaledRewind,
    JournaledSubmission,
    LostLease,
)

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
    """Capture and restore of the controller's state; see the module docstring."""

    def __init__(self, core: Core, generation: Generation, delivery: Delivery) -> None:
        self.core = core
        self.generation = generation
        self.delivery = delivery
        self._partials: dict[tuple[int, int], PartialSibling] = {}
        """Episodes' partial siblings a restore found, until their group resumes (or the restore
        ends). A plain sibling's partial tokens wait in ``Core.staging`` instead, where they
        count as buffered (domain/fate.py); an episode's are counted with its sample."""
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
        core = self.core
        if not core.barrier.exclusive_held:
            raise RuntimeError("capture() needs the exclusive hold of the barrier")
        self.delivery.apply_durable_acks()
        core.clock_engine(read=True)
        return ControllerState(
            buffer=core.buffer.capture(),
            sampler=core.sampler.capture(),
            counters=core.counters.copy(),
            # the next id a restore may issue: past every id that may have been handed out
            next_group_id=max(core.next_group_id, core.ids_reserved_through + 1),
            policy_version=core.policy_version,
            weights_path=core.weights_path,
            max_acked_step=core.max_acked_step,
            finalized_through=core.finalized_through,
            lost_acks=tuple(core.lost_acks),
            lost_leases=tuple(
                LostLease(lease_id, tuple(lost), tuple(lost.values()))
                for lease_id, lost in core.lost_leased.items()
            ),
            partials=self.generation.partials(),
            gate=core.gate.state(),
            concurrency=self.generation.limit.state(),
        )

    def capture_failed(self, state: ControllerState) -> None:
        """Hands back a capture whose snapshot failed, so the next capture includes it."""
        self.core.buffer.restore_uncaptured(state.buffer)

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
        buffer = RolloutBuffer(self.core.buffer.sealer)
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
            await self.generation.evict_stale()
        with clock.phase(RestorePhase.REDISPATCH):
            started = time.perf_counter()
            # a journal replay can end a group's generation and start only the episode groups
            # it builds again: with the snapshot's unfinished groups, that is all to look at
            unfinished = table.unfinished() + self._rebuilt
            await self._resume(unfinished, recovered.granularity, counts)
            counts.redispatch_s = time.perf_counter() - started
        return counts

    async def _load(self, state: ControllerState, prepared: RolloutBuffer) -> None:
        core = self.core
        if core.buffer.groups:
            raise InvariantError("restore into a non-empty buffer")
        async with core.barrier.mutation(MutationKind.RESTORE):
            core.sampler.restore(state.sampler)
            core.buffer = prepared
            core.counters = state.counters.copy()
            core.next_group_id = state.next_group_id
            core.max_acked_step = state.max_acked_step
            core.finalized_through = state.finalized_through
            core.lost_acks = list(state.lost_acks)
            core.lost_leased = {
                lost.lease_id: dict(zip(lost.group_ids, lost.admissions, strict=True))
                for lost in state.lost_leases
            }
            for lease in core.buffer.expired_leases(core.clock()):
                self.delivery.requeue(lease.lease_id)
            # plain partial siblings wait in the staging until their group resumes or leaves
            core.staging = {
                (p.group_id, p.index): list(p.deltas) for p in state.partials if _plain(p)
            }
            self._partials = {(p.group_id, p.index): p for p in state.partials if not _plain(p)}
            self._account_from_here()
        if state.weights_path and state.policy_version > core.engine.policy_version:
            await core.engine.update_weights(state.weights_path, state.policy_version)
        core.policy_version, core.weights_path = state.policy_version, state.weights_path
        core.gate.restore(state.gate, core.policy_version)
        self.generation.limit.restore(state.concurrency)

    def _account_from_here(self) -> None:
        """A snapshot written before tokens were accounted for (domain/fate.py) holds tokens it
        never counted as generated: the account starts at this restore, with them buffered (or
        delivered, for acked groups). A snapshot that counted nothing holds none."""
        core = self.core
        counters = core.counters
        if counters.generated_tokens:
            return
        buffered, acked = core.held_tokens()
        counters.delivered_tokens += acked
        counters.generated_tokens = sum(counters.settled().values()) + buffered

    async def _replay(self, journal: Callable[[], Sequence[Journaled]]) -> int:
        """Applies what was journaled after the restored snapshot (see the module docstring);
        returns how many records."""
        core = self.core
        events = await asyncio.to_thread(journal)
        now = core.clock()
        async with core.barrier.mutation(MutationKind.RESTORE):
            for event in events:
                if isinstance(event, IdReservation):
                    core.next_group_id = max(core.next_group_id, event.through + 1)
                elif isinstance(event, JournaledSubmission):
                    core.sampler.submit(event.prompts, bounded=False)
                elif isinstance(event, JournaledDrop):
                    self._bump_ids([event.group_id])
                    self._replay_drop(event)
                elif isinstance(event, JournaledAdmission):
                    self._bump_ids([event.meta.group_id])
                    self._replay_admission(event.meta)
                elif isinstance(event, JournaledEpisode):
                    key = (event.group_id, event.index)
                    self._episodes.setdefault(key, []).append(event.record)
                elif isinstance(event, JournaledRewind):
                    self.delivery.apply_rewind(event.trainer_step)
                elif isinstance(event, JournaledLease):
                    self._bump_ids(event.lease.group_ids)
                    if event.lease.expires_at > now:
                        self._regrant(self._resolved(event))
                else:
                    self._bump_ids(event.record.group_ids)
                    core.lost_leased.pop(event.record.lease_id, None)
                    self.delivery.apply_ack(self._resolved(event))
        return len(events)

    def _resolved(self, event: Named) -> Named:
        """``event`` with the prompts its record names by reference resolved, at its place in
        the replay (after the submissions journaled before it). Only the groups no snapshot
        held need them, but a record does not say which those are."""
        if not event.refs:
            return event
        sampler = self.core.sampler
        try:
            found = {gid: sampler.resolve(r.prompt_id, r.position) for gid, r in event.refs.items()}
        except KeyError as exc:
            raise RestoreRefused(
                f"the journal names a prompt that neither the dataset nor a submission holds "
                f"({exc.args[0]}): was the dataset changed under the store?"
            ) from None
        return replace(event, admissions={**event.admissions, **found}, refs={})

    def _replay_drop(self, drop: JournaledDrop) -> None:
        """A drop journaled after the snapshot: the group leaves the buffer when the snapshot
        held it unfinished, else its position is never admitted (inside the RESTORE mutation)."""
        core = self.core
        group = core.buffer.groups.get(drop.group_id)
        tokens = 0  # what the group generated after the snapshot was never counted here
        if group is None:
            core.sampler.skip(drop.admission)
        else:
            tokens = group.generated_tokens + core.release_partials(drop.group_id)
            core.buffer.remove(drop.group_id, GroupState.DROPPED)
        core.counters.dropped(drop.reason, tokens)
        log.debug(
            "group %d (prompt %s) dropped: %s (replayed from the journal)",
            drop.group_id,
            drop.admission.prompt.prompt_id,
            drop.reason,
        )

    def _replay_admission(self, meta: GroupMeta) -> None:
        """An episode group admitted after the snapshot: built again under its id when the
        snapshot does not hold it, so that the episode records journaled for it are reused,
        and its prompt is never admitted again (inside the RESTORE mutation). What the journal
        holds after this (a drop, a lease, an ack) applies to it as to a group the snapshot
        held."""
        core = self.core
        if meta.group_id in core.buffer.groups:
            return
        core.buffer.add(Group(meta))
        core.sampler.taken(Admission(meta.prompt, meta.position))
        core.counters.admitted_groups += 1
        self._rebuilt.append(meta.group_id)

    def _bump_ids(self, group_ids: Iterable[int]) -> None:
        core = self.core
        mine = [local_id(g) for g in group_ids if g >> ID_BITS == core.config.replica]
        if mine:
            core.next_group_id = max(core.next_group_id, max(mine) + 1)

    def _regrant(self, event: JournaledLease) -> None:
        """A live lease from the journal, granted again (inside the RESTORE mutation)."""
        core = self.core
        buffer = core.buffer
        lease = event.lease
        if lease.lease_id in buffer.acks or lease.lease_id in buffer.finalized_leases:
            return
        if lease.lease_id in buffer.leases:
            buffer.requeue(lease.lease_id)
        held = tuple(
            g
            for g in lease.group_ids
            if g in buffer.groups and buffer.groups[g].state is GroupState.COMMITTED
        )
        for gid in lease.group_ids:
            g = buffer.groups.get(gid)
            if g is not None and g.state in UNFINISHED:
                # finished and leased after the snapshot: delivered (domain/fate.py)
                core.counters.delivered_tokens += g.generated_tokens + core.release_partials(gid)
                buffer.remove(gid, GroupState.LOST)
        lost = {g: event.admissions[g] for g in lease.group_ids if g not in held}
        for admission in lost.values():
            core.sampler.skip(admission)
        buffer.grant(replace(lease, group_ids=held))
        if lost:
            core.lost_leased[lease.lease_id] = lost

    async def _resume(
        self, unfinished: list[int], granularity: Granularity, counts: RecoveryCounts
    ) -> None:
        reused = rerun = tokens_reused = tokens_regenerated = 0
        groups = self.core.buffer.groups
        for g in (groups[gid] for gid in unfinished if gid in groups):
            if g.state is GroupState.FINISHING:
                self.generation.finish_later(g)
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
        core = self.core
        if rerun_all and group.samples:
            async with core.barrier.mutation(MutationKind.RESTORE):
                core.counters.regenerated_tokens += group.generated_tokens
                core.buffer.drop_samples(group.group_id)
        missing = group.missing
        gid = group.group_id
        plain = {
            i: PartialSibling(gid, i, deltas, len(deltas))
            for i in range(group.meta.group_size)
            if (deltas := core.staging.pop((gid, i), None)) is not None
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
            async with core.barrier.mutation(MutationKind.RESTORE):
                core.buffer.finish(group.group_id)
            self.generation.finish_later(group)
        else:
            self.generation.dispatch(group, missing, prefixes, episodes)
        total = sum(len(p) for p in held.values())
        reused = sum(len(p) for p in prefixes.values())
        # only a plain sibling's partial tokens were counted as generated
        core.counters.regenerated_tokens += sum(
            len(p) for i, p in plain.items() if i not in prefixes
        )
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
