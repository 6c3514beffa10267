"""Delivery: what trainers do with training-ready groups (docs/design.md, "The delivery contract").

``fetch`` leases committed groups, ``ack`` consumes a lease at a trainer step, ``finalize(step)``
drops groups acked at steps <= step, ``rewind(step)`` makes groups acked after ``step`` available
again, the lease reaper requeues the groups of expired leases, and ``submit`` queues
trainer-supplied prompts.

What a client is told is journaled before it is told: acks, lease grants, accepted submissions
and rewinds, each inside its mutation so that a snapshot's journal position and its cut agree.
An ack is durable before ``ack`` returns and is idempotent (also across a restart); acks older
than ``rewind_window`` steps finalize by themselves.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from rolloutd.domain.buffer import AckRecord, Lease, check_same_step
from rolloutd.domain.core import Core
from rolloutd.domain.encoder import (
    AS_IS,
    UNDELIVERABLE,
    E,
    GroupEncoder,
    Undeliverable,
)
from rolloutd.domain.errors import (
    FailedPrecondition,
    InvalidArgument,
    InvariantError,
    NotFound,
    Unavailable,
    public_cause,
)
from rolloutd.domain.fate import LEASE_EXPIRIES
from rolloutd.domain.group import Group, GroupState
from rolloutd.domain.intake import check_settings, check_sizes
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.observer import GroupDropped
from rolloutd.domain.sampler import Admission
from rolloutd.domain.state import JournaledAck, JournaledDrop, LostAck

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _PendingAck:
    """An ack between its journal record being queued and being applied."""

    ack: JournaledAck
    durable: asyncio.Future[int]
    """Resolves once the record is durable (the journal's position covers it)."""


@dataclass(frozen=True)
class AckResult:
    acked_groups: int
    already_acked: bool


@dataclass(frozen=True)
class RewindResult:
    redelivered_groups: int
    readmitted_prompts: int


class Delivery:
    """Leases, acks, finalization, rewind and submissions; see the module docstring."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self._acking: dict[str, _PendingAck] = {}
        """Acks queued for the journal and not applied yet, by lease id."""
        self._orphans: set[asyncio.Future[None]] = set()
        """Settlements of acks whose callers went away, kept until done."""
        self._submitting = asyncio.Lock()
        """Serialises submissions: check, journal, accept, with no other in between."""
        self._told_step_went_back = False
        self._expiries: dict[int, int] = {}
        """Leases of each committed or leased group that expired unacknowledged, since start."""

    # --- leases ----------------------------------------------------------------------------

    async def fetch(
        self, max_groups: int, wait_ms: int, consumer: str
    ) -> tuple[Lease, list[Group]] | None:
        """:meth:`fetch_encoded` of the groups as they are (a caller in the same process)."""
        return await self.fetch_encoded(max_groups, wait_ms, consumer, AS_IS)

    async def fetch_encoded(
        self, max_groups: int, wait_ms: int, consumer: str, encoder: GroupEncoder[E]
    ) -> tuple[Lease, list[E]] | None:
        """Leases up to ``max_groups`` training-ready groups, waiting up to ``wait_ms``, and
        returns them encoded by ``encoder``.

        Each group is encoded before the lease is granted, under the LEASE mutation, and no
        more of them than ``encoder.max_bytes`` holds (at least one): a group the encoder refuses
        is dropped (``undeliverable``) and never leased, so it cannot expire and come back for
        good. The encoding is synchronous, so it holds the barrier no longer than encoding the
        groups after the fetch did.

        The grant is journaled before it is returned, but the LEASE mutation only queues the
        record: a checkpoint may capture the grant while it syncs. Replay grants it again when
        the record is durable; when the sync fails the groups are requeued and the call fails
        ``Unavailable``, and a snapshot captured in between holds a grant nobody received,
        which after a restart from it expires like any unacked lease (its groups come back
        after ``lease_timeout_s``; none is lost or delivered twice).
        """
        core = self.core
        cfg = core.config
        if not 1 <= max_groups <= cfg.max_fetch_groups:
            raise InvalidArgument(
                "max_groups", f"must be between 1 and {cfg.max_fetch_groups}, got {max_groups}"
            )
        if not 0 <= wait_ms <= cfg.max_wait_ms:
            raise InvalidArgument(
                "wait_ms", f"must be between 0 and {cfg.max_wait_ms}, got {wait_ms}"
            )
        if len(consumer) > 256:
            raise InvalidArgument("consumer", "must be at most 256 characters")
        core.check_serving()
        deadline = time.monotonic() + wait_ms / 1000
        while True:
            if core.buffer.ready_count:
                lease: Lease | None = None
                async with core.barrier.mutation(MutationKind.LEASE):
                    now = core.clock()
                    kept, encoded, drops = self._encode_ready(encoder, max_groups)
                    if kept:
                        lease = core.buffer.lease(
                            uuid.uuid4().hex, len(kept), consumer, now, cfg.lease_timeout_s
                        )
                        if lease is None or lease.group_ids != tuple(g.group_id for g in kept):
                            raise InvariantError(f"lease of {kept} took {lease}")
                        durable = core.journal.lease(lease, self.admissions(lease.group_ids))
                        core.gate.leased(len(kept))
                if drops:
                    await self._journal_drops(drops)
                if lease is not None:
                    try:
                        await durable
                    except OSError as exc:
                        async with core.barrier.mutation(MutationKind.REQUEUE):
                            if lease.lease_id in core.buffer.leases:
                                core.buffer.requeue(lease.lease_id)
                        await core.notify()
                        raise _not_durable("the lease", exc) from exc
                    core.observer.groups_leased(
                        [now - (g.meta.committed_at or now) for g in kept],
                        [core.policy_version - g.policy_version for g in kept],
                    )
                    return lease, encoded
                if drops:
                    continue  # others may be ready behind the dropped ones
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            # a trainer waiting for groups consumes them now: the staleness gate makes room
            core.gate.wait_started(max_groups)
            try:
                await core.wake_admission()
                async with core.fetchable:
                    try:
                        await asyncio.wait_for(
                            core.fetchable.wait_for(self._fetch_may_proceed),
                            remaining,
                        )
                    except TimeoutError:
                        return None
            finally:
                core.gate.wait_ended(max_groups)
            core.check_serving()

    def _encode_ready(
        self, encoder: GroupEncoder[E], max_groups: int
    ) -> tuple[list[Group], list[E], list[JournaledDrop]]:
        """The ready groups a lease takes, encoded, from the front of the queue; those the encoder
        refuses are dropped on the way, so the kept ones end up first in the queue (inside the
        LEASE mutation)."""
        buffer = self.core.buffer
        kept: list[Group] = []
        encoded: list[E] = []
        refused: list[tuple[Group, str]] = []
        used = 0
        for gid in buffer.ready_ids():
            if len(kept) == max_groups:
                break
            group = buffer.groups[gid]
            try:
                value, size = encoder.encode(group)
            except Undeliverable as exc:
                refused.append((group, str(exc)))
                continue
            if kept and used + size > encoder.max_bytes:
                break
            kept.append(group)
            encoded.append(value)
            used += size
        return kept, encoded, [self._drop(g, UNDELIVERABLE, why) for g, why in refused]

    def _drop(self, group: Group, reason: str, detail: str) -> JournaledDrop:
        """Drops a committed group that delivery gave up on (inside a mutation); its prompt
        position counts as consumed. Returns the record to journal after the mutation: a
        restart before it is durable finds the group committed in its snapshot (and gives up on
        it again) or not at all (its position consumed)."""
        core = self.core
        tokens = group.generated_tokens  # a committed group: no partial siblings
        core.buffer.remove(group.group_id, GroupState.DROPPED)
        self._expiries.pop(group.group_id, None)
        core.counters.dropped(reason, tokens)
        core.observer.group_dropped(GroupDropped(group.group_id, reason, tokens))
        log.warning(
            "group %d (prompt %s) dropped: %s: %s",
            group.group_id,
            group.meta.prompt.prompt_id,
            reason,
            detail,
        )
        return JournaledDrop(
            group.group_id, Admission(group.meta.prompt, group.meta.position), reason, tokens
        )

    async def _journal_drops(self, drops: list[JournaledDrop]) -> None:
        for drop in drops:
            try:
                await self.core.journal.drop(drop)
            except OSError as exc:
                log.error(
                    "the drop of group %d could not be journaled (%s): until the next "
                    "checkpoint, a restart may generate its prompt again",
                    drop.group_id,
                    exc,
                )
        await self.core.notify()

    def admissions(self, group_ids: Iterable[int]) -> dict[int, Admission]:
        """What a journal record keeps of each group: enough to never admit it again."""
        groups = self.core.buffer.groups
        return {
            gid: Admission(g.meta.prompt, g.meta.position)
            for gid in group_ids
            for g in (groups[gid],)
        }

    def _fetch_may_proceed(self) -> bool:
        core = self.core
        return core.buffer.ready_count > 0 or core.fatal is not None or core.draining

    async def reap_expired_leases(self) -> None:
        """The lease reaper's loop: the groups of an expired lease become available again.

        It also notices when the service did not run (pauses.py): time frozen does not count
        against a lease, so a pause is noticed before any lease is looked at."""
        core = self.core
        interval = core.config.reap_interval_s
        while True:
            before = time.monotonic()
            await asyncio.sleep(interval)
            pause = core.pauses.observe(interval, time.monotonic() - before, core.clock())
            if pause is not None:
                log.warning(
                    "the service did not run for %.1f s (frozen, or its event loop held up); "
                    "leases granted before do not count that time",
                    pause.seconds,
                )
            expired = core.buffer.expired_leases(core.clock(), core.pauses.since)
            if not expired:
                continue
            evicted = 0
            drops: list[JournaledDrop] = []
            async with core.barrier.mutation(MutationKind.REQUEUE):
                for lease in core.buffer.expired_leases(core.clock(), core.pauses.since):
                    requeued = self.requeue(lease.lease_id)
                    stale = self.evict_stale(requeued)
                    evicted += stale
                    given_up = self._count_expiries(requeued)
                    drops += given_up
                    available = len(requeued) - stale - len(given_up)
                    core.counters.requeued_groups += available
                    core.counters.expired_leases += 1
                    log.info(
                        "lease %s of %s expired; %d groups available again, %d evicted as too "
                        "stale, %d dropped after %d expiries",
                        lease.lease_id,
                        lease.consumer or "?",
                        available,
                        stale,
                        len(given_up),
                        core.config.max_lease_expiries,
                    )
            if evicted:
                core.observer.groups_evicted(evicted)
            if drops:
                await self._journal_drops(drops)
            await core.notify()

    def _count_expiries(self, requeued: Iterable[int]) -> list[JournaledDrop]:
        """Counts an expiry for each group of an expired lease still in the buffer, and drops
        those whose leases expired ``max_lease_expiries`` times (inside the REQUEUE mutation):
        a group that every trainer fails to take must not cycle through leases for good."""
        groups = self.core.buffer.groups
        limit = self.core.config.max_lease_expiries
        drops = []
        for gid in requeued:
            if gid not in groups:
                continue  # evicted as too stale
            self._expiries[gid] = count = self._expiries.get(gid, 0) + 1
            if count >= limit:
                drops.append(
                    self._drop(groups[gid], LEASE_EXPIRIES, f"its leases expired {count} times")
                )
        if len(self._expiries) > 2 * len(groups):  # forget groups acked or removed since
            self._expiries = {g: n for g, n in self._expiries.items() if g in groups}
        return drops

    def requeue(self, lease_id: str) -> list[int]:
        """An expired lease's groups become available again, and the prompts of its groups that
        no snapshot held may be admitted again (inside a REQUEUE or RESTORE mutation)."""
        for admission in self.core.lost_leased.pop(lease_id, {}).values():
            self.core.sampler.unskip(admission)
        return self.core.buffer.requeue(lease_id)

    def evict_stale(self, group_ids: Iterable[int]) -> int:
        """Evicts those of ``group_ids``, committed again just now (an expired lease, a rewind,
        a restore), that fell more than ``max_staleness`` policy versions behind while the
        trainer held them: eviction at a weight update passes over a trainer's groups, so this is
        where a stale group is kept from being delivered. Inside the mutation that committed them
        again; returns how many."""
        core = self.core
        stale = [gid for gid in group_ids if core.too_stale(core.buffer.groups[gid].policy_version)]
        for gid in stale:
            core.evict(gid)
        return len(stale)

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
        core = self.core
        if not lease_id:
            raise InvalidArgument("lease_id", "must not be empty")
        self.check_step(trainer_step)
        async with core.barrier.mutation(MutationKind.ACK):
            known = core.buffer.acks.get(lease_id)
            if known is not None:
                check_same_step(lease_id, known.trainer_step, trainer_step)
                return AckResult(len(known.group_ids), already_acked=True)
            if lease_id in core.buffer.finalized_leases:
                check_same_step(lease_id, core.buffer.finalized_leases[lease_id], trainer_step)
                return AckResult(0, already_acked=True)
            pending = self._acking.get(lease_id)
            if pending is not None:
                check_same_step(lease_id, pending.ack.record.trainer_step, trainer_step)
            else:
                lease = core.buffer.leases.get(lease_id)
                if lease is None:
                    raise NotFound(f"lease {lease_id!r} is unknown or expired")
                if trainer_step < core.max_acked_step and not self._told_step_went_back:
                    self._told_step_went_back = True  # once until a Rewind: trainers may lag
                    log.warning(
                        "ack at trainer step %d, below step %d acked before: a trainer restarted "
                        "from its checkpoint S calls Rewind(trainer_step=S) before fetching, or "
                        "the groups it acked after S are not delivered again (trainers whose "
                        "steps lag one another's can ignore this; said once until a Rewind)",
                        trainer_step,
                        core.max_acked_step,
                    )
                lost = core.lost_leased.get(lease_id, {})
                record = AckRecord(
                    lease_id, lease.group_ids + tuple(lost), trainer_step, core.clock()
                )
                admissions = {**self.admissions(lease.group_ids), **lost}
                pending = _PendingAck(
                    JournaledAck(record, lost), core.journal.ack(record, admissions)
                )
                self._acking[lease_id] = pending
        try:
            await self._settle(pending)
        except asyncio.CancelledError:
            # the caller went away: a durable ack is applied all the same
            orphan = asyncio.ensure_future(self._settle(pending))
            self._orphans.add(orphan)
            orphan.add_done_callback(self._orphans.discard)
            raise
        await core.notify()  # acked groups no longer count against the buffer's capacity
        through = max(core.max_acked_step - core.config.rewind_window, core.finalized_through)
        if through > core.finalized_through or trainer_step <= core.finalized_through:
            # the window moved on, or this ack is below it (a trainer whose steps lag another's):
            # no rewind can reach it, so it must not wait in the buffer for the window
            await self.finalize(through)
        return AckResult(len(pending.ack.record.group_ids), already_acked=False)

    async def _settle(self, pending: _PendingAck) -> None:
        """Waits for the ack's record outside the barrier, then applies it (once, whoever of
        its callers or a capture comes first)."""
        lease_id = pending.ack.record.lease_id
        try:
            await asyncio.shield(pending.durable)  # shared by every caller of this ack
        except OSError as exc:
            if self._acking.get(lease_id) is pending:
                del self._acking[lease_id]
            raise _not_durable("the ack", exc) from exc
        async with self.core.barrier.mutation(MutationKind.ACK):
            self._apply_pending(pending)

    def _apply_pending(self, pending: _PendingAck) -> None:
        """Applies a durable ack once (inside an ACK mutation or the exclusive hold)."""
        lease_id = pending.ack.record.lease_id
        if self._acking.get(lease_id) is not pending:
            return  # a capture applied it already
        del self._acking[lease_id]
        self.core.lost_leased.pop(lease_id, None)
        self.apply_ack(pending.ack)

    def apply_durable_acks(self) -> None:
        """Under the exclusive hold, before a capture: applies every ack whose record the
        journal's position already covers, so the snapshot agrees with its ``acks_through``.
        Acks still syncing are left to :meth:`_settle` and to replay."""
        for pending in list(self._acking.values()):
            durable = pending.durable
            if durable.done() and not durable.cancelled() and durable.exception() is None:
                self._apply_pending(pending)

    def apply_ack(self, ack: JournaledAck) -> None:
        """The one ack path, live and in journal replay; inside an ACK or RESTORE mutation.

        Groups of the ack that the buffer does not hold (admitted and acked after the snapshot
        a restore started from) are never admitted again, but remembered so that a ``Rewind``
        to before the ack re-admits them.
        """
        core = self.core
        record = ack.record
        groups = core.buffer.groups
        held = [groups[gid] for gid in record.group_ids if gid in groups]
        lost = core.buffer.ack(record)
        if lost is None:
            return  # acked already: idempotent
        core.counters.acked([self._source(gid, ack) for gid in record.group_ids])
        # a group the replay found unfinished left as lost, with what the snapshot held of it
        core.counters.delivered_tokens += sum(
            g.generated_tokens
            + (core.release_partials(g.group_id) if g.group_id not in groups else 0)
            for g in held
        )
        core.max_acked_step = max(core.max_acked_step, record.trainer_step)
        if lost:
            if not ack.admissions:
                raise InvariantError(f"live ack of lease {record.lease_id} lost groups {lost}")
            admissions = tuple(ack.admissions[gid] for gid in lost)
            for admission in admissions:
                core.sampler.skip(admission)
            core.lost_acks.append(LostAck(record.trainer_step, admissions))

    def _source(self, group_id: int, ack: JournaledAck) -> str:
        """The source of an acked group: from the buffer, else from the ack's journal record."""
        group = self.core.buffer.groups.get(group_id)
        if group is not None:
            return self.core.source_of(group.meta)
        admission = (ack.admissions or {}).get(group_id)
        return self.core.source_name(None if admission is None else admission.position)

    def check_step(self, trainer_step: int) -> None:
        """Refuses a trainer step below 0, or more than ``max_step_ahead`` ahead of the highest
        step seen (acked or finalized): one absurd step would finalize every ack before it and
        refuse every ``Rewind`` below it (docs/operations.md, "Resetting a policy version or
        trainer step")."""
        if trainer_step < 0:
            raise InvalidArgument("trainer_step", f"must be >= 0, got {trainer_step}")
        core = self.core
        seen = max(core.max_acked_step, core.finalized_through, 0)
        ahead = core.config.max_step_ahead
        if trainer_step > seen + ahead:
            raise InvalidArgument(
                "trainer_step",
                f"{trainer_step} is more than limits.max_step_ahead={ahead} ahead of the highest "
                f"trainer step seen ({seen})",
            )

    # --- the trainer's checkpoints ---------------------------------------------------------

    async def finalize(self, through_step: int) -> int:
        """Drops groups acked at steps <= ``through_step``; returns how many."""
        core = self.core
        async with core.barrier.mutation(MutationKind.FINALIZE):
            dropped = core.buffer.finalize(through_step)
            core.finalized_through = max(core.finalized_through, through_step)
            core.counters.finalized_groups += len(dropped)
        if dropped:
            await core.notify()
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
        core = self.core
        if trainer_step < 0:
            raise InvalidArgument("trainer_step", f"must be >= 0, got {trainer_step}")
        async with core.barrier.mutation(MutationKind.REQUEUE):
            self._check_rewindable(trainer_step)
            try:
                await core.journal.rewind(trainer_step)
            except OSError as exc:
                raise _not_durable("the rewind", exc) from exc
            self.apply_durable_acks()
            result, evicted = self.apply_rewind(trainer_step)
        if evicted:
            core.observer.groups_evicted(evicted)
        await core.notify()
        return result

    def _check_rewindable(self, trainer_step: int) -> None:
        core = self.core
        if trainer_step < core.finalized_through:
            raise FailedPrecondition(
                f"acks through trainer step {core.finalized_through} are finalized; cannot rewind "
                f"to {trainer_step} (limits.rewind_window={core.config.rewind_window})"
            )

    def apply_rewind(self, trainer_step: int) -> tuple[RewindResult, int]:
        """The one rewind path, live and in journal replay (inside a REQUEUE or RESTORE
        mutation); returns what it did and how many groups it evicted as too stale."""
        core = self.core
        groups = core.buffer.rewind(trainer_step)
        core.counters.delivered_tokens -= sum(g.generated_tokens for g in groups)
        evicted = self.evict_stale(g.group_id for g in groups)
        readmitted = evicted  # a stale group's prompt is admitted again, like a lost one's
        keep: list[LostAck] = []
        for lost in core.lost_acks:
            if lost.trainer_step > trainer_step:
                for a in lost.admissions:
                    core.sampler.readmit(a)
                readmitted += len(lost.admissions)
            else:
                keep.append(lost)
        core.lost_acks = keep
        core.counters.requeued_groups += len(groups) - evicted
        core.max_acked_step = min(core.max_acked_step, trainer_step)
        self._told_step_went_back = False
        return RewindResult(len(groups) - evicted, readmitted), evicted

    # --- submissions -----------------------------------------------------------------------

    async def submit(self, admissions: list[Admission]) -> tuple[int, int]:
        """Queues trainer-supplied prompts; the accepted ones are journaled (durable) before
        this returns, and a prompt id accepted before, also before a restart, is a duplicate."""
        core = self.core
        core.check_serving()
        prompts = [a.prompt for a in admissions]
        cfg = core.config
        check_sizes(prompts, cfg.max_metadata_bytes, cfg.max_submit_bytes)
        await check_settings(prompts, cfg.spec_limits, cfg.sampling.max_tokens, core.engine)
        async with self._submitting, core.barrier.mutation(MutationKind.ADMIT):
            fresh = core.sampler.fresh(prompts)
            if fresh:
                try:
                    await core.journal.submit(fresh)
                except OSError as exc:
                    raise _not_durable("the prompts", exc) from exc
            accepted, duplicates = core.sampler.submit(prompts)
        await core.notify()
        return accepted, duplicates


def _not_durable(what: str, exc: OSError) -> Unavailable:
    """The client hears that the journal failed and why, the log also where (a server path)."""
    log.warning("%s could not be made durable: %s", what, exc)
    return Unavailable(f"{what} could not be made durable: {public_cause(exc)}")
