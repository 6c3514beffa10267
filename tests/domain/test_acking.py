"""The acking room on its own: acks durable before they return and idempotent, finalization by
the trainer's checkpoints and the rewind window, rewinds, and the ack path journal replay takes."""

from __future__ import annotations

import asyncio

import pytest

from rolloutd.domain.acking import Acking, AckingConfig, AckResult, RewindResult
from rolloutd.domain.errors import (
    FailedPrecondition,
    InvalidArgument,
    InvariantError,
    NotFound,
    Unavailable,
)
from rolloutd.domain.group import GroupState, Position
from rolloutd.domain.journal import AckRecord, JournaledAck, Lease
from rolloutd.domain.ledger import DeliveryLedger
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.policy import Policy, PolicyConfig
from rolloutd.domain.sampler import Admission, Sampler
from tests.domain.fakes import PROMPTS, Shared
from tests.waiting import eventually


class Room:
    """An acking room over real shared parts, its ledger and policy at hand."""

    def __init__(self, shared: Shared | None = None, **config: int) -> None:
        self.shared = s = shared or Shared()
        self.ledger = DeliveryLedger()
        self.policy: Policy = s.policy(PolicyConfig(max_staleness=1))
        self.acking = Acking(
            AckingConfig(**{"rewind_window": 8, **config}),
            s.buffer,
            self.ledger,
            s.barrier,
            self.policy,
            s.accounting,
            s.sampler,
            s.journal,
            s.observer,
            s.wakeups,
            s.clock,
        )
        self._next = 1

    def leased(self, lease_id: str, groups: int = 1, **kw) -> Lease:  # type: ignore[no-untyped-def]
        """A lease of ``groups`` new committed groups, as a fetch grants it."""
        s = self.shared
        for _ in range(groups):
            s.committed(self._next, **kw)
            self._next += 1
        taken = s.buffer.lease(lease_id, groups)
        lease = Lease(lease_id, taken, "trainer", s.clock(), s.clock() + 30)
        self.ledger.grant(lease)
        return lease

    def states(self, lease: Lease) -> list[GroupState]:
        groups = self.shared.buffer.groups
        return [groups[g].state for g in lease.group_ids]


@pytest.mark.parametrize(
    ("lease_id", "step", "field"), [("", 1, "lease_id"), ("x", -1, "trainer_step")]
)
async def test_an_ack_without_a_lease_or_below_step_zero_is_refused(lease_id, step, field):
    room = Room()
    with pytest.raises(InvalidArgument) as refused:
        await room.acking.ack(lease_id, step)
    assert refused.value.field == field


async def test_an_ack_of_an_unknown_or_expired_lease_is_not_found():
    room = Room()
    lease = room.leased("L")
    room.ledger.end_lease("L")  # it expired
    room.shared.buffer.requeue(lease.group_ids)
    with pytest.raises(NotFound, match="unknown or expired"):
        await room.acking.ack("L", 1)
    with pytest.raises(NotFound):
        await room.acking.ack("never", 1)
    assert room.shared.journal.of("ack") == []


async def test_an_ack_consumes_its_lease_once_durable():
    room = Room()
    s = room.shared
    lease = room.leased("L", groups=2, tokens=3)
    s.journal.hold = True
    ack = asyncio.create_task(room.acking.ack("L", 4))
    await eventually("the ack is queued", lambda: s.journal.of("ack"))
    assert not ack.done() and room.states(lease) == [GroupState.LEASED] * 2
    [(record, admissions)] = s.journal.of("ack")
    assert (record.lease_id, record.group_ids, record.trainer_step) == ("L", lease.group_ids, 4)
    assert admissions.keys() == set(lease.group_ids)
    s.journal.sync()
    assert await ack == AckResult(2, already_acked=False)
    assert room.states(lease) == [GroupState.ACKED] * 2
    assert "L" not in room.ledger.leases and room.ledger.acked_at("L") == 4
    c = s.accounting.counters
    assert (c.acked_groups, c.delivered_tokens, c.acked_by_source) == (2, 12, {"submitted": 2})


async def test_an_ack_again_at_its_step_succeeds_and_at_another_step_is_refused():
    room = Room()
    room.leased("L")
    await room.acking.ack("L", 2)
    assert await room.acking.ack("L", 2) == AckResult(1, already_acked=True)
    with pytest.raises(FailedPrecondition, match="trainer_step 2, not 3"):
        await room.acking.ack("L", 3)
    assert len(room.shared.journal.of("ack")) == 1


