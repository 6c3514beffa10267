"""Everything that persists, as one frozen value, and the port that makes what clients are told
durable.

:class:`ControllerState` is all a snapshot keeps: group metadata, rows by reference, leases, the
ack ledger, the sampler's cursor and queues, counters and id high-water marks.
``Controller.capture()`` and ``Controller.restore(state)`` are the only ways out of and into the
controller; ``checkpoint/sidecar.py`` encodes and decodes it, and nothing else reads its parts.

A captured state holds the changes since the previous capture (see :class:`BufferState`); a state
to restore from is whole. What a client was told between snapshots (acks, lease grants,
accepted submissions, rewinds) and the group ids reserved since come back from the journal as
:data:`Journaled` events, in journal order; acks go through the same ack path as live ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from rolloutd.domain.admission import GateState
from rolloutd.domain.buffer import AckRecord, BufferState, Lease
from rolloutd.domain.concurrency import ConcurrencyState
from rolloutd.domain.fate import EngineState, TokenFate, drop_fate
from rolloutd.domain.group import GroupMeta, Position, Prompt
from rolloutd.domain.partial import PartialSibling
from rolloutd.domain.sampler import Admission, SamplerState


@dataclass
class Counters:
    """Cumulative over the life of the store (they survive restarts)."""

    admitted_groups: int = 0
    committed_groups: int = 0
    acked_groups: int = 0
    finalized_groups: int = 0
    evicted_groups: int = 0
    requeued_groups: int = 0
    dropped_groups: int = 0
    """Groups dropped: by a finishing stage's verdict, an engine error, or a failed stage."""
    committed_tokens: int = 0
    expired_leases: int = 0
    dropped_by_reason: dict[str, int] = field(default_factory=dict)
    """``dropped_groups`` by reason (``Verdict.drop_reason``, or ``engine_error``,
    ``stage_failed``, ``undeliverable``, ``lease_expiries``)."""
    dropped_tokens: int = 0
    """Generated tokens of the dropped groups' siblings, staged or partial (fates ``dropped``
    and ``failed``)."""
    committed_by_source: dict[str, int] = field(default_factory=dict)
    """``committed_groups`` by the name of the group's source (``submitted``: a submitted
    prompt's)."""
    committed_tokens_by_source: dict[str, int] = field(default_factory=dict)
    acked_by_source: dict[str, int] = field(default_factory=dict)
    """``acked_groups`` by source: what each source delivered to training."""
    generated_tokens: int = 0
    """Tokens the engine handed to the service: streamed to a sibling's staging, or returned in
    a sample beyond what was streamed (domain/fate.py)."""
    delivered_tokens: int = 0
    """Tokens of acked groups (less those a ``Rewind`` made available again)."""
    evicted_tokens: int = 0
    failed_tokens: int = 0
    """Of ``dropped_tokens``, those of groups dropped for a reason the service gives itself
    (``fate.FAILURES``)."""
    regenerated_tokens: int = 0
    engine_seconds: dict[str, float] = field(default_factory=dict)
    """Seconds of the engine's time by ``EngineState`` value while the controller ran."""

    def dropped(self, reason: str, tokens: int) -> None:
        """Counts one dropped group."""
        self.dropped_groups += 1
        self.dropped_by_reason[reason] = self.dropped_by_reason.get(reason, 0) + 1
        self.dropped_tokens += tokens
        if drop_fate(reason) is TokenFate.FAILED:
            self.failed_tokens += tokens

    def settled(self) -> dict[TokenFate, int]:
        """Tokens by terminal fate (every fate but ``buffered``)."""
        return {
            TokenFate.DELIVERED: self.delivered_tokens,
            TokenFate.EVICTED: self.evicted_tokens,
            TokenFate.DROPPED: self.dropped_tokens - self.failed_tokens,
            TokenFate.REGENERATED: self.regenerated_tokens,
            TokenFate.FAILED: self.failed_tokens,
        }

    @property
    def buffered_tokens(self) -> int:
        """The generated tokens no terminal fate holds: what the buffer and the staging of
        generating siblings hold, when the accounting is right."""
        return self.generated_tokens - sum(self.settled().values())

    def engine_time(self, state: EngineState, seconds: float) -> None:
        """Adds ``seconds`` of the engine's time in ``state``."""
        key = state.value
        self.engine_seconds[key] = self.engine_seconds.get(key, 0.0) + seconds

    def committed(self, source: str, tokens: int) -> None:
        """Counts one committed group."""
        self.committed_groups += 1
        self.committed_tokens += tokens
        self.committed_by_source[source] = self.committed_by_source.get(source, 0) + 1
        by_tokens = self.committed_tokens_by_source
        by_tokens[source] = by_tokens.get(source, 0) + tokens

    def acked(self, sources: list[str]) -> None:
        """Counts acked groups, one source name each."""
        self.acked_groups += len(sources)
        for source in sources:
            self.acked_by_source[source] = self.acked_by_source.get(source, 0) + 1

    def copy(self) -> Counters:
        """A copy that shares nothing with this one: a capture's counters are encoded after the
        hold ends, while drops and commits go on counting into the live ones."""
        return replace(
            self,
            dropped_by_reason=dict(self.dropped_by_reason),
            committed_by_source=dict(self.committed_by_source),
            committed_tokens_by_source=dict(self.committed_tokens_by_source),
            acked_by_source=dict(self.acked_by_source),
            engine_seconds=dict(self.engine_seconds),
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


@dataclass(frozen=True)
class ControllerState:
    """A consistent cut of everything a snapshot holds (see the module docstring)."""

    buffer: BufferState
    sampler: SamplerState
    counters: Counters
    next_group_id: int
    policy_version: int
    weights_path: str | None
    max_acked_step: int
    finalized_through: int
    lost_acks: tuple[LostAck, ...] = ()
    lost_leases: tuple[LostLease, ...] = ()
    partials: tuple[PartialSibling, ...] = ()
    """Tokens of generating siblings so far (``ControllerConfig.capture_partials``). Written in
    a snapshot file of their own (``checkpoint/partials.py``), not in rows or the sidecar."""
    gate: GateState = field(default_factory=GateState)
    """The trainers' pace the staleness gate measured."""
    concurrency: ConcurrencyState = field(default_factory=ConcurrencyState)
    """The adaptive limit on groups in flight."""


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
    """An ack read back from the journal: its record and the admission of each of its groups
    (so that a group no snapshot held can be kept from being admitted again)."""

    record: AckRecord
    admissions: Mapping[int, Admission] = field(default_factory=dict)
    refs: Mapping[int, PromptRef] = field(default_factory=dict)
    """Groups named by reference (records written since leases and acks stopped carrying whole
    prompts); replay resolves them into ``admissions``."""


@dataclass(frozen=True)
class JournaledLease:
    """A lease grant read back from the journal, with the admission of each of its groups: a
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
    """A group the finishing stage (or an engine error) dropped before delivery: its position
    counts as consumed even when no snapshot held the group."""

    group_id: int
    admission: Admission
    reason: str
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
