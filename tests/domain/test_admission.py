"""The admission room on its own: the loop admits a prompt whenever there is room (admission on,
the in-flight limit, the buffer's capacity, the staleness gate, a prompt to admit), each group
with an id from a journaled block and its settings resolved once."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from rolloutd.domain.admission import AdmissionConfig, Admitter
from rolloutd.domain.concurrency import ConcurrencyConfig, ConcurrencyState, InFlightReason
from rolloutd.domain.generation import Generation, GenerationConfig
from rolloutd.domain.group import GroupState, Position, Prompt
from rolloutd.domain.ids import ID_BLOCK, GroupIds
from rolloutd.domain.policy import PolicyConfig
from rolloutd.domain.runner import EngineRunner
from rolloutd.domain.sampler import Sampler, Source
from rolloutd.domain.spec import GenerationSpec, SamplingParams
from tests.domain.fakes import PROMPTS, Shared
from tests.fakes import GatedEngine
from tests.waiting import eventually


@dataclass
class Room:
    """An admitter over real shared parts, with the real generation and finishing rooms it
    hands groups to (the engine holds every request until the test releases it)."""

    group_size: int = 2
    max_in_flight: int = 2
    buffer_capacity: int = 16
    staleness_gating: bool = False
    concurrency: ConcurrencyConfig | None = None
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    shared: Shared = field(default_factory=Shared)

    def __post_init__(self) -> None:
        s = self.shared
        self.policy = s.policy(self.policy_config)
        self.ids = GroupIds(0, s.journal.reserve_ids)
        drops = s.drops()
        finisher = s.finisher(drops)
        generation = Generation(
            GenerationConfig(SamplingParams(max_tokens=8)),
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
        self.admitter = Admitter(
            AdmissionConfig(
                self.group_size,
                self.max_in_flight,
                self.buffer_capacity,
                self.staleness_gating,
                seed=0,
                sampling=SamplingParams(max_tokens=8),
                concurrency=self.concurrency,
            ),
            s.engine,
            s.buffer,
            s.barrier,
            s.sampler,
            self.ids,
            self.policy,
            s.flight,
            generation,
            s.accounting,
            s.liveness,
            s.wakeups,
            s.clock,
        )

    @property
    def engine(self) -> GatedEngine:
        return self.shared.engine

    def states(self) -> list[GroupState]:
        return [g.state for g in self.shared.buffer.groups.values()]


@pytest.fixture
async def admitting():
    """Starts a room's admission loop with admission on; stops it and its siblings after."""
    rooms: list[tuple[Room, asyncio.Task[None]]] = []

    def start(room: Room) -> Room:
        room.shared.liveness.admit(True)
        rooms.append((room, asyncio.create_task(room.admitter.admission_loop())))
        return room

    yield start
    for room, task in rooms:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await room.shared.flight.stop()


async def test_admission_stops_at_the_in_flight_limit_and_goes_on_when_a_group_leaves(admitting):
    room = admitting(Room(max_in_flight=2))
    await eventually("two groups generate", lambda: len(room.engine.requests) == 4)
    assert not room.admitter.can_admit()
    assert room.shared.flight.groups == 2 and room.states() == [GroupState.GENERATING] * 2
    room.engine.release(2)  # one group's siblings, in the order they were asked for
    await eventually("a third group", lambda: len(room.engine.requests) == 6)
    assert room.states().count(GroupState.COMMITTED) == 1
    assert room.shared.flight.groups == 2
    assert room.shared.accounting.counters.admitted_groups == 3


async def test_ids_are_issued_from_a_block_journaled_before_the_first_admission(admitting):
    room = admitting(Room())
    await eventually("two groups generate", lambda: room.shared.flight.groups == 2)
    assert room.shared.journal.records[0] == ("reserve_ids", ID_BLOCK)
    assert sorted(room.shared.buffer.groups) == [1, 2]
    assert {r.request_id for r in room.engine.requests} == {"g1-s0", "g1-s1", "g2-s0", "g2-s1"}


