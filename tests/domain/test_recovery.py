"""Recovery on its own: a capture composed of the rooms' parts, restored into fresh rooms, gives
the same state back; the journal after a snapshot is replayed in its order through the rooms'
own paths; unfinished groups resume."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import pytest

from rolloutd.domain.controller_config import ControllerConfig
from rolloutd.domain.encoder import AS_IS
from rolloutd.domain.errors import RestoreRefused
from rolloutd.domain.fate import DropReason
from rolloutd.domain.group import GroupState, Position, Prompt
from rolloutd.domain.journal import (
    AckRecord,
    IdReservation,
    Journaled,
    JournaledAck,
    JournaledDrop,
    JournaledLease,
    JournaledRewind,
    JournaledSubmission,
    Lease,
)
from rolloutd.domain.partial import TokenDelta
from rolloutd.domain.recovery import Granularity, Recovered, Recovery
from rolloutd.domain.report import PhaseClock, RecoveryState
from rolloutd.domain.rooms import Rooms
from rolloutd.domain.sampler import Admission, Sampler
from rolloutd.domain.snapshot import ControllerState
from tests.domain.fakes import PROMPTS, Clock, MemoryJournal, Shared, sample
from tests.fakes import GatedEngine
from tests.waiting import eventually

LEASE_TIMEOUT_S = 30.0


class World:
    """One controller's rooms, built by the composition root, with the fakes of its ports."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.engine = GatedEngine()
        self.journal = MemoryJournal()
        self.clock = clock or Clock()
        self.rooms = Rooms.build(
            ControllerConfig(group_size=2, lease_timeout_s=LEASE_TIMEOUT_S, max_staleness=4),
            self.engine,
            Sampler(PROMPTS, seed=0, shuffle=False),
            journal=self.journal,
            clock=self.clock,
        )
        self.recovery = Recovery(self.rooms)
        r = self.rooms
        # builds groups in the rooms' own buffer and accounting
        self.groups = Shared(
            engine=self.engine,
            journal=self.journal,
            clock=self.clock,
            sampler=r.sampler,
            buffer=r.buffer,
            accounting=r.accounting,
        )

    async def capture(self) -> ControllerState:
        async with self.rooms.barrier.exclusive():
            return self.recovery.capture()

    async def recover(
        self,
        state: ControllerState | None,
        journal: Sequence[Journaled] = (),
        granularity: Granularity = Granularity.TOKEN,
    ):  # type: ignore[no-untyped-def]
        return await self.recovery.recover(
            Recovered(state, None, lambda: list(journal), granularity), PhaseClock()
        )

    def states(self) -> dict[int, GroupState]:
        return {gid: g.state for gid, g in self.rooms.buffer.groups.items()}


@pytest.fixture
async def worlds():
    made: list[World] = []

    def make(clock: Clock | None = None) -> World:
        made.append(World(clock))
        return made[-1]

    yield make
    for world in made:
        await world.rooms.flight.stop()


async def populated(world: World) -> dict[str, str]:
    """Groups in every buffered state, a live lease, an ack, a submission, new weights; returns
    the lease ids by what they hold."""
    r, g = world.rooms, world.groups
    for _ in range(5):  # the sampler's cursor moves past the groups' positions
        r.sampler.next()
    await r.ids.reserve()
    for _ in range(5):
        r.ids.issue()
    g.committed(1, position=Position(0, 0))
    g.committed(2, position=Position(0, 1))
    acked, _ = await r.leasing.fetch_encoded(2, 0, "trainer", AS_IS)
    await r.acking.ack(acked.lease_id, 2)
    g.committed(3, position=Position(0, 2))
    live, _ = await r.leasing.fetch_encoded(1, 0, "trainer", AS_IS)
    g.finishing(4, position=Position(0, 3))
    generating = g.generating(5, position=Position(0, 4))
    staged = sample(0, tokens=4)
    g.buffer.stage(5, staged)
    r.accounting.staged((5, 0), staged)
    r.accounting.stage((5, 1))
    r.accounting.sink((5, 1))(TokenDelta(array("i", [7, 8, 9]), array("f", [-1.0] * 3), 0))
    assert generating.missing == [1]
    await r.intake.submit([Admission(Prompt("sub", "submitted"), None)])
    await r.policy.update_weights(2, "/w/2")
    return {"acked": acked.lease_id, "live": live.lease_id}


