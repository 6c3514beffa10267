"""The generation room on its own: each sibling its own engine request and task, streamed into
the staging, retried from its prefix after a recoverable error, and the group dropped or the
controller ended when the engine cannot go on."""

from __future__ import annotations

import asyncio
from array import array

import pytest

from rolloutd.domain.engine import EngineDeadError, EngineError, RequestRefused
from rolloutd.domain.generation import Generation, GenerationConfig
from rolloutd.domain.group import Group, GroupMeta, GroupState, Prompt
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.partial import PartialSibling, TokenDelta
from rolloutd.domain.runner import EngineRunner
from rolloutd.domain.spec import SamplingParams
from tests.domain.fakes import Shared
from tests.fakes import GatedEngine
from tests.waiting import eventually

SAMPLING = SamplingParams(max_tokens=8)


class FailingEngine(GatedEngine):
    """Raises the next of ``errors`` for each request before answering as the gated engine."""

    def __init__(self, errors: list[BaseException], **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kw)
        self.errors = errors

    async def generate(self, request, on_delta=None):  # type: ignore[no-untyped-def]
        if self.errors:
            self.requests.append(request)
            if on_delta is not None:
                on_delta(TokenDelta(array("i", [9, 9]), array("f", [-1.0, -1.0]), 0))
            raise self.errors.pop(0)
        return await super().generate(request, on_delta)


@pytest.fixture
async def rooms():
    """Builds a generation room over shared parts; stops what it runs after the test."""
    made: list[Shared] = []

    def build(engine: GatedEngine | None = None, **config) -> tuple[Generation, Shared]:  # type: ignore[no-untyped-def]
        s = Shared(engine=engine or GatedEngine())
        made.append(s)
        drops = s.drops()
        finisher = s.finisher(drops)
        generation = Generation(
            GenerationConfig(SAMPLING, **{"sibling_retries": 1, **config}),
            s.engine,
            EngineRunner(),
            s.buffer,
            s.barrier,
            s.flight,
            s.accounting,
            drops,
            finisher,
            s.sampler,
            s.journal,
            s.observer,
            s.liveness,
        )
        return generation, s

    yield build
    for s in made:
        await s.flight.stop()


async def test_each_sibling_is_its_own_request_and_the_last_one_staged_finishes_the_group(rooms):
    generation, s = rooms()
    group = s.generating(1, size=3)
    generation.dispatch(group, group.missing, fresh=True)
    assert s.flight.groups == 1 and s.flight.samples == 3
    await eventually("three requests", lambda: len(s.engine.requests) == 3)
    assert sorted(r.request_id for r in s.engine.requests) == ["g1-s0", "g1-s1", "g1-s2"]
    assert len({r.seed for r in s.engine.requests}) == 3
    assert {r.params for r in s.engine.requests} == {SAMPLING}
    s.engine.release(2)
    await eventually("two staged", lambda: len(group.samples) == 2)
    assert group.state is GroupState.GENERATING
    s.engine.release()
    await eventually("the group commits", lambda: group.state is GroupState.COMMITTED)
    assert s.flight.groups == 0
    assert s.accounting.counters.generated_tokens == group.generated_tokens == 15


async def test_a_siblings_tokens_stream_into_the_staging_while_it_generates(rooms):
    generation, s = rooms(GatedEngine(tokens=5, early=2))
    group = s.generating(1, size=1)
    generation.dispatch(group, [0])
    await eventually("two tokens staged", lambda: s.accounting.streams.get((1, 0)))
    [partial] = s.accounting.partials()
    assert (partial.group_id, partial.index, len(partial)) == (1, 0, 2)
    s.engine.release()
    await eventually("the group commits", lambda: group.state is GroupState.COMMITTED)
    assert not s.accounting.staging((1, 0))
    assert s.accounting.counters.generated_tokens == 5


async def test_without_captured_partials_nothing_is_staged_while_a_sibling_generates(rooms):
    generation, s = rooms(GatedEngine(tokens=5, early=2), capture_partials=False)
    group = s.generating(1, size=1)
    generation.dispatch(group, [0])
    await eventually("the request", lambda: s.engine.requests)
    assert s.accounting.partials() == ()
    s.engine.release()
    await eventually("the group commits", lambda: group.state is GroupState.COMMITTED)
    assert s.accounting.counters.generated_tokens == 5


