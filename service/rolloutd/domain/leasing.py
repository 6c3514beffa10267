"""Leasing: training-ready groups handed to trainers, and taken back when a lease expires
(docs/design.md, "The delivery contract").

``fetch_encoded`` leases committed groups, encoded for the caller, and journals the grant before
it returns: a restarted process still accepts the ack of a lease that has not expired and gives
its groups to nobody else meanwhile. Only a group that can be delivered is leased; one the
encoder refuses is dropped (``undeliverable``). The lease reaper makes the groups of an expired
lease available again (a group whose leases expired ``limits.max_lease_expiries`` times is
dropped instead), and notices when the service did not run: time frozen does not count against a
lease (``pauses.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from rolloutd.domain.accounting import Accounting
from rolloutd.domain.barrier import MutationBarrier
from rolloutd.domain.buffer import RolloutBuffer
from rolloutd.domain.drops import Drops
from rolloutd.domain.encoder import E, GroupEncoder, Undeliverable
from rolloutd.domain.errors import InvalidArgument, InvariantError, not_durable
from rolloutd.domain.fate import DropReason
from rolloutd.domain.group import UNFINISHED, Group, GroupState
from rolloutd.domain.journal import DeliveryJournal, JournaledDrop, JournaledLease, Lease
from rolloutd.domain.ledger import DeliveryLedger
from rolloutd.domain.liveness import Liveness
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.observer import Observer
from rolloutd.domain.pauses import Pauses
from rolloutd.domain.policy import Policy
from rolloutd.domain.sampler import Admission, Sampler
from rolloutd.domain.wakeups import Wakeups

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeasingConfig:
    lease_timeout_s: float = 300.0
    max_fetch_groups: int = 1024
    max_wait_ms: int = 600_000
    max_lease_expiries: int = 8
    reap_interval_s: float = 1.0


def admissions(buffer: RolloutBuffer, group_ids: Iterable[int]) -> dict[int, Admission]:
    """What a journal record keeps of each buffered group: enough to never admit it again."""
    groups = buffer.groups
    return {
        gid: Admission(g.meta.prompt, g.meta.position) for gid in group_ids for g in (groups[gid],)
    }


class Leasing:
    """Fetches, leases and their expiry; see the module docstring."""

    def __init__(
        self,
        config: LeasingConfig,
        buffer: RolloutBuffer,
        ledger: DeliveryLedger,
        barrier: MutationBarrier,
        policy: Policy,
        drops: Drops,
        accounting: Accounting,
        sampler: Sampler,
        journal: DeliveryJournal,
        observer: Observer,
        wakeups: Wakeups,
        liveness: Liveness,
        clock: Callable[[], float],
    ) -> None:
        self._config = config
        self._buffer = buffer
        self._ledger = ledger
        self._barrier = barrier
        self._policy = policy
        self._drops = drops
        self._accounting = accounting
        self._sampler = sampler
        self._journal = journal
        self._observer = observer
        self._wakeups = wakeups
        self._liveness = liveness
        self._clock = clock
        self._pauses = Pauses()
        """When the service did not run; leases do not count it (pauses.py)."""
        self._expiries: dict[int, int] = {}
        """Leases of each committed or leased group that expired unacknowledged, since start."""

    # --- fetch -----------------------------------------------------------------------------

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
        cfg = self._config
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
        self._liveness.check_serving()
        gate = self._policy.gate
        deadline = time.monotonic() + wait_ms / 1000
        while True:
            if self._buffer.ready_count:
                lease: Lease | None = None
                async with self._barrier.mutation(MutationKind.LEASE):
                    now = self._clock()
                    kept, encoded, drops = self._encode_ready(encoder, max_groups)
                    if kept:
                        lease = self._lease(kept, consumer, now)
                        durable = self._journal.lease(
                            lease, admissions(self._buffer, lease.group_ids)
                        )
                        gate.leased(len(kept))
                if drops:
                    await self._drops.journal(drops)
                if lease is not None:
                    try:
                        await durable
                    except OSError as exc:
                        async with self._barrier.mutation(MutationKind.REQUEUE):
                            if lease.lease_id in self._ledger.leases:
                                self.requeue(lease.lease_id)
                        await self._wakeups.notify()
                        raise not_durable("the lease", exc) from exc
                    self._observer.groups_leased(
                        [now - (g.meta.committed_at or now) for g in kept],
                        [self._policy.lag(g.policy_version) for g in kept],
                    )
                    return lease, encoded
                if drops:
                    continue  # others may be ready behind the dropped ones
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            # a trainer waiting for groups consumes them now: the staleness gate makes room
            gate.wait_started(max_groups)
            try:
                await self._wakeups.wake_admission()
                fetchable = self._wakeups.fetchable
                async with fetchable:
                    try:
                        await asyncio.wait_for(fetchable.wait_for(self._may_proceed), remaining)
                    except TimeoutError:
                        return None
            finally:
                gate.wait_ended(max_groups)
            self._liveness.check_serving()

    def _lease(self, kept: list[Group], consumer: str, now: float) -> Lease:
        lease_id = uuid.uuid4().hex
        taken = self._buffer.lease(lease_id, len(kept))
        if taken != tuple(g.group_id for g in kept):
            raise InvariantError(f"lease of {kept} took {taken}")
        lease = Lease(lease_id, taken, consumer, now, now + self._config.lease_timeout_s)
        self._ledger.grant(lease)
        return lease

    def _encode_ready(
        self, encoder: GroupEncoder[E], max_groups: int
    ) -> tuple[list[Group], list[E], list[JournaledDrop]]:
        """The ready groups a lease takes, encoded, from the front of the queue; those the encoder
        refuses are dropped on the way, so the kept ones end up first in the queue (inside the
        LEASE mutation)."""
        groups = self._buffer.groups
        kept: list[Group] = []
        encoded: list[E] = []
        refused: list[tuple[Group, str]] = []
        used = 0
        for gid in self._buffer.ready_ids():
            if len(kept) == max_groups:
                break
            group = groups[gid]
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
        return kept, encoded, [self._give_up(g, DropReason.UNDELIVERABLE, w) for g, w in refused]

    def _give_up(self, group: Group, reason: DropReason, detail: str) -> JournaledDrop:
        self._expiries.pop(group.group_id, None)
        return self._drops.drop_now(group, reason, detail)

    def _may_proceed(self) -> bool:
        return self._buffer.ready_count > 0 or not self._liveness.open

    # --- expiry ----------------------------------------------------------------------------

    async def reap_expired_leases(self) -> None:
        """The lease reaper's loop: the groups of an expired lease become available again.

        It also notices when the service did not run (pauses.py): time frozen does not count
        against a lease, so a pause is noticed before any lease is looked at."""
        interval = self._config.reap_interval_s
        while True:
            before = time.monotonic()
            await asyncio.sleep(interval)
            pause = self._pauses.observe(interval, time.monotonic() - before, self._clock())
            if pause is not None:
                log.warning(
                    "the service did not run for %.1f s (frozen, or its event loop held up); "
                    "leases granted before do not count that time",
                    pause.seconds,
                )
            if not self._ledger.expired(self._clock(), self._pauses.since):
                continue
            evicted = 0
            drops: list[JournaledDrop] = []
            async with self._barrier.mutation(MutationKind.REQUEUE):
                for lease in self._ledger.expired(self._clock(), self._pauses.since):
                    requeued = self.requeue(lease.lease_id)
                    stale = self._policy.evict_returned(requeued)
                    evicted += stale
                    given_up = self._count_expiries(requeued)
                    drops += given_up
                    available = len(requeued) - stale - len(given_up)
                    self._accounting.requeued(available)
                    log.info(
                        "lease %s of %s expired; %d groups available again, %d evicted as too "
                        "stale, %d dropped after %d expiries",
                        lease.lease_id,
                        lease.consumer or "?",
                        available,
                        stale,
                        len(given_up),
                        self._config.max_lease_expiries,
                    )
            if evicted:
                self._observer.groups_evicted(evicted)
            if drops:
                await self._drops.journal(drops)
            await self._wakeups.notify()

    def _count_expiries(self, requeued: Iterable[int]) -> list[JournaledDrop]:
        """Counts an expiry for each group of an expired lease still in the buffer, and drops
        those whose leases expired ``max_lease_expiries`` times (inside the REQUEUE mutation):
        a group that every trainer fails to take must not cycle through leases for good."""
        groups = self._buffer.groups
        limit = self._config.max_lease_expiries
        drops = []
        for gid in requeued:
            if gid not in groups:
                continue  # evicted as too stale
            self._expiries[gid] = count = self._expiries.get(gid, 0) + 1
            if count >= limit:
                drops.append(
                    self._give_up(
                        groups[gid], DropReason.LEASE_EXPIRIES, f"its leases expired {count} times"
                    )
                )
        if len(self._expiries) > 2 * len(groups):  # forget groups acked or removed since
            self._expiries = {g: n for g, n in self._expiries.items() if g in groups}
        return drops

    def requeue(self, lease_id: str) -> list[int]:
        """An expired lease's groups become available again, and the prompts of its groups that
        no snapshot held may be admitted again (inside a REQUEUE or RESTORE mutation)."""
        lease, lost = self._ledger.end_lease(lease_id)
        for admission in lost.values():
            self._sampler.unskip(admission)
        return self._buffer.requeue(lease.group_ids)

    # --- restore ---------------------------------------------------------------------------

    def requeue_expired(self) -> None:
        """After a restore loaded the ledger: the groups of leases that expired meanwhile become
        available again (inside the RESTORE mutation)."""
        for lease in self._ledger.expired(self._clock()):
            self.requeue(lease.lease_id)

    def regrant(self, event: JournaledLease) -> None:
        """A live lease from the journal, granted again (inside the RESTORE mutation)."""
        buffer, ledger = self._buffer, self._ledger
        lease = event.lease
        if ledger.acked_at(lease.lease_id) is not None:
            return
        if lease.lease_id in ledger.leases:  # the snapshot held it: granted again below
            granted, _ = ledger.end_lease(lease.lease_id)
            buffer.requeue(granted.group_ids)
        held = tuple(
            g
            for g in lease.group_ids
            if g in buffer.groups and buffer.groups[g].state is GroupState.COMMITTED
        )
        for gid in lease.group_ids:
            g = buffer.groups.get(gid)
            if g is not None and g.state in UNFINISHED:
                # finished and leased after the snapshot: delivered (domain/fate.py)
                self._accounting.left(g, GroupState.LOST)
                buffer.remove(gid, GroupState.LOST)
        lost = {g: event.admissions[g] for g in lease.group_ids if g not in held}
        for admission in lost.values():
            self._sampler.skip(admission)
        buffer.grant(lease.lease_id, held)
        ledger.grant(replace(lease, group_ids=held))
        if lost:
            ledger.keep_lost(lease.lease_id, lost)