async def test_a_capture_needs_the_exclusive_hold(worlds):
    world = worlds()
    with pytest.raises(RuntimeError, match="exclusive hold"):
        world.recovery.capture()


async def test_a_capture_restored_into_fresh_rooms_gives_the_same_state(worlds):
    before = worlds()
    leases = await populated(before)
    state = await before.capture()
    after = worlds(before.clock)
    counts = await after.recover(state)

    assert counts.groups == {
        RecoveryState.COMMITTED: 0,
        RecoveryState.LEASED: 1,
        RecoveryState.ACKED: 2,
        RecoveryState.UNFINISHED: 2,
    }
    a, b = after.rooms, before.rooms
    states = after.states()
    assert {gid: states[gid] for gid in (1, 2, 3)} == {
        1: GroupState.ACKED,
        2: GroupState.ACKED,
        3: GroupState.LEASED,
    }
    assert dict(a.ledger.leases) == dict(b.ledger.leases) and leases["live"] in a.ledger.leases
    assert dict(a.ledger.acks) == dict(b.ledger.acks)
    assert a.ledger.max_acked_step == 2
    assert (a.sampler.cursor, a.sampler.pending) == (b.sampler.cursor, b.sampler.pending)
    assert (a.policy.version, a.policy.weights_path) == (2, "/w/2")
    assert after.engine.policy_version == 2  # the weights were loaded into the fresh engine
    assert a.ids.next_local == state.next_group_id
    c, d = a.accounting.counters, b.accounting.counters
    assert (c.admitted_groups, c.acked_groups, c.delivered_tokens, c.generated_tokens) == (
        d.admitted_groups,
        d.acked_groups,
        d.delivered_tokens,
        d.generated_tokens,
    )
    # unfinished groups resume: the finishing one is finished again, the generating one goes on
    # from the tokens its sibling had streamed
    await eventually("group 4 commits", lambda: after.states()[4] is GroupState.COMMITTED)
    await eventually("group 5's sibling resumes", lambda: after.engine.requests)
    [request] = after.engine.requests
    assert request.request_id == "g5-s1" and request.prefix is not None
    assert list(request.prefix.token_ids()) == [7, 8, 9]
    assert after.states()[5] is GroupState.GENERATING


async def test_the_rooms_parts_of_a_restored_state_capture_as_they_were_restored(worlds):
    before = worlds()
    await populated(before)
    state = await before.capture()
    after = worlds(before.clock)
    await after.recover(state)
    again = await after.capture()
    assert again.ledger.leases == state.ledger.leases and again.ledger.acks == state.ledger.acks
    assert again.policy == state.policy
    assert again.concurrency == state.concurrency
    assert again.next_group_id == state.next_group_id
    assert again.sampler.cursors == state.sampler.cursors
    assert again.sampler.submitted_prompts == state.sampler.submitted_prompts


async def test_a_lease_that_expired_while_the_service_was_down_gives_its_groups_back(worlds):
    before = worlds()
    leases = await populated(before)
    state = await before.capture()
    before.clock.advance(LEASE_TIMEOUT_S + 1)
    after = worlds(before.clock)
    await after.recover(state)
    assert leases["live"] not in after.rooms.ledger.leases
    assert after.states()[3] is GroupState.COMMITTED


async def test_a_failed_capture_handed_back_is_part_of_the_next_capture(worlds):
    world = worlds()
    world.groups.committed(1)
    failed = await world.capture()
    assert set(failed.buffer.groups) == {1}
    world.recovery.capture_failed(failed)
    world.groups.committed(2)
    assert set((await world.capture()).buffer.groups) == {1, 2}
    assert (await world.capture()).buffer.empty  # nothing changed since