async def test_the_buffer_capacity_bounds_the_groups_held(admitting):
    room = Room(max_in_flight=8, buffer_capacity=3)
    room.engine.auto = True
    admitting(room)
    await eventually("three groups commit", lambda: room.states() == [GroupState.COMMITTED] * 3)
    assert not room.admitter.can_admit()
    assert room.shared.accounting.counters.admitted_groups == 3


async def test_nothing_is_admitted_while_admission_is_off(admitting):
    room = admitting(Room())
    room.shared.liveness.admit(False)
    assert not room.admitter.can_admit()
    room.shared.liveness.admit(True)
    await room.shared.wakeups.notify()
    await eventually("admission goes on", lambda: room.shared.flight.groups == 2)
    room.shared.liveness.drain()
    assert not room.admitter.can_admit()


async def test_the_staleness_gate_admits_no_more_than_trainers_can_consume_in_time(admitting):
    gated = admitting(
        Room(
            max_in_flight=10,
            staleness_gating=True,
            policy_config=PolicyConfig(max_staleness=1, prior_per_version=2),
        )
    )
    # the window: 2 groups this version + 2 per version for 1 more version
    await eventually("the gate fills", lambda: gated.shared.flight.groups == 4)
    assert gated.admitter.staleness_room() == 0 and not gated.admitter.can_admit()
    ungated = admitting(Room(max_in_flight=10, shared=Shared()))
    await eventually("the in-flight limit fills", lambda: ungated.shared.flight.groups == 10)


async def test_an_exhausted_dataset_admits_each_prompt_once(admitting):
    shared = Shared(sampler=Sampler(PROMPTS[:3], seed=0, epochs=1))
    room = Room(max_in_flight=8, shared=shared)
    room.engine.auto = True
    admitting(room)
    await eventually("every prompt committed", lambda: room.states() == [GroupState.COMMITTED] * 3)
    assert not room.admitter.can_admit()
    positions = sorted(g.meta.position for g in shared.buffer.groups.values())
    assert positions == [Position(0, 0), Position(0, 1), Position(0, 2)]


async def test_a_group_takes_the_served_version_and_its_prompts_own_settings(admitting):
    spec = GenerationSpec(group_size=3, temperature=0.5, seed=42)
    sampler = Sampler([Source("own", [Prompt("p", "q", generation=spec)])], seed=0, epochs=1)
    room = Room(shared=Shared(sampler=sampler))
    await room.policy.update_weights(3, "/w/3")
    admitting(room)
    await eventually("the group generates", lambda: len(room.engine.requests) == 3)
    [group] = room.shared.buffer.groups.values()
    meta = group.meta
    assert (meta.policy_version, meta.group_size, meta.seed) == (3, 3, 42)
    assert meta.params == SamplingParams(max_tokens=8, temperature=0.5)
    assert meta.admitted_at == room.shared.clock()
    assert {r.params for r in room.engine.requests} == {meta.params}
    assert len({r.seed for r in room.engine.requests}) == 3


def test_a_fixed_limit_captures_nothing_and_keeps_its_value_on_restore():
    room = Room(max_in_flight=5)
    assert room.admitter.capture() == ConcurrencyState(None)
    room.admitter.restore(ConcurrencyState(2))
    assert room.admitter.limit.value == 5
    assert room.admitter.limit.reason is InFlightReason.FIXED


def test_an_adaptive_limit_continues_from_the_captured_value():
    config = ConcurrencyConfig(ceiling=12, initial=4)
    room = Room(max_in_flight=12, concurrency=config)
    assert room.admitter.capture() == ConcurrencyState(4)
    fresh = Room(max_in_flight=12, concurrency=config)
    fresh.admitter.restore(ConcurrencyState(9))
    assert fresh.admitter.limit.value == 9 and fresh.admitter.capture() == ConcurrencyState(9)
    fresh.admitter.restore(ConcurrencyState(99))
    assert fresh.admitter.limit.value == 12  # within the ceiling
