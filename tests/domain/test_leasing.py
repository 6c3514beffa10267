"""The leasing room on its own: fetches lease ready groups and journal the grant, groups that
cannot be delivered are dropped instead, and expired leases give their groups back."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import pytest

from rolloutd.domain.encoder import AS_IS, Undeliverable
from rolloutd.domain.errors import InvalidArgument, Unavailable
from rolloutd.domain.fate import DropReason
from rolloutd.domain.group import Group, GroupState, Position
from rolloutd.domain.journal import AckRecord, JournaledLease, Lease
from rolloutd.domain.leasing import Leasing, LeasingConfig
from rolloutd.domain.ledger import DeliveryLedger
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.policy import Policy, PolicyConfig
from rolloutd.domain.sampler import Admission, Sampler
from tests.domain.fakes import PROMPTS, Shared
from tests.waiting import eventually


@dataclass
class Encoder:
    """Encodes a group as its id, ``size`` bytes each; refuses the groups in ``refuse``."""

    max_bytes: float = math.inf
    size: int = 10
    refuse: set[int] = field(default_factory=set)

    def encode(self, group: Group) -> tuple[int, int]:
        if group.group_id in self.refuse:
            raise Undeliverable("larger than a gRPC message")
        return group.group_id, self.size


class Room:
    """A leasing room over real shared parts, its ledger and policy at hand."""

    def __init__(self, shared: Shared | None = None, **config: float) -> None:
        self.shared = shared or Shared()
        self.ledger = DeliveryLedger()
        self.policy: Policy = self.shared.policy(PolicyConfig(max_staleness=1))
        s = self.shared
        self.leasing = Leasing(
            LeasingConfig(**{"lease_timeout_s": 30.0, "reap_interval_s": 0.01, **config}),  # type: ignore[arg-type]
            s.buffer,
            self.ledger,
            s.barrier,
            self.policy,
            s.drops(),
            s.accounting,
            s.sampler,
            s.journal,
            s.observer,
            s.wakeups,
            s.liveness,
            s.clock,
        )

    async def fetch(self, max_groups: int = 8, wait_ms: int = 0, encoder=AS_IS):  # type: ignore[no-untyped-def]
        return await self.leasing.fetch_encoded(max_groups, wait_ms, "trainer", encoder)


@pytest.fixture
async def reaping():
    """Runs a room's lease reaper until the test ends."""
    tasks: list[asyncio.Task[None]] = []

    def start(room: Room) -> None:
        tasks.append(asyncio.create_task(room.leasing.reap_expired_leases()))

    yield start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_fetch_leases_the_ready_groups_in_commit_order_up_to_what_it_asks():
    room = Room()
    s = room.shared
    for gid in (3, 1, 2):
        s.committed(gid)
    s.clock.advance(5.0)
    leased = await room.fetch(max_groups=2)
    assert leased is not None
    lease, groups = leased
    assert [g.group_id for g in groups] == [3, 1] and lease.group_ids == (3, 1)
    assert all(s.buffer.groups[g].state is GroupState.LEASED for g in (3, 1))
    assert {s.buffer.groups[g].meta.lease_id for g in (3, 1)} == {lease.lease_id}
    assert s.buffer.groups[2].state is GroupState.COMMITTED
    assert room.ledger.leases == {lease.lease_id: lease}
    assert (lease.consumer, lease.created_at, lease.expires_at) == ("trainer", 1005.0, 1035.0)
    assert room.policy.gate.consumed == 2
    assert s.observer.leased == [([5.0, 5.0], [0, 0])]


async def test_a_lease_is_journaled_with_its_groups_admissions_before_the_fetch_returns():
    room = Room()
    room.shared.journal.hold = True
    room.shared.committed(1, position=Position(0, 4))
    fetch = asyncio.create_task(room.fetch())
    await eventually("the grant is queued", lambda: room.shared.journal.of("lease"))
    [(lease, admissions)] = room.shared.journal.of("lease")
    assert not fetch.done()
    assert admissions == {
        1: Admission(room.shared.sampler.prompt_at(Position(0, 4)), Position(0, 4))
    }
    room.shared.journal.sync()
    got, _ = await fetch
    assert got == lease


async def test_a_lease_that_cannot_be_made_durable_gives_its_groups_back_and_fails():
    room = Room()
    room.shared.journal.fail = OSError("disk full")
    room.shared.committed(1)
    with pytest.raises(Unavailable, match="lease could not be made durable"):
        await room.fetch()
    assert room.ledger.leases == {}
    assert room.shared.buffer.groups[1].state is GroupState.COMMITTED
    assert list(room.shared.buffer.ready_ids()) == [1]


