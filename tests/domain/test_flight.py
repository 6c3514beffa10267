"""The flight room on its own: what runs for each group in flight, and how it is cancelled or
stopped."""

from __future__ import annotations

import asyncio
from array import array

from rolloutd.domain.episode_log import EpisodeLog
from rolloutd.domain.flight import Flight
from rolloutd.domain.observer import GenerationStarted
from rolloutd.domain.partial import TokenDelta
from tests.domain.fakes import RecordingObserver
from tests.fakes import GatedEngine


class Traced(RecordingObserver):
    def __init__(self) -> None:
        super().__init__()
        self.started: list[int] = []

    def generation_started(self, event: GenerationStarted):  # type: ignore[no-untyped-def]
        self.started.append(event.group_id)
        return {"traceparent": f"00-{event.group_id:032x}-{1:016x}-01"}


def started(group_id: int) -> GenerationStarted:
    return GenerationStarted(group_id, f"p{group_id}", 2, 0.0, 8, 1.0, 1.0)


def forever() -> asyncio.Task[None]:
    return asyncio.create_task(asyncio.Event().wait())


def log(group_id: int, index: int) -> EpisodeLog:
    return EpisodeLog(group_id, index, None)


async def test_a_group_is_in_flight_from_its_entry_and_counts_its_running_siblings():
    flight = Flight(GatedEngine(), Traced())
    assert (flight.groups, flight.samples, flight.running) == (0, 0, False)
    flight.enter(1)
    assert (flight.groups, flight.running) == (1, False)  # its stage may run: nothing generates
    tasks = [forever(), forever()]
    flight.sibling((1, 0), tasks[0], log(1, 0))
    flight.sibling((1, 1), tasks[1], log(1, 1))
    assert (flight.groups, flight.samples, flight.running) == (1, 2, True)
    assert flight.running_siblings(1) == [0, 1]
    flight.sibling_done((1, 0))
    assert flight.running_siblings(1) == [1] and flight.episode((1, 0)) is None
    assert flight.episode((1, 1)) is not None
    await flight.stop()


async def test_the_observer_is_told_a_groups_generation_started_once():
    observer = Traced()
    flight = Flight(GatedEngine(), observer)
    headers = flight.traced(1, started(1))
    assert flight.traced(1, started(1)) == headers == flight.trace(1)
    assert observer.started == [1]
    assert flight.trace(2) == {}


async def test_an_abandoned_group_ends_its_generation_span_once_and_a_committed_one_silently():
    observer = Traced()
    flight = Flight(GatedEngine(), observer)
    flight.traced(1, started(1))
    flight.traced(2, started(2))
    flight.abandon(1, "dropped: engine_error")
    flight.abandon(1, "dropped: engine_error")
    flight.committed(2)
    flight.abandon(2, "evicted")  # committed already: its span ended with the commit
    flight.abandon(3, "evicted")  # never traced
    assert observer.abandoned == [(1, "dropped: engine_error")]
    assert flight.trace(1) == {} and flight.trace(2) == {}


async def test_leaving_flight_hands_back_the_running_siblings_and_counts_the_departure_once():
    flight = Flight(GatedEngine(), Traced())
    task = forever()
    flight.sibling((1, 0), task, log(1, 0))
    assert flight.leave(1) == {0: task}
    assert flight.leave(1) == {}
    assert (flight.groups, flight.departed) == (0, 1)
    task.cancel()


async def test_cancel_aborts_a_groups_siblings_and_stage_but_not_the_task_that_cancels():
    engine = GatedEngine()
    flight = Flight(engine, Traced())
    siblings = [forever(), forever()]
    other = forever()
    flight.sibling((1, 0), siblings[0], log(1, 0))
    flight.sibling((1, 1), siblings[1], log(1, 1))
    flight.sibling((2, 0), other, log(2, 0))

    async def stage() -> bool:
        """A finishing stage that drops its own group: it cancels the group from inside."""
        await flight.cancel(1)
        return True

    stage_task = asyncio.create_task(stage())
    flight.finishing(1, stage_task)
    assert await stage_task  # it ran to its end: not cancelled by its own cancel
    await asyncio.gather(*siblings, return_exceptions=True)
    assert all(t.cancelled() for t in siblings)
    assert engine.aborted == ["g1-s0", "g1-s1"]
    assert flight.episodes.keys() == {(2, 0)}
    assert flight.groups == 1 and not other.done()
    other.cancel()


async def test_a_finished_stage_is_forgotten_only_if_it_is_the_groups_current_one():
    flight = Flight(GatedEngine(), Traced())
    old, new = forever(), forever()
    flight.finishing(1, new)
    flight.finished(1, old)  # an earlier run's end: the current one stays
    flight.enter(1)
    await flight.cancel(1)
    await asyncio.gather(new, return_exceptions=True)
    assert new.cancelled() and not old.cancelled()
    old.cancel()


async def test_stop_aborts_every_sibling_and_stage_and_waits_for_them():
    engine = GatedEngine()
    flight = Flight(engine, Traced())
    tasks = [forever(), forever()]
    stage = forever()
    flight.sibling((1, 0), tasks[0], log(1, 0))
    flight.sibling((2, 1), tasks[1], log(2, 1))
    flight.finishing(3, stage)
    await flight.stop()
    assert all(t.cancelled() for t in [*tasks, stage])
    assert sorted(engine.aborted) == ["g1-s0", "g2-s1"]


async def test_only_episodes_with_records_are_captured_as_partials():
    flight = Flight(GatedEngine(), Traced())
    with_records, without = log(1, 0), log(1, 1)
    with_records.records.append("a record")  # type: ignore[arg-type]
    with_records.begin_turn(0, [TokenDelta(array("i", [5, 6]), array("f", [-1.0, -1.0]), 0)])
    flight.sibling((1, 0), forever(), with_records)
    flight.sibling((1, 1), forever(), without)
    [partial] = flight.episode_partials()
    assert (partial.group_id, partial.index, partial.turn, len(partial)) == (1, 0, 0, 2)
    assert list(partial.episode_records) == ["a record"]
    await flight.stop()