async def test_what_the_journal_holds_after_the_snapshot_is_applied_in_its_order(worlds):
    before = worlds()
    leases = await populated(before)
    state = await before.capture()
    after = worlds(before.clock)
    now = before.clock()
    unheld = Admission(after.rooms.sampler.prompt_at(Position(0, 6)), Position(0, 6))
    journal: list[Journaled] = [
        IdReservation(5000),
        JournaledSubmission((Prompt("late", "after the snapshot"),)),
        JournaledAck(AckRecord(leases["live"], (3,), 5, now)),
        JournaledRewind(4),  # undoes the ack at step 5, not the one at step 2
        JournaledLease(Lease("new", (77,), "t", now, now + 30), {77: unheld}),
        JournaledDrop(
            99,
            Admission(after.rooms.sampler.prompt_at(Position(0, 5)), Position(0, 5)),
            DropReason.ENGINE_ERROR,
            0,
        ),
    ]
    counts = await after.recover(state, journal)
    a = after.rooms
    assert counts.events == len(journal)
    assert a.ids.next_local == 5001
    assert after.states()[3] is GroupState.COMMITTED  # acked, then rewound
    assert after.states()[1] is GroupState.ACKED
    assert a.buffer.groups[1].meta.ack_step == 2
    assert "new" in a.ledger.leases and a.ledger.lost_of("new") == {77: unheld}
    assert a.accounting.counters.dropped_by_reason == {"engine_error": 1}
    # the prompts journaled after the snapshot are queued; positions 5 and 6 never admitted
    admitted = [a.sampler.next() for _ in range(4)]
    assert [x.prompt.prompt_id for x in admitted[:2]] == ["sub", "late"]
    assert [x.position for x in admitted[2:]] == [Position(0, 7), Position(0, 8)]


async def test_with_no_snapshot_the_journal_alone_is_replayed_into_fresh_rooms(worlds):
    world = worlds()
    counts = await world.recover(
        None, [IdReservation(2048), JournaledSubmission((Prompt("a", "q"),))]
    )
    assert counts.events == 2
    assert world.rooms.ids.next_local == 2049
    assert world.rooms.sampler.next().prompt.prompt_id == "a"


async def test_a_group_granularity_restore_generates_the_whole_group_again(worlds):
    before = worlds()
    await populated(before)
    state = await before.capture()
    after = worlds(before.clock)
    counts = await after.recover(state, granularity=Granularity.GROUP)
    await eventually("both siblings run", lambda: len(after.engine.requests) == 2)
    assert sorted(r.index for r in after.engine.requests) == [0, 1]
    assert all(r.prefix is None for r in after.engine.requests)
    # the staged sibling's 4 tokens and the streamed 3 are generated again
    assert after.rooms.accounting.counters.regenerated_tokens == 4 + 3
    assert counts.tokens and sum(counts.tokens.values()) == 3


async def test_a_state_whose_cursor_is_behind_a_buffered_groups_position_is_refused(worlds):
    before = worlds()
    before.groups.committed(1, position=Position(0, 3))  # the cursor never passed it
    state = await before.capture()
    after = worlds()
    with pytest.raises(RestoreRefused, match="not ahead of restored group positions"):
        await after.recover(state)
    assert after.rooms.buffer.groups == {}


@pytest.mark.parametrize(
    ("rewind_first", "state"), [(False, GroupState.COMMITTED), (True, GroupState.ACKED)]
)
async def test_a_journaled_rewind_undoes_only_the_acks_journaled_before_it(
    worlds, rewind_first, state
):
    before = worlds()
    leases = await populated(before)
    snapshot = await before.capture()
    after = worlds(before.clock)
    ack = JournaledAck(AckRecord(leases["live"], (3,), 5, before.clock()))
    rewind = JournaledRewind(4)
    await after.recover(snapshot, [rewind, ack] if rewind_first else [ack, rewind])
    assert after.states()[3] is state