@pytest.mark.parametrize(
    ("args", "field_name"),
    [((0, 0), "max_groups"), ((5, 0), "max_groups"), ((1, -1), "wait_ms"), ((1, 101), "wait_ms")],
)
async def test_a_fetch_out_of_bounds_is_refused(args, field_name):
    room = Room(max_fetch_groups=4, max_wait_ms=100)
    with pytest.raises(InvalidArgument) as refused:
        await room.leasing.fetch_encoded(*args, "t", AS_IS)
    assert refused.value.field == field_name


async def test_a_fetch_with_a_consumer_name_too_long_is_refused():
    room = Room()
    with pytest.raises(InvalidArgument, match="consumer"):
        await room.leasing.fetch_encoded(1, 0, "x" * 257, AS_IS)


async def test_a_fetch_that_finds_nothing_ready_returns_nothing_after_its_wait():
    room = Room()
    assert await room.fetch(wait_ms=0) is None
    assert await room.fetch(wait_ms=20) is None
    assert room.ledger.leases == {}


async def test_a_waiting_fetch_leases_a_group_committed_meanwhile():
    room = Room()
    fetch = asyncio.create_task(room.fetch(wait_ms=30_000))
    await eventually("the fetch waits", lambda: room.policy.gate.waiting() > 0)
    room.shared.committed(1)
    await room.shared.wakeups.notify()
    _, groups = await fetch
    assert [g.group_id for g in groups] == [1]
    assert room.policy.gate.waiting() == 0


async def test_a_waiting_fetch_is_answered_unavailable_when_the_service_drains():
    room = Room()
    fetch = asyncio.create_task(room.fetch(wait_ms=30_000))
    await eventually("the fetch waits", lambda: room.policy.gate.waiting() > 0)
    room.shared.liveness.drain()
    await room.shared.wakeups.notify()
    with pytest.raises(Unavailable, match="draining"):
        await fetch


async def test_a_group_the_encoder_refuses_is_dropped_and_the_next_one_leased():
    room = Room()
    s = room.shared
    for gid in (1, 2, 3):
        s.committed(gid)
    lease, encoded = await room.fetch(max_groups=2, encoder=Encoder(refuse={1}))
    assert encoded == [2, 3] and lease.group_ids == (2, 3)
    assert 1 not in s.buffer.groups
    assert s.accounting.counters.dropped_by_reason == {"undeliverable": 1}
    [record] = s.journal.of("drop")
    assert record.group_id == 1 and record.reason is DropReason.UNDELIVERABLE


async def test_a_fetch_whose_only_groups_cannot_be_delivered_leases_nothing():
    room = Room()
    room.shared.committed(1)
    assert await room.fetch(encoder=Encoder(refuse={1})) is None
    assert room.ledger.leases == {} and room.shared.buffer.groups == {}


async def test_a_fetch_takes_no_more_than_the_encoders_bytes_but_always_one_group():
    room = Room()
    for gid in (1, 2, 3):
        room.shared.committed(gid)
    _, encoded = await room.fetch(encoder=Encoder(max_bytes=25, size=10))
    assert encoded == [1, 2]
    _, encoded = await room.fetch(encoder=Encoder(max_bytes=5, size=10))
    assert encoded == [3]


async def test_a_fetch_is_refused_once_the_service_drains():
    room = Room()
    room.shared.committed(1)
    room.shared.liveness.drain()
    with pytest.raises(Unavailable):
        await room.fetch()


async def test_an_expired_leases_groups_are_available_again_ahead_of_newer_ones(reaping):
    room = Room(lease_timeout_s=10.0)
    s = room.shared
    s.committed(1)
    s.committed(2)
    lease, _ = await room.fetch()
    s.committed(3)
    reaping(room)
    s.clock.advance(10.0)
    await eventually("the lease expires", lambda: not room.ledger.leases)
    assert [s.buffer.groups[g].state for g in (1, 2)] == [GroupState.COMMITTED] * 2
    assert list(s.buffer.ready_ids()) == [1, 2, 3]
    c = s.accounting.counters
    assert (c.expired_leases, c.requeued_groups) == (1, 2)
    assert lease.lease_id not in room.ledger.leases


