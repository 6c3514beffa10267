"""An episode's durable record: what its model turns and environment steps produced, in order.

Each record is journaled (group commit) in order (docs/design.md, "Episodes"): a model turn's
tokens are durable before its ``step`` is called; a step's result (and ``reset``'s) is queued and
the next model turn starts at once, its write overlapping the generation, and it is durable
before that turn's record is queued and before the episode ends. The list of an episode's
records is append-only while it runs, so a checkpoint's exclusive hold takes a cut of it in
constant time (a reference and a length), as it does of a partial sibling's deltas; the snapshot
holds the cut, the journal what came after, and a restore joins them (:func:`merged`).
"""

from __future__ import annotations

import asyncio
import enum
from array import array
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from rolloutd.domain.episode import Message
from rolloutd.domain.group import GroupMeta, SamplePart
from rolloutd.domain.partial import TokenDelta


class RecordKind(enum.Enum):
    """The kinds of episode record; the journal's record kinds are ``episode_<value>``."""

    RESET = "reset"
    """``reset``'s messages as tokens (with the prompt: the prompt token ids of the sample)."""
    TURN = "turn"
    """A model turn's tokens, logprobs and policy versions."""
    STEP = "step"
    """A ``step``'s result: its messages, their tokens, done, reward, the environment's state."""


@dataclass(frozen=True)
class ModelTurn:
    """Model turn ``turn``: the tokens it sampled, exactly, and where policy versions change."""

    turn: int
    token_ids: array[int]
    logprobs: array[float]
    parts: tuple[SamplePart, ...]
    finish_reason: str
    text: str
    """The turn's text: the completion ``step`` is called with."""

    kind = RecordKind.TURN


@dataclass(frozen=True)
class EnvironmentReply:
    """What the environment answered: ``reset`` (``turn`` -1) or the ``step`` after model turn
    ``turn``, and its messages as tokens (for a reset: the whole prompt's)."""

    turn: int
    messages: tuple[Message, ...]
    token_ids: array[int]
    done: bool = False
    reward: float | None = None
    state: bytes | None = None
    """The environment's ``state()`` after the call (None: it has none)."""

    @property
    def kind(self) -> RecordKind:
        return RecordKind.RESET if self.turn < 0 else RecordKind.STEP


EpisodeRecord = ModelTurn | EnvironmentReply


def key_of(record: EpisodeRecord) -> tuple[RecordKind, int]:
    return record.kind, record.turn


def merged(*sources: Iterable[EpisodeRecord]) -> list[EpisodeRecord]:
    """Records of one episode from a snapshot and the journal after it, each once, in the order
    the episode made them (a record the snapshot held may be journaled after its cut too)."""
    seen: dict[tuple[RecordKind, int], EpisodeRecord] = {}
    for source in sources:
        for record in source:
            seen.setdefault(key_of(record), record)
    order = {RecordKind.RESET: 0, RecordKind.TURN: 1, RecordKind.STEP: 2}
    return sorted(seen.values(), key=lambda r: (r.turn, order[r.kind]))


class EpisodeJournal(Protocol):
    """Makes an episode record durable (``checkpoint/journal.py``; shares the journal's group
    commit). The future resolves once the record is durable."""

    def episode(self, group_id: int, index: int, record: EpisodeRecord) -> Awaitable[int]: ...

    def admit(self, meta: GroupMeta) -> Awaitable[int]: ...


@dataclass(eq=False)
class GroupAdmission:
    """A newly admitted group's metadata, journaled once, just before the first episode record
    of any of its siblings (in the same group commit): episode records are keyed by group id,
    and a restore whose snapshot does not hold the group needs it to build the group again
    under that id rather than admit its prompt again under a new one. Shared by the group's
    episode logs."""

    meta: GroupMeta
    durable: Awaitable[int] | None = None
    """The admission record's write, once queued."""

    def journal(self, journal: EpisodeJournal) -> Awaitable[int]:
        if self.durable is None:
            self.durable = asyncio.ensure_future(journal.admit(self.meta))
        return self.durable


@dataclass(eq=False)
class EpisodeLog:
    """One sibling's episode records and the tokens of its current model turn so far.

    ``records`` starts with what a restore found (durable records are reused, never made
    again) and is append-only; ``deltas`` is the current turn's (``turn``) staging list, replaced
    when a turn begins, so a capture's reference to the old one keeps what it saw.
    """

    group_id: int
    index: int
    journal: EpisodeJournal | None
    """None: records are kept in memory (and in snapshots) only (``episodes.durable_turns``
    off)."""
    records: list[EpisodeRecord] = field(default_factory=list)
    capture: bool = True
    """Whether the current turn's tokens are captured (``recovery.granularity: token``)."""
    pending: list[asyncio.Future[int]] = field(default_factory=list)
    """Writes queued by ``append(wait=False)`` not yet waited for."""
    turn: int | None = None
    deltas: list[TokenDelta] = field(default_factory=list)
    admission: GroupAdmission | None = None
    """The group's admission, to journal with its first record (None: a snapshot or the
    journal holds the group already: it was restored)."""
    restored: int = field(init=False, default=0)
    """How many of ``records`` came from a restore and were not yet taken by a run of the
    episode: the first run reports them as recovered, a retry after an engine error does not
    again."""

    def __post_init__(self) -> None:
        self.restored = len(self.records)

    def find(self, kind: RecordKind, turn: int) -> EpisodeRecord | None:
        for record in self.records:
            if record.turn == turn and record.kind is kind:
                return record
        return None

    async def append(self, record: EpisodeRecord, *, wait: bool = True) -> None:
        """Adds ``record``; returns once it is durable, or with ``wait=False`` once it is
        queued (the next ``append``, or :meth:`settle`, waits for it). It joins ``records``
        before the write (a capture taken meanwhile holds it; a restore keeps one copy of it).

        A record is queued only once every earlier record of the sibling is durable, so the
        journal never holds a record without those before it, even when a write failed."""
        self.records.append(record)
        if self.journal is None:
            return
        await self.settle()
        admitted = None if self.admission is None else self.admission.journal(self.journal)
        queued: list[asyncio.Future[int]] = [
            asyncio.ensure_future(self.journal.episode(self.group_id, self.index, record))
        ]
        if admitted is not None:
            queued.append(asyncio.ensure_future(admitted))  # queued first: only its error is news
        if wait:
            for durable in queued:
                await durable
        else:
            self.pending = queued

    async def settle(self) -> None:
        """Returns once every record queued so far is durable (raises a failed write's error)."""
        pending, self.pending = self.pending, []
        for durable in pending:
            await durable

    def abandon(self) -> None:
        """The episode ends without waiting for its queued writes (it failed, or was
        cancelled): their outcome is the journal's, and an error is not left unretrieved."""
        pending, self.pending = self.pending, []
        for durable in pending:
            durable.add_done_callback(lambda f: f.cancelled() or f.exception())

    def begin_turn(self, turn: int, prefix: Sequence[TokenDelta]) -> None:
        """Model turn ``turn`` starts, continuing from ``prefix`` (its tokens before a restart)."""
        self.turn, self.deltas = turn, list(prefix)

    def on_delta(self, delta: TokenDelta) -> None:
        if self.capture:
            self.deltas.append(delta)
