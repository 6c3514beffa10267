"""The drops room on its own: the one way a group is dropped, counted once with its reason, its
position consumed, and journaled before or after it leaves depending on who drops it."""

from __future__ import annotations

import asyncio

from rolloutd.domain.fate import DropReason
from rolloutd.domain.group import Position
from rolloutd.domain.journal import JournaledDrop
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.observer import GenerationStarted
from rolloutd.domain.sampler import Admission, Sampler
from tests.domain.fakes import PROMPTS, MemoryJournal, Shared


class WatchingJournal(MemoryJournal):
    """Notes, at each drop record, whether the buffer still held the group."""

    def __init__(self) -> None:
        super().__init__()
        self.held_at_write: list[bool] = []
        self.shared: Shared | None = None

    async def drop(self, drop: JournaledDrop) -> None:
        assert self.shared is not None
        self.held_at_write.append(drop.group_id in self.shared.buffer.groups)
        await super().drop(drop)


def watched() -> tuple[Shared, WatchingJournal]:
    journal = WatchingJournal()
    shared = Shared(journal=journal, sampler=Sampler(PROMPTS[:3], seed=0, epochs=1))
    journal.shared = shared
    return shared, journal


async def test_a_dropped_group_leaves_the_buffer_counted_once_with_its_reason():
    shared = Shared()
    drops = shared.drops()
    shared.finishing(1, size=2, tokens=4)
    await drops.drop(1, DropReason.STAGE_FAILED, "ValueError: bad")
    await drops.drop(1, DropReason.STAGE_FAILED, "again")  # gone already: nothing happens
    assert 1 not in shared.buffer.groups
    c = shared.accounting.counters
    assert c.dropped_groups == 1 and c.dropped_by_reason == {"stage_failed": 1}
    assert (c.dropped_tokens, c.failed_tokens) == (8, 8)
    [event] = shared.observer.dropped
    assert (event.group_id, event.reason, event.tokens) == (1, DropReason.STAGE_FAILED, 8)
    [record] = shared.journal.of("drop")
    assert (record.group_id, record.reason, record.tokens) == (1, DropReason.STAGE_FAILED, 8)


async def test_a_drop_in_flight_is_journaled_before_the_group_leaves():
    shared, journal = watched()
    shared.finishing(1)
    await shared.drops().drop(1, DropReason.ZERO_VARIANCE, "")
    assert journal.held_at_write == [True]
    assert 1 not in shared.buffer.groups


async def test_a_dropped_groups_position_counts_as_consumed():
    shared, _ = watched()
    for _ in range(3):  # the sampler's whole epoch, admitted
        shared.sampler.next()
    shared.finishing(1, position=Position(0, 1))
    await shared.drops().drop(1, DropReason.ZERO_VARIANCE, "")
    assert shared.sampler.next() is None  # not admitted again, unlike an evicted group's


async def test_a_drop_that_cannot_be_journaled_still_drops_the_group():
    shared = Shared()
    shared.journal.fail = OSError("disk full")
    shared.finishing(1)
    await shared.drops().drop(1, DropReason.ENGINE_ERROR, "boom", error=True)
    assert 1 not in shared.buffer.groups
    assert shared.accounting.counters.dropped_by_reason == {"engine_error": 1}


async def test_a_drop_of_a_group_no_longer_buffered_journals_nothing():
    shared = Shared()
    await shared.drops().drop(7, DropReason.ENGINE_ERROR, "")
    assert shared.journal.records == [] and shared.observer.dropped == []
    assert shared.accounting.counters.dropped_groups == 0


async def test_a_drop_aborts_the_groups_running_siblings_and_ends_its_generation_span():
    shared = Shared()
    shared.generating(1)
    shared.flight.traced(1, GenerationStarted(1, "p", 2, 0.0, 8, 1.0, 1.0))
    sibling = asyncio.create_task(asyncio.Event().wait())
    shared.flight.sibling((1, 0), sibling, None)  # type: ignore[arg-type]
    await shared.drops().drop(1, DropReason.REFUSED, "too long")
    assert shared.engine.aborted == ["g1-s0"]
    await asyncio.gather(sibling, return_exceptions=True)
    assert sibling.cancelled()
    assert shared.flight.groups == 0
    assert shared.observer.abandoned == [(1, "refused: too long")]


async def test_a_drop_by_delivery_leaves_at_once_and_is_journaled_after_its_mutation():
    shared, journal = watched()
    drops = shared.drops()
    prompt = shared.committed(1, tokens=2).meta.prompt
    async with shared.barrier.mutation(MutationKind.LEASE):
        record = drops.drop_now(shared.buffer.groups[1], DropReason.UNDELIVERABLE, "too big")
        assert 1 not in shared.buffer.groups
        assert journal.of("drop") == []
    assert record.tokens == 4 and record.reason is DropReason.UNDELIVERABLE
    assert record.admission == Admission(prompt, None)
    await drops.journal([record])
    assert journal.of("drop") == [record] and journal.held_at_write == [False]
    assert shared.accounting.counters.dropped_by_reason == {"undeliverable": 1}


async def test_a_drop_by_delivery_whose_record_fails_is_dropped_all_the_same():
    shared = Shared()
    drops = shared.drops()
    shared.committed(1)
    record = drops.drop_now(shared.buffer.groups[1], DropReason.LEASE_EXPIRIES, "8 times")
    shared.journal.fail = OSError("disk full")
    await drops.journal([record])
    assert 1 not in shared.buffer.groups
    assert shared.accounting.counters.dropped_groups == 1


def test_a_replayed_drop_of_a_held_group_removes_it_with_its_tokens():
    shared = Shared()
    shared.finishing(1, size=1, tokens=5, position=Position(0, 0))
    admission = Admission(shared.buffer.groups[1].meta.prompt, Position(0, 0))
    shared.drops().replay(JournaledDrop(1, admission, "zero_variance", 5))
    assert 1 not in shared.buffer.groups
    c = shared.accounting.counters
    assert c.dropped_by_reason == {"zero_variance": 1} and c.dropped_tokens == 5
    assert shared.observer.dropped == []  # told live, when it happened


def test_a_replayed_drop_of_a_group_no_snapshot_held_keeps_its_position_from_admission():
    shared = Shared(sampler=Sampler(PROMPTS[:3], seed=0, shuffle=False, epochs=1))
    position = Position(0, 1)
    admission = Admission(shared.sampler.prompt_at(position), position)
    shared.drops().replay(JournaledDrop(9, admission, "engine_error", 12))
    admitted = [a.position for a in iter(shared.sampler.next, None)]
    assert admitted == [Position(0, 0), Position(0, 2)]
    c = shared.accounting.counters
    # counted, with none of its tokens: this restore never counted them generated
    assert c.dropped_groups == 1 and c.dropped_tokens == 0
