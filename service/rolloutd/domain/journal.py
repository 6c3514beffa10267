"""What a client is told, as the journal records it, and the port that makes it durable.

A lease, an ack, accepted submissions, a rewind, the group ids reserved for admission, a drop,
an episode's records: each is made durable (``checkpoint/journal.py`` implements
:class:`DeliveryJournal`) before the client is told or the change is relied on. What was
journaled after a snapshot comes back from the journal as :data:`Journaled` events, in journal
order; recovery hands each to the room whose record it is (acks go through the same ack path as
live ones).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rolloutd.domain.group import GroupMeta, Position, Prompt
from rolloutd.domain.sampler import Admission


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
class PromptRef:
    """A group's prompt as a lease or ack record names it: by id and dataset position (None:
    submitted), never with its text or metadata, which the dataset or an earlier submission
    holds (``Sampler.resolve``). Journaling the whole prompt would write its metadata again with
    every lease and ack."""

    prompt_id: str
    position: Position | None


@dataclass(frozen=True)
class JournaledAck:
    """An ack as the journal holds it: its record and the admission of each of its groups
    (so that a group no snapshot held can be kept from being admitted again)."""

    record: AckRecord
    admissions: Mapping[int, Admission] = field(default_factory=dict)
    refs: Mapping[int, PromptRef] = field(default_factory=dict)
    """Groups named by reference (records written since leases and acks stopped carrying whole
    prompts); replay resolves them into ``admissions``."""


@dataclass(frozen=True)
class JournaledLease:
    """A lease grant as the journal holds it, with the admission of each of its groups: a
    restarted service keeps a live lease (its ack succeeds, its groups go to nobody else), also
    when its groups were admitted after the snapshot and did not survive."""

    lease: Lease
    admissions: Mapping[int, Admission] = field(default_factory=dict)
    refs: Mapping[int, PromptRef] = field(default_factory=dict)
    """As :attr:`JournaledAck.refs`."""


@dataclass(frozen=True)
class JournaledSubmission:
    """Prompts accepted by ``SubmitPrompts`` after the snapshot."""

    prompts: tuple[Prompt, ...]


@dataclass(frozen=True)
class JournaledRewind:
    """A ``Rewind(trainer_step)`` answered after the snapshot: replayed in its place among the
    acks, so the groups it made available again are not acked again by a restart."""

    trainer_step: int


@dataclass(frozen=True)
class IdReservation:
    """Group ids up to ``through`` (the replica-local counter) may have been handed out: a
    restore never issues them again."""

    through: int


@dataclass(frozen=True)
class JournaledDrop:
    """A group dropped before delivery: its position counts as consumed even when no snapshot
    held the group."""

    group_id: int
    admission: Admission
    reason: str
    """A :class:`DropReason` (a ``StrEnum``: its value is the text), or a custom stage's own;
    journaled and read back as text, :meth:`DropReason.of` on replay."""
    tokens: int
    """Generated tokens of its siblings."""


@dataclass(frozen=True)
class JournaledAdmission:
    """An episode group's admission, journaled with the first episode record of any of its
    siblings: a restore whose snapshot does not hold the group builds it again under the same
    id (so its journaled turns are reused) and never admits its prompt again."""

    meta: GroupMeta


@dataclass(frozen=True)
class JournaledEpisode:
    """An episode record of sibling ``index`` of group ``group_id`` (``domain/episode_log.py``),
    journaled after the snapshot."""

    group_id: int
    index: int
    record: Any


Journaled = (
    JournaledAck
    | JournaledLease
    | JournaledSubmission
    | JournaledRewind
    | IdReservation
    | JournaledDrop
    | JournaledAdmission
    | JournaledEpisode
)
"""One event of the journal, in the order it was made durable."""


class DeliveryJournal(Protocol):
    """Makes what a client is told durable before the RPC returns: acks, lease grants, accepted
    submissions, rewinds, and the group ids reserved for admission (checkpoint/journal.py implements it;
    concurrent writes share one sync)."""

    def ack(self, record: AckRecord, admissions: Mapping[int, Admission]) -> asyncio.Future[int]:
        """Queues an ack without I/O, so that the ack's mutation need not wait for the sync;
        the future resolves (with the record's journal position) once the ack is durable, or
        fails with the sync's error."""
        ...

    def lease(self, lease: Lease, admissions: Mapping[int, Admission]) -> asyncio.Future[int]:
        """Queues a lease grant without I/O, like :meth:`ack`."""
        ...

    async def submit(self, prompts: Sequence[Prompt]) -> None: ...

    async def rewind(self, trainer_step: int) -> None:
        """Journals a rewind; durable on return (raises ``OSError`` when it cannot be)."""
        ...

    async def reserve_ids(self, through: int) -> None: ...

    async def drop(self, drop: JournaledDrop) -> None:
        """Journals a dropped group; durable on return."""
        ...

    def episode(self, group_id: int, index: int, record: Any) -> asyncio.Future[int]:
        """Queues an episode record (``domain/episode_log.py``) without I/O; the future
        resolves once it is durable."""
        ...

    def admit(self, meta: GroupMeta) -> asyncio.Future[int]:
        """Queues an episode group's admission (:class:`JournaledAdmission`) without I/O; the
        future resolves once it is durable."""
        ...


def _kept() -> asyncio.Future[int]:
    """A future already resolved: what the null journal keeps is kept at once."""
    durable: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    durable.set_result(0)
    return durable


class NullJournal:
    """Keeps nothing: for a controller without a store."""

    def ack(self, record: AckRecord, admissions: Mapping[int, Admission]) -> asyncio.Future[int]:
        return _kept()

    def lease(self, lease: Lease, admissions: Mapping[int, Admission]) -> asyncio.Future[int]:
        return _kept()

    async def submit(self, prompts: Sequence[Prompt]) -> None:
        return None

    async def rewind(self, trainer_step: int) -> None:
        return None

    async def reserve_ids(self, through: int) -> None:
        return None

    async def drop(self, drop: JournaledDrop) -> None:
        return None

    def episode(self, group_id: int, index: int, record: Any) -> asyncio.Future[int]:
        return _kept()

    def admit(self, meta: GroupMeta) -> asyncio.Future[int]:
        return _kept()
