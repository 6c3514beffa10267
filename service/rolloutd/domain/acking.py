"""Acking: what trainers consumed, and their own checkpoints and restarts (docs/design.md, "The
delivery contract").

``ack`` consumes a lease at a trainer step, durable (journaled) before it returns and idempotent,
also across a restart. ``finalize(step)`` drops the groups acked at steps <= step (the trainer
checkpointed), ``rewind(step)`` makes the groups acked after ``step`` available again (the
trainer restarted from its checkpoint), journaled before it returns. Acks older than
``limits.rewind_window`` steps finalize by themselves. The ack and rewind paths here are the
ones journal replay takes too, so a restart applies them exactly as they were applied live.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from rolloutd.domain.accounting import Accounting
from rolloutd.domain.barrier import MutationBarrier
from rolloutd.domain.buffer import RolloutBuffer
from rolloutd.domain.errors import (
    FailedPrecondition,
    InvalidArgument,
    InvariantError,
    NotFound,
    not_durable,
)
from rolloutd.domain.group import UNFINISHED, GroupState
from rolloutd.domain.journal import AckRecord, DeliveryJournal, JournaledAck
from rolloutd.domain.leasing import admissions
from rolloutd.domain.ledger import DeliveryLedger, LostAck, PendingAck, check_same_step
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.observer import Observer
from rolloutd.domain.policy import Policy
from rolloutd.domain.sampler import Sampler
from rolloutd.domain.wakeups import Wakeups

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AckingConfig:
    rewind_window: int = 8
    max_step_ahead: int = 1_000_000


@dataclass(frozen=True)
class AckResult:
    acked_groups: int
    already_acked: bool


@dataclass(frozen=True)
class RewindResult:
    redelivered_groups: int
    readmitted_prompts: int


class Acking:
    """Acks, finalization and rewinds; see the module docstring."""

    def __init__(
        self,
        config: AckingConfig,
        buffer: RolloutBuffer,
        ledger: DeliveryLedger,
        barrier: MutationBarrier,
        policy: Policy,
        accounting: Accounting,
        sampler: Sampler,
        journal: DeliveryJournal,
        observer: Observer,
        wakeups: Wakeups,
        clock: Callable[[], float],
    ) -> None:
        self._config = config
        self._buffer = buffer
        self._ledger = ledger
        self._barrier = barrier
        self._policy = policy
        self._accounting = accounting
        self._sampler = sampler
        self._journal = journal
        self._observer = observer
        self._wakeups = wakeups
        self._clock = clock
        self._orphans: set[asyncio.Future[None]] = set()
        """Settlements of acks whose callers went away, kept until done."""
        self._told_step_went_back = False

    # --- acks ------------------------------------------------------------------------------

    async def ack(self, lease_id: str, trainer_step: int) -> AckResult:
        """Consumes a lease at ``trainer_step``; durable (journaled) before it returns, and
        idempotent: acking a lease acked before (also before a restart) succeeds again.

        The record is queued for the journal inside the ACK mutation, but the mutation does not
        wait for the sync: a checkpoint may come in between. The ack is applied once durable,
        by :meth:`_settle` or by the capture of a checkpoint that finds it durable first
        (:meth:`apply_durable_acks`), so a snapshot holds an ack exactly when its
        ``acks_through`` covers the record. A failed sync applies nothing: the lease stays
        granted and the call fails ``Unavailable``, to be retried. A second ack of the lease
        while the first is pending waits for the same record.
        """
        if not lease_id:
            raise InvalidArgument("lease_id", "must not be empty")
        self.check_step(trainer_step)
        ledger = self._ledger
        async with self._barrier.mutation(MutationKind.ACK):
            known = self._acked_before(lease_id)
            if known is not None:
                check_same_step(lease_id, known[0], trainer_step)
                return AckResult(known[1], already_acked=True)
            pending = ledger.pending(lease_id)
            if pending is not None:
                check_same_step(lease_id, pending.ack.record.trainer_step, trainer_step)
            else:
                pending = self._queue(lease_id, trainer_step)
        try:
            await self._settle(pending)
        except asyncio.CancelledError:
            # the caller went away: a durable ack is applied all the same
            orphan = asyncio.ensure_future(self._settle(pending))
            self._orphans.add(orphan)
            orphan.add_done_callback(self._orphans.discard)
            raise
        await self._wakeups.notify()  # acked groups no longer count against the buffer's capacity
        cfg = self._config
        through = max(ledger.max_acked_step - cfg.rewind_window, ledger.finalized_through)
        if through > ledger.finalized_through or trainer_step <= ledger.finalized_through:
            # the window moved on, or this ack is below it (a trainer whose steps lag another's):
            # no rewind can reach it, so it must not wait in the buffer for the window
            await self.finalize(through)
        return AckResult(len(pending.ack.record.group_ids), already_acked=False)

    def _acked_before(self, lease_id: str) -> tuple[int, int] | None:
        """(step, groups) of a lease acked already: waiting for finalization, or finalized
        (its groups are gone: 0)."""
        ledger = self._ledger
        step = ledger.acked_at(lease_id)
        if step is None:
            return None
        record = ledger.acks.get(lease_id)
        return step, 0 if record is None else len(record.group_ids)

    def _queue(self, lease_id: str, trainer_step: int) -> PendingAck:
        """Queues the record of a first ack of a live lease for the journal (inside the ACK
        mutation)."""
        ledger = self._ledger
        lease = ledger.leases.get(lease_id)
        if lease is None:
            raise NotFound(f"lease {lease_id!r} is unknown or expired")
        if trainer_step < ledger.max_acked_step and not self._told_step_went_back:
            self._told_step_went_back = True  # once until a Rewind: trainers may lag
            log.warning(
                "ack at trainer step %d, below step %d acked before: a trainer restarted from "
                "its checkpoint S calls Rewind(trainer_step=S) before fetching, or the groups it "
                "acked after S are not delivered again (trainers whose steps lag one another's "
                "can ignore this; said once until a Rewind)",
                trainer_step,
                ledger.max_acked_step,
            )
        lost = ledger.lost_of(lease_id)
        record = AckRecord(lease_id, lease.group_ids + tuple(lost), trainer_step, self._clock())
        named = {**admissions(self._buffer, lease.group_ids), **lost}
        pending = PendingAck(JournaledAck(record, lost), self._journal.ack(record, named))
        ledger.queue(pending)
        return pending

    async def _settle(self, pending: PendingAck) -> None:
        """Waits for the ack's record outside the barrier, then applies it (once, whoever of
        its callers or a capture comes first)."""
        try:
            await asyncio.shield(pending.durable)  # shared by every caller of this ack
        except OSError as exc:
            self._ledger.unqueue(pending)
            raise not_durable("the ack", exc) from exc
        async with self._barrier.mutation(MutationKind.ACK):
            if self._ledger.unqueue(pending):  # else a capture applied it already
                self.apply_ack(pending.ack)

    def apply_durable_acks(self) -> None:
        """Under the exclusive hold, before a capture: applies every ack whose record the
        journal's position already covers, so the snapshot agrees with its ``acks_through``.
        Acks still syncing are left to :meth:`_settle` and to replay."""
        for pending in self._ledger.applicable():
            self._ledger.unqueue(pending)
            self.apply_ack(pending.ack)

    def apply_ack(self, ack: JournaledAck) -> None:
        """The one ack path, live and in journal replay; inside an ACK or RESTORE mutation.

        Groups of the ack that the buffer does not hold (admitted and acked after the snapshot
        a restore started from) are never admitted again, but remembered so that a ``Rewind``
        to before the ack re-admits them. In replay a group of the ack may still be unfinished
        in the snapshot (it finished, was leased and acked after it, but its siblings were
        never all durable): it leaves as LOST, delivered with what the snapshot held of it.
        """
        record = ack.record
        known = self._ledger.acked_at(record.lease_id)
        if known is not None:
            check_same_step(record.lease_id, known, record.trainer_step)
            return  # acked already: idempotent
        buffer = self._buffer
        for gid in record.group_ids:
            g = buffer.groups.get(gid)
            if g is not None and g.state in UNFINISHED:
                self._accounting.left(g, GroupState.LOST)
                buffer.remove(gid, GroupState.LOST)
        held = [buffer.groups[gid] for gid in record.group_ids if gid in buffer.groups]
        present = buffer.ack(record.lease_id, [g.group_id for g in held], record.trainer_step)
        self._ledger.record_ack(replace(record, group_ids=present))
        self._accounting.acked(
            [self._source(gid, ack) for gid in record.group_ids],
            sum(g.generated_tokens for g in held),
        )
        lost = [gid for gid in record.group_ids if gid not in buffer.groups]
        if lost:
            if not ack.admissions:
                raise InvariantError(f"live ack of lease {record.lease_id} lost groups {lost}")
            named = tuple(ack.admissions[gid] for gid in lost)
            for admission in named:
                self._sampler.skip(admission)
            self._ledger.lost_ack(LostAck(record.trainer_step, named))

    def _source(self, group_id: int, ack: JournaledAck) -> str:
        """The source of an acked group: from the buffer, else from the ack's journal record."""
        group = self._buffer.groups.get(group_id)
        if group is not None:
            return self._sampler.source_name(group.meta.position)
        admission = ack.admissions.get(group_id)
        return self._sampler.source_name(None if admission is None else admission.position)

    def check_step(self, trainer_step: int) -> None:
        """Refuses a trainer step below 0, or more than ``max_step_ahead`` ahead of the highest
        step seen (acked or finalized): one absurd step would finalize every ack before it and
        refuse every ``Rewind`` below it (docs/operations.md, "Resetting a policy version or
        trainer step")."""
        if trainer_step < 0:
            raise InvalidArgument("trainer_step", f"must be >= 0, got {trainer_step}")
        seen = self._ledger.highest_step
        ahead = self._config.max_step_ahead
        if trainer_step > seen + ahead:
            raise InvalidArgument(
                "trainer_step",
                f"{trainer_step} is more than limits.max_step_ahead={ahead} ahead of the highest "
                f"trainer step seen ({seen})",
            )

    # --- the trainer's checkpoints ---------------------------------------------------------

    async def finalize(self, through_step: int) -> int:
        """Drops groups acked at steps <= ``through_step``; returns how many."""
        async with self._barrier.mutation(MutationKind.FINALIZE):
            done = self._ledger.finalize(through_step)
            dropped = [
                self._buffer.remove(gid, GroupState.FINALIZED)
                for record in done
                for gid in record.group_ids
            ]
            self._accounting.finalized(len(dropped))
        if dropped:
            await self._wakeups.notify()
        return len(dropped)

    async def rewind(self, trainer_step: int) -> RewindResult:
        """Groups acked after ``trainer_step`` become available again, and the prompts of acked
        groups no snapshot held, or that fell too stale meanwhile, are admitted again.

        Durable (journaled) before it returns, like an ack, so a restart does not bring the
        rewound acks back; a failed sync changes nothing and fails ``Unavailable``. The record is
        synced inside the mutation (a rewind is rare), so a checkpoint's cut holds the rewind
        exactly when its journal position covers the record; acks journaled before it are
        applied first, in the order that replay applies them.
        """
        if trainer_step < 0:
            raise InvalidArgument("trainer_step", f"must be >= 0, got {trainer_step}")
        async with self._barrier.mutation(MutationKind.REWIND):
            finalized = self._ledger.finalized_through
            if trainer_step < finalized:
                raise FailedPrecondition(
                    f"acks through trainer step {finalized} are finalized; cannot rewind to "
                    f"{trainer_step} (limits.rewind_window={self._config.rewind_window})"
                )
            try:
                await self._journal.rewind(trainer_step)
            except OSError as exc:
                raise not_durable("the rewind", exc) from exc
            self.apply_durable_acks()
            result, evicted = self.apply_rewind(trainer_step)
        if evicted:
            self._observer.groups_evicted(evicted)
        await self._wakeups.notify()
        return result

    def apply_rewind(self, trainer_step: int) -> tuple[RewindResult, int]:
        """The one rewind path, live and in journal replay (inside a REWIND or RESTORE
        mutation); returns what it did and how many groups it evicted as too stale."""
        undone, lost = self._ledger.rewind(trainer_step)
        groups = self._buffer.recommit([gid for r in undone for gid in r.group_ids])
        tokens = sum(g.generated_tokens for g in groups)
        evicted = self._policy.evict_returned(g.group_id for g in groups)
        readmitted = evicted  # a stale group's prompt is admitted again, like a lost one's
        for gone in lost:
            for admission in gone.admissions:
                self._sampler.readmit(admission)
            readmitted += len(gone.admissions)
        self._accounting.rewound(len(groups), evicted, tokens)
        self._told_step_went_back = False
        return RewindResult(len(groups) - evicted, readmitted), evicted