async def test_a_second_ack_while_the_first_syncs_waits_for_the_same_record():
    room = Room()
    room.leased("L")
    room.shared.journal.hold = True
    first = asyncio.create_task(room.acking.ack("L", 1))
    await eventually("the ack is queued", lambda: room.shared.journal.of("ack"))
    second = asyncio.create_task(room.acking.ack("L", 1))
    await eventually("the second waits", lambda: room.ledger.pending("L") is not None)
    room.shared.journal.sync()
    results = await asyncio.gather(first, second)
    assert results == [AckResult(1, already_acked=False)] * 2
    assert len(room.shared.journal.of("ack")) == 1
    assert room.shared.accounting.counters.acked_groups == 1


async def test_an_ack_that_cannot_be_made_durable_leaves_the_lease_granted_for_a_retry():
    room = Room()
    lease = room.leased("L")
    room.shared.journal.fail = OSError("disk full")
    with pytest.raises(Unavailable, match="ack could not be made durable"):
        await room.acking.ack("L", 1)
    assert "L" in room.ledger.leases and room.ledger.pending("L") is None
    assert room.states(lease) == [GroupState.LEASED]
    room.shared.journal.fail = None
    assert (await room.acking.ack("L", 1)).acked_groups == 1


async def test_an_ack_whose_caller_went_away_is_applied_once_durable():
    room = Room()
    lease = room.leased("L")
    room.shared.journal.hold = True
    ack = asyncio.create_task(room.acking.ack("L", 1))
    await eventually("the ack is queued", lambda: room.shared.journal.of("ack"))
    ack.cancel()
    await asyncio.gather(ack, return_exceptions=True)
    room.shared.journal.sync()
    await eventually("the ack is applied", lambda: room.ledger.acked_at("L") == 1)
    assert room.states(lease) == [GroupState.ACKED]


async def test_a_capture_applies_the_acks_already_durable_and_leaves_those_syncing():
    room = Room()
    room.leased("durable")
    room.leased("syncing")
    s = room.shared
    s.journal.hold = True
    first = asyncio.create_task(room.acking.ack("durable", 1))
    second = asyncio.create_task(room.acking.ack("syncing", 1))
    await eventually("both are queued", lambda: len(s.journal.of("ack")) == 2)
    async with s.barrier.exclusive():
        s.journal.sync(1)
        room.acking.apply_durable_acks()
        assert room.ledger.acked_at("durable") == 1
        assert room.ledger.acked_at("syncing") is None
    assert (await first).acked_groups == 1
    s.journal.sync()
    await second
    assert s.accounting.counters.acked_groups == 2  # each applied once


async def test_finalize_removes_the_groups_acked_through_its_step():
    room = Room()
    early, late = room.leased("early"), room.leased("late")
    await room.acking.ack("early", 1)
    await room.acking.ack("late", 2)
    assert await room.acking.finalize(1) == 1
    groups = room.shared.buffer.groups
    assert early.group_ids[0] not in groups and groups[late.group_ids[0]].state is GroupState.ACKED
    assert room.shared.accounting.counters.finalized_groups == 1
    # a late retry of the finalized lease's ack still succeeds, with its groups gone
    assert await room.acking.ack("early", 1) == AckResult(0, already_acked=True)


async def test_acks_out_of_the_rewind_window_finalize_by_themselves():
    room = Room(rewind_window=2)
    for step in (1, 2, 3, 4):
        room.leased(f"s{step}")
        await room.acking.ack(f"s{step}", step)
    assert room.ledger.finalized_through == 2
    assert sorted(room.ledger.acks) == ["s3", "s4"]


async def test_an_ack_below_the_finalized_step_is_finalized_at_once():
    room = Room(rewind_window=1)
    for step in (10, 11):
        room.leased(f"s{step}")
        await room.acking.ack(f"s{step}", step)
    lagging = room.leased("lagging")
    await room.acking.ack("lagging", 3)
    assert lagging.group_ids[0] not in room.shared.buffer.groups
    assert room.ledger.acked_at("lagging") == 3


async def test_a_step_too_far_ahead_of_the_highest_seen_is_refused():
    room = Room(max_step_ahead=100)
    room.leased("L")
    with pytest.raises(InvalidArgument, match="max_step_ahead=100"):
        await room.acking.ack("L", 101)
    await room.acking.ack("L", 100)
    room.acking.check_step(200)


