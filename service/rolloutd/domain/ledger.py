"""The delivery ledger: what trainers were granted and what they acknowledged (docs/design.md,
"The delivery contract").

One object holds every fact about delivery that persists or that a client relies on: the live
leases, the acks waiting for finalization, the leases finalized (remembered so that a late
retry of an ack still succeeds), the highest trainer step acked and the step finalized through,
what the journal named for groups no snapshot held (lost acks and leases), and the acks queued
for the journal but not yet applied. The leasing and acking rooms change it only through its
methods; the groups themselves (their states) are the buffer's.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from rolloutd.domain.errors import FailedPrecondition
from rolloutd.domain.journal import AckRecord, JournaledAck, Lease
from rolloutd.domain.sampler import Admission

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


def check_same_step(lease_id: str, acked_step: int, trainer_step: int) -> None:
    """A repeated ack is idempotent only at the step it was first made at."""
    if acked_step != trainer_step:
        raise FailedPrecondition(
            f"lease {lease_id!r} was acked with trainer_step {acked_step}, not {trainer_step}"
        )


@dataclass(frozen=True)
class LostAck:
    """An ack journaled for groups no snapshot held: their prompts are never admitted again,
    unless a ``Rewind`` to before ``trainer_step`` re-admits them."""

    trainer_step: int
    admissions: tuple[Admission, ...]


@dataclass(frozen=True)
class LostLease:
    """A live lease granted again after a restart whose groups no snapshot held: the
    admissions of those groups, kept from admission until the lease is acked or expires."""

    lease_id: str
    group_ids: tuple[int, ...]
    admissions: tuple[Admission, ...]


@dataclass(eq=False)
class PendingAck:
    """An ack between its journal record being queued and being applied."""

    ack: JournaledAck
    durable: asyncio.Future[int]
    """Resolves once the record is durable (the journal's position covers it)."""

    @property
    def applicable(self) -> bool:
        """Its record is durable: it may be applied now."""
        d = self.durable
        return d.done() and not d.cancelled() and d.exception() is None


@dataclass(frozen=True)
class LedgerState:
    """The ledger's part of a snapshot. A capture holds the leases finalized since the previous
    capture (copying the whole ledger would make the hold grow with the run's length); a state
    to restore from holds all it remembers."""

    leases: Mapping[str, Lease] = field(default_factory=dict)
    acks: Mapping[str, AckRecord] = field(default_factory=dict)
    finalized_leases: Mapping[str, int] = field(default_factory=dict)
    """Lease id -> trainer step, oldest first."""
    max_acked_step: int = -1
    finalized_through: int = -1
    lost_acks: tuple[LostAck, ...] = ()
    lost_leases: tuple[LostLease, ...] = ()


class DeliveryLedger:
    """Leases, acks, finalized leases, trainer steps and what the journal named for groups no
    snapshot held; see the module docstring. Every method is a synchronous step called inside a
    barrier mutation (or the exclusive hold)."""

    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}
        self._acks: dict[str, AckRecord] = {}
        """Acked leases whose groups wait for finalization."""
        self._finalized: OrderedDict[str, int] = OrderedDict()
        """Lease id -> trainer step, for idempotent acks after finalization."""
        self._finalized_new: OrderedDict[str, int] = OrderedDict()
        """Leases finalized since the last capture."""
        self._max_acked_step = -1
        self._finalized_through = -1
        self._lost_acks: list[LostAck] = []
        """Acks journaled for groups no snapshot held (found by a restore)."""
        self._lost_leased: dict[str, dict[int, Admission]] = {}
        """Live leases restored from the journal whose groups no snapshot held, by lease id: the
        admissions of those groups, skipped by the sampler until the lease is acked or expires."""
        self._pending: dict[str, PendingAck] = {}
        """Acks queued for the journal and not applied yet, by lease id."""

    # --- reading ---------------------------------------------------------------------------

    @property
    def leases(self) -> Mapping[str, Lease]:
        return self._leases

    @property
    def acks(self) -> Mapping[str, AckRecord]:
        return self._acks

    @property
    def finalized_leases(self) -> Mapping[str, int]:
        return self._finalized

    @property
    def max_acked_step(self) -> int:
        """The highest trainer step acked (lowered by a rewind); -1 before the first ack."""
        return self._max_acked_step

    @property
    def finalized_through(self) -> int:
        return self._finalized_through

    @property
    def highest_step(self) -> int:
        """The highest trainer step seen, acked or finalized (0 before any)."""
        return max(self._max_acked_step, self._finalized_through, 0)

    def acked_at(self, lease_id: str) -> int | None:
        """The trainer step a lease was acked at, while its ack waits or after it was
        finalized (None: not acked)."""
        known = self._acks.get(lease_id)
        if known is not None:
            return known.trainer_step
        return self._finalized.get(lease_id)

    def expired(
        self, now: float, paused_since: Callable[[float], float] = lambda _: 0.0
    ) -> list[Lease]:
        """Leases past their deadline at ``now``, each deadline moved on by the time the service
        did not run since the lease was granted (``paused_since(created_at)``, pauses.py)."""
        return [
            lease
            for lease in self._leases.values()
            if lease.expires_at + paused_since(lease.created_at) <= now
        ]

    def lost_of(self, lease_id: str) -> Mapping[int, Admission]:
        """The groups of a live lease that no snapshot held (a restore found them in the
        journal), with their admissions."""
        return self._lost_leased.get(lease_id, {})

    # --- leases ----------------------------------------------------------------------------

    def grant(self, lease: Lease) -> None:
        self._leases[lease.lease_id] = lease

    def end_lease(self, lease_id: str) -> tuple[Lease, dict[int, Admission]]:
        """Removes a lease (it expired, or a failed sync took it back), with the admissions of
        its groups no snapshot held: the caller gives those back to the sampler."""
        return self._leases.pop(lease_id), self._lost_leased.pop(lease_id, {})

    def keep_lost(self, lease_id: str, lost: dict[int, Admission]) -> None:
        """A lease granted again by a restore names groups no snapshot held."""
        self._lost_leased[lease_id] = lost

    # --- acks ------------------------------------------------------------------------------

    def pending(self, lease_id: str) -> PendingAck | None:
        return self._pending.get(lease_id)

    def queue(self, pending: PendingAck) -> None:
        """An ack whose record was queued for the journal."""
        self._pending[pending.ack.record.lease_id] = pending

    def unqueue(self, pending: PendingAck) -> bool:
        """Takes a queued ack out (applied, or its sync failed); False when it was out
        already (whoever came first applied it)."""
        lease_id = pending.ack.record.lease_id
        if self._pending.get(lease_id) is not pending:
            return False
        del self._pending[lease_id]
        return True

    def applicable(self) -> list[PendingAck]:
        """The queued acks whose records are durable, in the order they were queued."""
        return [p for p in self._pending.values() if p.applicable]

    def record_ack(self, record: AckRecord) -> None:
        """An ack applied: its lease ends, and ``record`` (with the groups the buffer held)
        waits for finalization."""
        self._leases.pop(record.lease_id, None)
        self._lost_leased.pop(record.lease_id, None)
        self._acks[record.lease_id] = record
        self._max_acked_step = max(self._max_acked_step, record.trainer_step)

    def forget_lost_lease(self, lease_id: str) -> None:
        """The journal acked a lease after the snapshot: what it held lost goes with the ack."""
        self._lost_leased.pop(lease_id, None)

    def lost_ack(self, lost: LostAck) -> None:
        self._lost_acks.append(lost)

    def finalize(self, through_step: int) -> list[AckRecord]:
        """Ends the acks at steps <= ``through_step`` (their groups are finalized) and
        remembers their leases; returns them."""
        done = [r for r in self._acks.values() if r.trainer_step <= through_step]
        for record in done:
            del self._acks[record.lease_id]
        finalized = {r.lease_id: r.trainer_step for r in done}
        remember_finalized(self._finalized, finalized)
        remember_finalized(self._finalized_new, finalized)
        self._finalized_through = max(self._finalized_through, through_step)
        return done

    def rewind(self, after_step: int) -> tuple[list[AckRecord], list[LostAck]]:
        """Undoes the acks at steps > ``after_step``, oldest first, and the lost acks among
        them; the highest acked step goes back to ``after_step`` at most."""
        undone = sorted(
            (r for r in self._acks.values() if r.trainer_step > after_step),
            key=lambda r: r.acked_at,
        )
        for record in undone:
            del self._acks[record.lease_id]
        lost = [a for a in self._lost_acks if a.trainer_step > after_step]
        self._lost_acks = [a for a in self._lost_acks if a.trainer_step <= after_step]
        self._max_acked_step = min(self._max_acked_step, after_step)
        return undone, lost

    # --- snapshots -------------------------------------------------------------------------

    def capture(self) -> LedgerState:
        """Copies of the lease and ack tables (bounded by leases and acks outstanding) and the
        leases finalized since the last capture; call under the exclusive hold."""
        finalized, self._finalized_new = self._finalized_new, OrderedDict()
        return LedgerState(
            dict(self._leases),
            dict(self._acks),
            finalized,
            self._max_acked_step,
            self._finalized_through,
            tuple(self._lost_acks),
            tuple(
                LostLease(lease_id, tuple(lost), tuple(lost.values()))
                for lease_id, lost in self._lost_leased.items()
            ),
        )

    def restore_uncaptured(self, state: LedgerState) -> None:
        """Puts a captured state's finalized leases back (its snapshot failed), so the next
        capture includes them, oldest first."""
        newer, self._finalized_new = self._finalized_new, OrderedDict(state.finalized_leases)
        remember_finalized(self._finalized_new, newer)

    def load(self, state: LedgerState) -> None:
        """The whole ledger of a snapshot; nothing is marked as finalized since a capture."""
        self._leases = dict(state.leases)
        self._acks = dict(state.acks)
        self._finalized = OrderedDict(state.finalized_leases)
        self._max_acked_step = state.max_acked_step
        self._finalized_through = state.finalized_through
        self._lost_acks = list(state.lost_acks)
        self._lost_leased = {
            lost.lease_id: dict(zip(lost.group_ids, lost.admissions, strict=True))
            for lost in state.lost_leases
        }

    def group_ids(self, lease_ids: Iterable[str]) -> list[int]:
        """The groups of the named live leases, in lease order."""
        return [gid for lease_id in lease_ids for gid in self._leases[lease_id].group_ids]
