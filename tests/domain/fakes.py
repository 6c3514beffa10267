"""Small fakes of the ports the controller's rooms use, and the real shared parts they are built
on, for the tests that exercise one room at a time (tests/domain/test_<room>.py).

The shared parts (buffer, barrier, sampler, wake-ups, liveness, accounting, flight) are the real
ones: they are cheap and hold the rules a room relies on. What a room talks to beyond them is
faked here: the journal (:class:`MemoryJournal`), the observer (:class:`RecordingObserver`), the clock
(:class:`Clock`); the engine is ``tests.fakes.GatedEngine``.
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rolloutd.domain.accounting import Accounting
from rolloutd.domain.barrier import MutationBarrier
from rolloutd.domain.buffer import RolloutBuffer
from rolloutd.domain.drops import Drops
from rolloutd.domain.finisher import Finisher
from rolloutd.domain.finishing import CommitAll, FinishingStage
from rolloutd.domain.flight import Flight
from rolloutd.domain.group import Group, GroupMeta, Position, Prompt, Sample
from rolloutd.domain.journal import AckRecord, JournaledDrop, Lease
from rolloutd.domain.liveness import Liveness
from rolloutd.domain.observer import GroupCommitted, GroupDropped, GroupFinished, NullObserver
from rolloutd.domain.policy import Policy, PolicyConfig
from rolloutd.domain.sampler import Admission, Sampler
from rolloutd.domain.wakeups import Wakeups
from tests.fakes import GatedEngine

PROMPTS = [Prompt(f"p{i}", f"question {i}") for i in range(20)]


class Clock:
    """Wall-clock time that moves only when a test moves it."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class MemoryJournal:
    """The journal port (``domain/journal.py``) in memory: every record it was given, in order,
    as ``(kind, value)``.

    ``hold`` keeps acks and lease grants queued (their futures pending) until :meth:`sync`;
    ``fail`` makes every write fail with that error (the queued ones when they sync)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, Any]] = []
        self.hold = False
        self.fail: OSError | None = None
        self._queued: list[asyncio.Future[int]] = []

    def of(self, kind: str) -> list[Any]:
        return [value for k, value in self.records if k == kind]

    def _queue(self, kind: str, value: Any) -> asyncio.Future[int]:
        durable: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.records.append((kind, value))
        self._queued.append(durable)
        if not self.hold:
            self.sync()
        return durable

    def sync(self, count: int | None = None) -> None:
        """Makes the first ``count`` queued records (all: None) durable, or fails them with
        ``fail``."""
        count = len(self._queued) if count is None else count
        queued, self._queued = self._queued[:count], self._queued[count:]
        for durable in queued:
            if self.fail is not None:
                durable.set_exception(self.fail)
            else:
                durable.set_result(len(self.records))

    def _write(self, kind: str, value: Any) -> None:
        if self.fail is not None:
            raise self.fail
        self.records.append((kind, value))

    def ack(self, record: AckRecord, admissions: Mapping[int, Admission]) -> asyncio.Future[int]:
        return self._queue("ack", (record, dict(admissions)))

    def lease(self, lease: Lease, admissions: Mapping[int, Admission]) -> asyncio.Future[int]:
        return self._queue("lease", (lease, dict(admissions)))

    async def submit(self, prompts: Sequence[Prompt]) -> None:
        self._write("submit", tuple(prompts))

    async def rewind(self, trainer_step: int) -> None:
        self._write("rewind", trainer_step)

    async def reserve_ids(self, through: int) -> None:
        self._write("reserve_ids", through)

    async def drop(self, drop: JournaledDrop) -> None:
        self._write("drop", drop)

    def episode(self, group_id: int, index: int, record: Any) -> asyncio.Future[int]:
        return self._queue("episode", (group_id, index, record))

    def admit(self, meta: GroupMeta) -> asyncio.Future[int]:
        return self._queue("admit", meta)


class RecordingObserver(NullObserver):
    """Keeps what the rooms told it."""

    def __init__(self) -> None:
        self.dropped: list[GroupDropped] = []
        self.evicted: list[int] = []
        self.committed: list[GroupCommitted] = []
        self.finished: list[GroupFinished] = []
        self.leased: list[tuple[list[float], list[int]]] = []
        self.abandoned: list[tuple[int, str]] = []

    def group_dropped(self, event: GroupDropped) -> None:
        self.dropped.append(event)

    def groups_evicted(self, count: int) -> None:
        self.evicted.append(count)

    def group_committed(self, event: GroupCommitted) -> None:
        self.committed.append(event)

    def group_finished(self, event: GroupFinished) -> None:
        self.finished.append(event)

    def groups_leased(self, queue_s: list[float], staleness: list[int]) -> None:
        self.leased.append((queue_s, staleness))

    def generation_abandoned(self, group_id: int, reason: str) -> None:
        self.abandoned.append((group_id, reason))


def sample(index: int, tokens: int = 3) -> Sample:
    return Sample(
        index,
        array("i", range(tokens)),
        array("f", [-0.5] * tokens),
        "x",
        "stop",
        0,
        array("i", [1, 2]),
        index,
        0.0,
        1.0,
    )


@dataclass
class Shared:
    """The real parts every room shares, and the fakes of its ports, built once a test."""

    engine: GatedEngine = field(default_factory=GatedEngine)
    journal: MemoryJournal = field(default_factory=MemoryJournal)
    observer: RecordingObserver = field(default_factory=RecordingObserver)
    clock: Clock = field(default_factory=Clock)
    sampler: Sampler = field(default_factory=lambda: Sampler(PROMPTS, seed=0))
    buffer: RolloutBuffer = field(default_factory=RolloutBuffer)
    barrier: MutationBarrier = field(default_factory=MutationBarrier)
    liveness: Liveness = field(default_factory=Liveness)
    accounting: Accounting = field(default_factory=Accounting)

    def __post_init__(self) -> None:
        self.wakeups = Wakeups(self.buffer, self.liveness, self.accounting.clock_engine)
        self.flight = Flight(self.engine, self.observer)

    def policy(self, config: PolicyConfig | None = None) -> Policy:
        return Policy(
            config or PolicyConfig(),
            self.engine,
            self.buffer,
            self.barrier,
            self.flight,
            self.sampler,
            self.accounting,
            self.observer,
            self.wakeups,
            self.liveness,
        )

    def drops(self) -> Drops:
        return Drops(
            self.buffer,
            self.barrier,
            self.flight,
            self.accounting,
            self.sampler,
            self.journal,
            self.observer,
            self.wakeups,
        )

    def finisher(self, drops: Drops, stage: FinishingStage | None = None) -> Finisher:
        """A finisher over these parts, committing every group unless ``stage`` says otherwise."""
        return Finisher(
            CommitAll() if stage is None else stage,
            self.buffer,
            self.barrier,
            self.flight,
            self.accounting,
            drops,
            self.sampler,
            self.observer,
            self.wakeups,
            self.liveness,
            self.clock,
        )

    # --- groups in the buffer, each moved along the life cycle's own steps -----------------

    def generating(
        self,
        group_id: int,
        *,
        size: int = 2,
        version: int = 0,
        position: Position | None = None,
        prompt: Prompt | None = None,
    ) -> Group:
        """A group admitted (GENERATING), none of its siblings staged."""
        if prompt is None:
            prompt = (
                Prompt(f"s{group_id}", f"submitted {group_id}")
                if position is None
                else self.sampler.prompt_at(position)
            )
        group = Group(GroupMeta(group_id, prompt, position, size, version, 0.0, group_id))
        self.buffer.add(group)
        self.accounting.admitted()
        return group

    def finishing(self, group_id: int, *, tokens: int = 3, **kw: Any) -> Group:
        """A group whose siblings are all staged (FINISHING)."""
        group = self.generating(group_id, **kw)
        for index in range(group.meta.group_size):
            s = sample(index, tokens)
            self.buffer.stage(group_id, s)
            self.accounting.staged((group_id, index), s)
        return self.buffer.finish(group_id)

    def committed(self, group_id: int, **kw: Any) -> Group:
        """A training-ready group (COMMITTED), committed now."""
        self.finishing(group_id, **kw)
        group = self.buffer.commit(group_id, self.clock())
        self.accounting.committed("dataset", group.generated_tokens)
        return group