async def test_the_reaper_gives_back_only_the_leases_past_their_deadline(reaping):
    room = Room(lease_timeout_s=10.0)
    s = room.shared
    s.committed(1)
    s.committed(2)
    first, _ = await room.fetch(max_groups=1)
    s.clock.advance(5.0)
    second, _ = await room.fetch(max_groups=1)
    reaping(room)
    s.clock.advance(6.0)  # the first lease is 11 s old, the second 6 s
    await eventually("the first lease expires", lambda: first.lease_id not in room.ledger.leases)
    assert list(room.ledger.leases) == [second.lease_id]
    assert s.buffer.groups[2].state is GroupState.LEASED
    assert s.accounting.counters.expired_leases == 1


async def test_an_expired_leases_stale_groups_are_evicted_not_delivered(reaping):
    room = Room()
    s = room.shared
    s.committed(1, version=0, position=Position(0, 1))
    s.committed(2, version=1)
    await room.fetch()
    await room.policy.update_weights(2, "/w/2")  # group 1 is now too stale; leased, it stays
    assert 1 in s.buffer.groups
    reaping(room)
    s.clock.advance(60.0)
    await eventually("the lease expires", lambda: not room.ledger.leases)
    assert list(s.buffer.groups) == [2]
    assert s.accounting.counters.evicted_groups == 1 and s.observer.evicted == [1]
    assert s.sampler.next() == Admission(s.sampler.prompt_at(Position(0, 1)), Position(0, 1))


async def test_a_group_whose_leases_expire_too_often_is_dropped(reaping):
    room = Room(max_lease_expiries=2)
    s = room.shared
    s.committed(1)
    reaping(room)
    for expiries in (1, 2):
        await room.fetch()
        s.clock.advance(60.0)
        await eventually(f"expiry {expiries}", lambda: not room.ledger.leases)
    assert s.buffer.groups == {}
    assert s.accounting.counters.dropped_by_reason == {"lease_expiries": 1}
    await eventually("the drop is journaled", lambda: s.journal.of("drop"))
    assert s.journal.of("drop")[0].reason is DropReason.LEASE_EXPIRIES


async def test_after_a_restore_the_leases_that_expired_meanwhile_give_their_groups_back():
    room = Room()
    s = room.shared
    s.committed(1)
    s.committed(2)
    s.buffer.lease("old", 1)
    s.buffer.lease("live", 1)
    room.ledger.grant(Lease("old", (1,), "t", 0.0, s.clock() - 1))
    room.ledger.grant(Lease("live", (2,), "t", 0.0, s.clock() + 1))
    async with s.barrier.mutation(MutationKind.RESTORE):
        room.leasing.requeue_expired()
    assert list(room.ledger.leases) == ["live"]
    assert s.buffer.groups[1].state is GroupState.COMMITTED
    assert s.buffer.groups[2].state is GroupState.LEASED


async def test_a_journaled_lease_is_granted_again_and_its_unheld_groups_kept_from_admission():
    shared = Shared(sampler=Sampler(PROMPTS[:3], seed=0, shuffle=False, epochs=1))
    room = Room(shared)
    first = shared.sampler.next()
    shared.committed(1, position=first.position)
    unheld = Admission(shared.sampler.prompt_at(Position(0, 2)), Position(0, 2))
    lease = Lease("L", (1, 9), "t", shared.clock(), shared.clock() + 30)
    held = Admission(shared.buffer.groups[1].meta.prompt, Position(0, 0))
    async with shared.barrier.mutation(MutationKind.RESTORE):
        room.leasing.regrant(JournaledLease(lease, {1: held, 9: unheld}))
    assert room.ledger.leases["L"].group_ids == (1,)
    assert shared.buffer.groups[1].state is GroupState.LEASED
    assert room.ledger.lost_of("L") == {9: unheld}
    assert shared.sampler.next().position == Position(0, 1)
    assert shared.sampler.next() is None  # (0, 2) is the lease's
    # the lease expires unacknowledged: its unheld group's prompt is admitted again
    async with shared.barrier.mutation(MutationKind.REQUEUE):
        room.leasing.requeue("L")
    assert shared.sampler.next() == unheld
    assert shared.buffer.groups[1].state is GroupState.COMMITTED


async def test_a_journaled_lease_acked_before_is_not_granted_again():
    room = Room()
    s = room.shared
    s.committed(1)
    s.buffer.lease("L", 1)
    room.ledger.record_ack(AckRecord("L", (1,), 3, 0.0))
    lease = Lease("L", (1,), "t", 0.0, s.clock() + 30)
    room.leasing.regrant(JournaledLease(lease, {}))
    assert room.ledger.leases == {}
