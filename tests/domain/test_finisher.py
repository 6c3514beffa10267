"""The finisher on its own: the finishing stage asked about a FINISHING group outside the barrier,
and its verdict carried out: commit with its scores, or drop with its reason."""

from __future__ import annotations

import asyncio

from rolloutd.domain.fate import DropReason
from rolloutd.domain.finisher import Finisher
from rolloutd.domain.finishing import COMMIT, FinishingGroup, Verdict
from rolloutd.domain.group import GroupScores, GroupState, SampleScore
from rolloutd.domain.mutation import MutationKind
from tests.domain.fakes import Shared
from tests.waiting import eventually


class Stage:
    """Answers ``verdict`` (or raises ``error``) once ``go`` is set; notes what it was asked."""

    def __init__(self, verdict: Verdict = COMMIT, error: Exception | None = None) -> None:
        self.verdict, self.error = verdict, error
        self.asked: list[FinishingGroup] = []
        self.go = asyncio.Event()
        self.go.set()

    async def finish(self, group: FinishingGroup) -> Verdict:
        self.asked.append(group)
        await self.go.wait()
        if self.error is not None:
            raise self.error
        return self.verdict


def room(stage: Stage, shared: Shared | None = None) -> tuple[Finisher, Shared]:
    s = shared or Shared()
    finisher = Finisher(
        stage,
        s.buffer,
        s.barrier,
        s.flight,
        s.accounting,
        s.drops(),
        s.sampler,
        s.observer,
        s.wakeups,
        s.liveness,
        s.clock,
    )
    return finisher, s


SCORES = GroupScores((SampleScore(1.0), SampleScore(0.0)), 0.5, 0.5)


async def test_a_committed_verdict_makes_the_group_training_ready_with_its_scores():
    stage = Stage(Verdict(scores=SCORES))
    finisher, s = room(stage)
    group = s.finishing(1, tokens=3)
    s.flight.enter(1)
    await finisher.finish(group)
    [asked] = stage.asked
    assert (asked.group_id, [x.index for x in asked.samples], asked.source) == (
        1,
        [0, 1],
        "submitted",
    )
    assert group.state is GroupState.COMMITTED and group.meta.scores == SCORES
    assert group.meta.committed_at == s.clock()
    assert list(s.buffer.ready_ids()) == [1]
    assert s.flight.groups == 0
    c = s.accounting.counters
    assert (c.committed_groups, c.committed_tokens, c.committed_by_source) == (
        1,
        6,
        {"submitted": 1},
    )
    [finished] = s.observer.finished
    [committed] = s.observer.committed
    assert finished.verdict == stage.verdict and finished.tokens == 6
    assert (committed.group_id, committed.tokens, committed.group_size) == (1, 6, 2)


async def test_a_drop_verdict_drops_the_group_with_its_reason():
    finisher, s = room(Stage(Verdict(DropReason.ZERO_VARIANCE, "rewards all 1.0")))
    group = s.finishing(1)
    await finisher.finish(group)
    assert s.buffer.groups == {}
    assert s.accounting.counters.dropped_by_reason == {"zero_variance": 1}
    assert s.journal.of("drop")[0].reason is DropReason.ZERO_VARIANCE
    assert s.observer.committed == []


async def test_a_stage_that_raises_drops_its_group_as_stage_failed():
    finisher, s = room(Stage(error=ValueError("bad reward")))
    await finisher.finish(s.finishing(1))
    assert s.buffer.groups == {}
    assert s.accounting.counters.dropped_by_reason == {"stage_failed": 1}
    [event] = s.observer.finished
    assert event.verdict.drop_reason is DropReason.STAGE_FAILED
    assert "ValueError: bad reward" in event.verdict.detail


async def test_the_stage_runs_outside_the_barrier():
    stage = Stage()
    stage.go.clear()
    finisher, s = room(stage)
    group = s.finishing(1)
    finishing = asyncio.create_task(finisher.finish(group))
    await eventually("the stage is asked", lambda: stage.asked)
    async with s.barrier.exclusive():  # a checkpoint is not held up by the stage
        assert group.state is GroupState.FINISHING
    stage.go.set()
    await finishing
    assert group.state is GroupState.COMMITTED


async def test_a_group_that_left_the_buffer_while_its_stage_ran_is_not_committed():
    stage = Stage()
    stage.go.clear()
    finisher, s = room(stage)
    group = s.finishing(1)
    finishing = asyncio.create_task(finisher.finish(group))
    await eventually("the stage is asked", lambda: stage.asked)
    async with s.barrier.mutation(MutationKind.EVICT):
        s.accounting.left(group, GroupState.EVICTED)
        s.buffer.remove(1, GroupState.EVICTED)
    stage.go.set()
    await finishing
    assert s.buffer.groups == {} and s.accounting.counters.committed_groups == 0
    assert s.observer.committed == []


async def test_a_group_finished_later_is_in_flight_until_its_stage_commits_it():
    stage = Stage()
    stage.go.clear()
    finisher, s = room(stage)
    group = s.finishing(1)
    finisher.finish_later(group)
    assert s.flight.groups == 1
    await eventually("the stage is asked", lambda: stage.asked)
    stage.go.set()
    await eventually("the group commits", lambda: group.state is GroupState.COMMITTED)
    assert s.flight.groups == 0 and s.liveness.fatal is None
