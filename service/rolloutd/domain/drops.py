"""Dropping a group: the one way a group leaves the buffer before delivery, for a reason
(``DropReason``, or a custom stage's own), its prompt position counted as consumed (docs/design.md,
"The life of a group").

A drop is exactly-once like what a client is told, but when it is journaled depends on who drops:

* generation and finishing (an engine error, a refused request, a stage's verdict) journal the drop
  *before* the group leaves (:meth:`Drops.drop`): a restart replays it, and a snapshot taken in
  between holds the group with a journal position that covers the record, so its stage runs
  again;
* delivery (a group it cannot send, or whose leases expired too often) drops a committed group
  *inside* its own mutation and journals after it (:meth:`Drops.drop_now`, then
  :meth:`Drops.journal`): a restart before the record is durable finds the group committed in its
  snapshot (and gives up on it again) or not at all (its position consumed);
* journal replay applies a drop made after the snapshot (:meth:`Drops.replay`).

Each removes the group through the same step: its siblings aborted, its tokens counted in their
fate, the group removed as DROPPED, the observer and the log told.
"""

from __future__ import annotations

import logging

from rolloutd.domain.accounting import Accounting
from rolloutd.domain.barrier import MutationBarrier
from rolloutd.domain.buffer import RolloutBuffer
from rolloutd.domain.fate import DropReason
from rolloutd.domain.flight import Flight
from rolloutd.domain.group import Group, GroupState
from rolloutd.domain.journal import DeliveryJournal, JournaledDrop
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.observer import GroupDropped, Observer
from rolloutd.domain.sampler import Admission, Sampler
from rolloutd.domain.wakeups import Wakeups

log = logging.getLogger(__name__)


class Drops:
    """See the module docstring."""

    def __init__(
        self,
        buffer: RolloutBuffer,
        barrier: MutationBarrier,
        flight: Flight,
        accounting: Accounting,
        sampler: Sampler,
        journal: DeliveryJournal,
        observer: Observer,
        wakeups: Wakeups,
    ) -> None:
        self._buffer = buffer
        self._barrier = barrier
        self._flight = flight
        self._accounting = accounting
        self._sampler = sampler
        self._journal = journal
        self._observer = observer
        self._wakeups = wakeups

    async def drop(
        self, group_id: int, reason: DropReason | str, detail: str, *, error: bool = False
    ) -> None:
        """Drops a group in flight for ``reason``, journaled first (see the module docstring).
        ``error``: a fault (logged as an error), not a routine verdict (counted, logged at
        DEBUG)."""
        group = self._buffer.groups.get(group_id)
        if group is None:
            return
        try:
            await self._journal.drop(_record(group, reason, group.generated_tokens))
        except OSError as exc:
            _not_journaled(group_id, exc)
        async with self._barrier.mutation(MutationKind.DROP):
            if self._buffer.groups.get(group_id) is not group:
                return
            await self._flight.cancel(group_id)
            self._remove(group, reason, detail, logging.ERROR if error else logging.DEBUG)
        await self._wakeups.notify()

    def drop_now(self, group: Group, reason: DropReason | str, detail: str) -> JournaledDrop:
        """Drops a committed group that delivery gave up on, inside the caller's mutation;
        returns the record to journal after it (:meth:`journal`)."""
        tokens = self._remove(group, reason, detail, logging.WARNING)
        return _record(group, reason, tokens)

    async def journal(self, records: list[JournaledDrop]) -> None:
        """Journals the drops of :meth:`drop_now`, after their mutation."""
        for record in records:
            try:
                await self._journal.drop(record)
            except OSError as exc:
                _not_journaled(record.group_id, exc)
        await self._wakeups.notify()

    def replay(self, drop: JournaledDrop) -> None:
        """A drop journaled after the snapshot (inside the RESTORE mutation): the group leaves
        the buffer when the snapshot held it unfinished, else its position is never admitted.
        What the group generated after the snapshot was never counted here."""
        group = self._buffer.groups.get(drop.group_id)
        if group is None:
            self._sampler.skip(drop.admission)
            self._accounting.dropped(drop.reason, 0)
        else:
            self._accounting.left(group, GroupState.DROPPED, drop.reason)
            self._buffer.remove(drop.group_id, GroupState.DROPPED)
        log.debug(
            "group %d (prompt %s) dropped: %s (replayed from the journal)",
            drop.group_id,
            drop.admission.prompt.prompt_id,
            drop.reason,
        )

    def _remove(self, group: Group, reason: DropReason | str, detail: str, level: int) -> int:
        """The step every live drop takes, inside its mutation; returns the group's tokens."""
        gid = group.group_id
        # its partial siblings too, some of which may have streamed since a record was written
        tokens = self._accounting.left(group, GroupState.DROPPED, reason)
        self._buffer.remove(gid, GroupState.DROPPED)
        why = f"{reason}: {detail}" if detail else str(reason)
        self._observer.group_dropped(GroupDropped(gid, reason, tokens))
        self._flight.abandon(gid, why)
        log.log(level, "group %d (prompt %s) dropped: %s", gid, group.meta.prompt.prompt_id, why)
        return tokens


def _record(group: Group, reason: DropReason | str, tokens: int) -> JournaledDrop:
    return JournaledDrop(
        group.group_id, Admission(group.meta.prompt, group.meta.position), reason, tokens
    )


def _not_journaled(group_id: int, exc: OSError) -> None:
    log.error(
        "the drop of group %d could not be journaled (%s): until the next checkpoint, a "
        "restart may generate its prompt again",
        group_id,
        exc,
    )