async def test_a_rewind_makes_the_groups_acked_after_its_step_available_again():
    room = Room()
    s = room.shared
    kept, undone = room.leased("kept", tokens=2), room.leased("undone", groups=2, tokens=2)
    await room.acking.ack("kept", 1)
    await room.acking.ack("undone", 3)
    assert await room.acking.rewind(2) == RewindResult(2, 0)
    assert s.journal.of("rewind") == [2]
    assert room.states(undone) == [GroupState.COMMITTED] * 2
    assert room.states(kept) == [GroupState.ACKED]
    assert list(s.buffer.ready_ids()) == list(undone.group_ids)
    assert room.ledger.acked_at("undone") is None and room.ledger.max_acked_step == 2
    c = s.accounting.counters
    assert c.delivered_tokens == 4 and c.requeued_groups == 2


async def test_a_rewind_to_before_the_finalized_step_is_refused_and_journals_nothing():
    room = Room()
    room.leased("L")
    await room.acking.ack("L", 3)
    await room.acking.finalize(3)
    with pytest.raises(FailedPrecondition, match="finalized"):
        await room.acking.rewind(2)
    with pytest.raises(InvalidArgument):
        await room.acking.rewind(-1)
    assert room.shared.journal.of("rewind") == []


async def test_a_rewind_that_cannot_be_made_durable_changes_nothing():
    room = Room()
    lease = room.leased("L")
    await room.acking.ack("L", 3)
    room.shared.journal.fail = OSError("disk full")
    with pytest.raises(Unavailable, match="rewind could not be made durable"):
        await room.acking.rewind(1)
    assert room.states(lease) == [GroupState.ACKED] and room.ledger.max_acked_step == 3


async def test_a_rewind_evicts_the_groups_that_fell_too_stale_and_readmits_their_prompts():
    room = Room()
    s = room.shared
    lease = room.leased("L", position=Position(0, 3), version=0)
    await room.acking.ack("L", 5)
    await room.policy.update_weights(2, "/w/2")  # acked: not evicted at the update
    assert room.states(lease) == [GroupState.ACKED]
    assert await room.acking.rewind(4) == RewindResult(0, 1)
    assert s.buffer.groups == {}
    assert s.observer.evicted == [1]
    assert s.sampler.next().position == Position(0, 3)


async def test_a_rewind_applies_the_acks_made_durable_before_it_first():
    room = Room()
    s = room.shared
    room.leased("L")
    s.journal.hold = True
    ack = asyncio.create_task(room.acking.ack("L", 5))
    await eventually("queued", lambda: s.journal.of("ack"))
    s.journal.sync()  # durable, not yet applied by the ack's own task
    result = await room.acking.rewind(1)
    await ack
    assert result.redelivered_groups == 1  # the ack was applied, then rewound
    assert room.ledger.acked_at("L") is None


def test_a_replayed_ack_of_groups_no_snapshot_held_keeps_their_prompts_until_a_rewind():
    shared = Shared(sampler=Sampler(PROMPTS[:2], seed=0, shuffle=False, epochs=1))
    room = Room(shared)
    lost = Admission(shared.sampler.prompt_at(Position(0, 1)), Position(0, 1))
    record = AckRecord("L", (7,), 4, 0.0)
    room.acking.apply_ack(JournaledAck(record, {7: lost}))
    assert room.ledger.acked_at("L") == 4
    assert shared.accounting.counters.acked_groups == 1
    assert [a.position for a in iter(shared.sampler.next, None)] == [Position(0, 0)]
    result, _ = room.acking.apply_rewind(3)
    assert result == RewindResult(0, 1)
    assert shared.sampler.next() == lost


def test_a_replayed_ack_of_a_group_the_snapshot_held_unfinished_leaves_it_lost():
    room = Room()
    s = room.shared
    s.finishing(1, tokens=3)
    admission = Admission(s.buffer.groups[1].meta.prompt, None)
    room.acking.apply_ack(JournaledAck(AckRecord("L", (1,), 2, 0.0), {1: admission}))
    assert s.buffer.groups == {}
    assert s.accounting.counters.delivered_tokens == 6
    # its prompt is kept from admission until a rewind reaches before the ack
    assert room.acking.apply_rewind(1)[0] == RewindResult(0, 1)
    assert s.sampler.next() == admission


async def test_a_live_ack_that_names_a_group_the_buffer_lost_is_an_invariant_violation():
    room = Room()
    room.leased("L")
    async with room.shared.barrier.mutation(MutationKind.ACK):
        with pytest.raises(InvariantError, match="lost groups"):
            room.acking.apply_ack(JournaledAck(AckRecord("X", (99,), 1, 0.0)))