async def test_a_restored_sibling_continues_from_its_prefix(rooms):
    generation, s = rooms(GatedEngine(auto=True, tokens=5))
    group = s.generating(1, size=1)
    prefix = PartialSibling(1, 0, [TokenDelta(array("i", [4, 4]), array("f", [-1.0, -1.0]), 0)], 1)
    generation.dispatch(group, [0], {0: prefix})
    await eventually("the group commits", lambda: group.state is GroupState.COMMITTED)
    [request] = s.engine.requests
    assert request.prefix is prefix
    [sample] = group.ordered_samples()
    assert list(sample.token_ids[:2]) == [4, 4] and sample.resumed_at == 2


async def test_a_recoverable_error_is_retried_with_the_failed_attempts_tokens_regenerated(rooms):
    generation, s = rooms(FailingEngine([EngineError("oom")], auto=True))
    group = s.generating(1, size=1)
    generation.dispatch(group, [0])
    await eventually("the group commits", lambda: group.state is GroupState.COMMITTED)
    assert len(s.engine.requests) == 2
    assert s.accounting.counters.regenerated_tokens == 2  # the failed attempt's streamed tokens


async def test_an_error_that_outlasts_the_retries_drops_the_group(rooms):
    generation, s = rooms(FailingEngine([EngineError("oom")] * 2), sibling_retries=1)
    group = s.generating(1, size=1)
    generation.dispatch(group, [0])
    await eventually("the group is dropped", lambda: not s.buffer.groups)
    assert len(s.engine.requests) == 2
    c = s.accounting.counters
    assert c.dropped_by_reason == {"engine_error": 1}
    assert s.journal.of("drop")[0].reason == "engine_error"
    assert s.flight.groups == 0


async def test_a_request_the_engine_refuses_drops_the_group_without_a_retry(rooms):
    generation, s = rooms(FailingEngine([RequestRefused("prompt too long")]), sibling_retries=3)
    group = s.generating(1, size=2)
    generation.dispatch(group, [0, 1])
    await eventually("the group is dropped", lambda: not s.buffer.groups)
    assert s.accounting.counters.dropped_by_reason == {"refused": 1}
    assert "g1-s1" in s.engine.aborted  # its other sibling aborted with it


async def test_an_engine_that_dies_ends_the_controller(rooms):
    dead = EngineDeadError("gone")
    generation, s = rooms(FailingEngine([dead]))
    group = s.generating(1, size=1)
    generation.dispatch(group, [0])
    assert await s.liveness.wait_dead() is dead
    assert group.state is GroupState.GENERATING


async def test_a_sibling_of_a_group_that_left_meanwhile_is_not_staged(rooms):
    generation, s = rooms()
    group = s.generating(1, size=1)
    generation.dispatch(group, [0])
    await eventually("the request", lambda: s.engine.requests)
    async with s.barrier.mutation(MutationKind.EVICT):
        s.accounting.left(group, GroupState.EVICTED)
        s.buffer.remove(1, GroupState.EVICTED)
    [sibling] = [t for t in asyncio.all_tasks() if t.get_name() == "rolloutd-g1-s0"]
    s.engine.release()
    await sibling
    assert group.samples == {} and s.buffer.groups == {}


async def test_a_groups_own_settings_win_over_the_services(rooms):
    generation, s = rooms(GatedEngine(auto=True))
    own = SamplingParams(max_tokens=3, temperature=0.2)
    group = Group(GroupMeta(1, Prompt("p", "q"), None, 1, 0, 0.0, 1, params=own))
    s.buffer.add(group)
    assert generation.params_of(group) == own
    assert generation.params_of(s.generating(2)) == SAMPLING  # a group from before format 5
    generation.dispatch(group, [0])
    await eventually("the group commits", lambda: group.state is GroupState.COMMITTED)
    assert [r.params for r in s.engine.requests] == [own]
