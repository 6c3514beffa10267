import asyncio
from collections.abc import Mapping

import pytest

from rolloutd.domain.controller import Controller, ControllerConfig
from rolloutd.domain.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from rolloutd.domain.group import GroupState, Prompt
from rolloutd.domain.observer import GenerationStarted, GroupCommitted, NullObserver
from rolloutd.domain.sampler import Sampler
from tests.controllers import fetch
from tests.fakes import GatedEngine, settle

PROMPTS = [Prompt(f"p{i}", f"question {i}") for i in range(50)]


def make(engine, clock=None, **kw):
    cfg = ControllerConfig(
        **{"group_size": 3, "max_in_flight": 4, "buffer_capacity": 8, "reap_interval_s": 0.02, **kw}
    )
    sampler = Sampler(PROMPTS, seed=0, epochs=kw.pop("epochs", None))
    return Controller(cfg, engine, sampler, **({"clock": clock} if clock else {}))


@pytest.fixture
async def running():
    controllers = []

    def start(engine, **kw):
        c = make(engine, **kw)
        c.start()
        controllers.append(c)
        return c

    yield start
    for c in controllers:
        await c.stop()


async def test_admission_stops_at_max_in_flight(running):
    engine = GatedEngine()
    c = running(engine, max_in_flight=2)
    await settle(lambda: len(engine.requests) == 6)
    # Admission can go on only once this holds again (nothing changes until a release): no
    # later moment could see more requests.
    assert not c.rooms.admitter.can_admit()
    assert len(engine.requests) == 6  # 2 groups x 3 siblings, nothing more admitted
    assert c.status().buffer.generating == 2
    engine.release(3)
    await settle(lambda: c.status().buffer.committed == 1)
    await settle(lambda: len(engine.requests) == 9)  # a third group was admitted


async def test_buffer_capacity_bounds_groups_held(running):
    engine = GatedEngine(auto=True)
    c = running(engine, buffer_capacity=5, max_in_flight=5)
    await settle(lambda: c.status().buffer.committed == 5)
    assert not c.rooms.admitter.can_admit()  # nothing generating, so nothing more ever admitted
    assert len(c.rooms.buffer.groups) == 5
    assert c.rooms.accounting.counters.admitted_groups == 5


async def test_each_sibling_is_its_own_request_with_its_own_seed(running):
    engine = GatedEngine(auto=True)
    c = running(engine, max_in_flight=1, buffer_capacity=1)
    leased = await fetch(c, 1, 2000, "t")
    assert leased is not None
    _, [group] = leased
    assert sorted(s.index for s in group.ordered_samples()) == [0, 1, 2]
    seeds = {r.seed for r in engine.requests if r.group_id == group.group_id}
    assert len(seeds) == 3
    assert group.state is GroupState.LEASED


async def test_lease_expiry_makes_groups_available_again(running):
    engine = GatedEngine(auto=True)
    c = running(engine, lease_timeout_s=0.05, buffer_capacity=2, max_in_flight=2)
    lease, groups = await fetch(c, 2, 2000, "t")
    await settle(lambda: c.status().buffer.committed == 2)
    assert c.rooms.accounting.counters.requeued_groups == 2
    with pytest.raises(NotFound):
        await c.ack(lease.lease_id, 1)
    _lease2, groups2 = await fetch(c, 2, 100, "t")
    assert [g.group_id for g in groups2] == [g.group_id for g in groups]


async def test_ack_is_idempotent_and_rewind_window_finalizes(running):
    engine = GatedEngine(auto=True)
    c = running(engine, rewind_window=1, buffer_capacity=8, max_in_flight=4)
    leases = []
    for step in (1, 2, 3):
        lease, _ = await fetch(c, 1, 2000, "t")
        r = await c.ack(lease.lease_id, step)
        assert r.acked_groups == 1 and not r.already_acked
        leases.append(lease)
    again = await c.ack(leases[2].lease_id, 3)
    assert again.already_acked and again.acked_groups == 1
    # window 1: acks at steps <= 3 - 1 = 2 finalized by themselves
    assert (
        c.rooms.ledger.finalized_through == 2 and c.rooms.accounting.counters.finalized_groups == 2
    )
    finalized_again = await c.ack(leases[0].lease_id, 1)
    assert finalized_again.already_acked
    with pytest.raises(FailedPrecondition, match="finalized"):
        await c.rewind(1)


async def test_an_ack_at_a_step_already_finalized_is_finalized_at_once(running):
    """A second trainer that counts its steps from 1 while another is far ahead acks below the
    finalized step: its groups can never be rewound, so they leave the buffer (and its
    snapshots) at once instead of piling up until its steps catch up."""
    engine = GatedEngine(auto=True)
    c = running(engine, rewind_window=1, buffer_capacity=8, max_in_flight=4)
    for step in (10, 11):
        lease, _ = await fetch(c, 1, 2000, "ahead")
        await c.ack(lease.lease_id, step)
    assert (
        c.rooms.ledger.finalized_through == 10 and c.rooms.accounting.counters.finalized_groups == 1
    )
    for step in (1, 2, 3):
        lease, _ = await fetch(c, 1, 2000, "behind")
        assert not (await c.ack(lease.lease_id, step)).already_acked
        assert c.rooms.accounting.counters.finalized_groups == 1 + step
        assert c.rooms.buffer.acked_groups == 1  # only step 11's, inside the window
        assert lease.group_ids[0] not in c.rooms.buffer.groups
    assert c.rooms.ledger.finalized_through == 10


async def test_rewind_redelivers_exactly_the_groups_acked_after_the_step(running):
    engine = GatedEngine(auto=True)
    c = running(engine, rewind_window=10, buffer_capacity=8, max_in_flight=4)
    acked = {}
    for step in (1, 2, 3):
        lease, groups = await fetch(c, 1, 2000, "t")
        await c.ack(lease.lease_id, step)
        acked[step] = groups[0].group_id
    result = await c.rewind(1)
    assert result.redelivered_groups == 2
    lease, groups = await fetch(c, 2, 100, "t")
    assert [g.group_id for g in groups] == [acked[2], acked[3]]


async def test_a_trainer_step_going_back_is_logged_once_with_the_rewind_hint(running, caplog):
    """A trainer restarted from its checkpoint at step 5 that forgot Rewind acks at 6 after 50."""
    caplog.set_level("WARNING", logger="rolloutd.domain.controller")
    engine = GatedEngine(auto=True)
    c = running(engine, rewind_window=100, buffer_capacity=8, max_in_flight=4)

    async def ack_at(step: int) -> None:
        lease, _ = await fetch(c, 1, 2000, "t")
        await c.ack(lease.lease_id, step)

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "acked before" in r.getMessage()]

    await ack_at(50)
    await ack_at(6)
    await ack_at(7)
    (told,) = warnings()
    assert "trainer step 6, below step 50" in told and "Rewind(trainer_step=S)" in told
    await c.rewind(7)
    await ack_at(8)
    await ack_at(3)
    assert len(warnings()) == 2, "said again after a Rewind"


async def test_update_weights_evicts_stale_groups_and_readmits_their_prompts(running):
    engine = GatedEngine()
    c = running(engine, max_staleness=0, max_in_flight=2)
    await settle(lambda: len(engine.requests) == 6)
    old = {r.group_id for r in engine.requests}
    evicted = await c.update_weights(1, "/weights")
    assert evicted == 2 and c.policy_version == 1
    assert c.rooms.accounting.counters.evicted_groups == 2
    assert len(engine.aborted) == 6
    await settle(lambda: len({r.group_id for r in engine.requests} - old) == 2)
    new = [r for r in engine.requests if r.group_id not in old]
    old_prompts = {r.prompt.prompt_id for r in engine.requests if r.group_id in old}
    assert {r.prompt.prompt_id for r in new} == old_prompts  # the same prompts, generated again


class Clock:
    """A wall clock the test moves."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


async def test_a_lease_that_expires_after_its_groups_went_stale_evicts_them(running):
    clock = Clock()
    engine = GatedEngine(auto=True)
    c = running(engine, clock=clock, max_staleness=0, lease_timeout_s=60, max_in_flight=2)
    lease, groups = await fetch(c, 2, 2000, "t")
    assert {g.policy_version for g in groups} == {0}
    await c.update_weights(1, "/weights")  # a leased group is the trainer's: not evicted yet
    assert all(c.rooms.buffer.groups[g].state is GroupState.LEASED for g in lease.group_ids)
    evicted = c.rooms.accounting.counters.evicted_groups

    clock.now += 61
    await settle(lambda: c.rooms.accounting.counters.expired_leases == 1)
    assert not set(lease.group_ids) & set(c.rooms.buffer.groups)
    assert c.rooms.accounting.counters.evicted_groups == evicted + 2
    prompts = {g.meta.prompt.prompt_id for g in groups}
    await settle(lambda: prompts <= {r.prompt.prompt_id for r in engine.requests[6:]})
    while (leased := await fetch(c, 8, 0, "t")) is not None:
        assert {g.policy_version for g in leased[1]} == {1}  # generated again, fresh


async def test_a_rewind_to_before_an_ack_of_groups_now_stale_admits_their_prompts_again(running):
    engine = GatedEngine(auto=True)
    # nothing fetches after the rewind: the staleness gate would admit one group at a time
    c = running(engine, max_staleness=0, rewind_window=10, max_in_flight=2, staleness_gating=False)
    lease, [group] = await fetch(c, 1, 2000, "t")
    await c.ack(lease.lease_id, 1)
    await c.update_weights(1, "/weights")

    result = await c.rewind(0)
    assert (result.redelivered_groups, result.readmitted_prompts) == (0, 1)
    assert group.group_id not in c.rooms.buffer.groups
    prompt = group.meta.prompt.prompt_id
    await settle(lambda: prompt in {r.prompt.prompt_id for r in engine.requests[6:]})
    while (leased := await fetch(c, 8, 0, "t")) is not None:
        assert {g.policy_version for g in leased[1]} == {1}


@pytest.mark.parametrize(
    ("max_groups", "wait_ms", "field"),
    [(0, 0, "max_groups"), (-1, 0, "max_groups"), (10**9, 0, "max_groups"), (1, -5, "wait_ms")],
)
async def test_fetch_validates_its_arguments(running, max_groups, wait_ms, field):
    c = running(GatedEngine())
    with pytest.raises(InvalidArgument) as info:
        await fetch(c, max_groups, wait_ms, "t")
    assert info.value.field == field


async def test_fetch_returns_none_after_waiting_when_nothing_is_ready(running):
    c = running(GatedEngine())
    assert await fetch(c, 1, 30, "t") is None


async def test_each_ready_group_reaches_a_waiting_fetch_and_drain_refuses_the_rest(running):
    engine = GatedEngine()
    c = running(engine)
    await settle(lambda: len(engine.requests) == 12)
    waiting = [asyncio.create_task(fetch(c, 1, 5_000, f"t{i}")) for i in range(4)]
    await asyncio.sleep(0.02)
    engine.release(3)  # one group commits: one fetch gets it, the others keep waiting
    await settle(lambda: sum(t.done() for t in waiting) == 1)
    engine.release(6)  # two more
    await settle(lambda: sum(t.done() for t in waiting) == 3)
    leased = [t.result()[1][0].group_id for t in waiting if t.done()]
    assert len(set(leased)) == 3
    await c.begin_drain()
    await settle(lambda: all(t.done() for t in waiting))
    refused = [t for t in waiting if t.exception() is not None]
    assert len(refused) == 1  # the one still waiting is told the service is going away
    assert isinstance(refused[0].exception(), Unavailable)


async def test_update_weights_requires_a_newer_version(running):
    c = running(GatedEngine())
    with pytest.raises(InvalidArgument, match="greater than"):
        await c.update_weights(0, "/w")


async def test_acking_frees_capacity_and_admission_resumes(running):
    engine = GatedEngine(auto=True)
    c = running(engine, buffer_capacity=1, max_in_flight=1, rewind_window=100)
    for step in range(1, 4):
        lease, _groups = await fetch(c, 1, 2000, "t")
        await c.ack(lease.lease_id, step)
    assert c.rooms.accounting.counters.acked_groups == 3
    assert c.status().buffer.acked == 3  # kept for a rewind, without blocking admission


async def test_without_checkpoints_the_pending_delta_holds_only_live_rows(running):
    engine = GatedEngine(auto=True)
    c = running(engine, buffer_capacity=4, max_in_flight=4, rewind_window=0)
    for step in range(1, 41):  # 40 groups generated, acked and finalized, never checkpointed
        lease, _ = await fetch(c, 1, 2000, "t")
        await c.ack(lease.lease_id, step)
    assert c.rooms.accounting.counters.finalized_groups >= 36
    async with c.barrier.exclusive():
        delta = c.capture().buffer
    live_rows = sum(len(g.samples) for g in c.rooms.buffer.groups.values())
    assert len(delta.new_rows) == live_rows  # not every sample ever generated
    assert delta.removed_rows == []  # nothing captured was ever removed
    assert set(delta.groups) == set(c.rooms.buffer.groups)  # finalized groups leave no trace


class TracingObserver(NullObserver):
    """Hands out one trace context per group and records what the controller reports."""

    def __init__(self) -> None:
        self.started: list[GenerationStarted] = []
        self.committed: list[GroupCommitted] = []
        self.abandoned: list[tuple[int, str]] = []

    def generation_started(self, event: GenerationStarted) -> Mapping[str, str]:
        self.started.append(event)
        return {"traceparent": f"trace-of-{event.group_id}"}

    def generation_abandoned(self, group_id: int, reason: str) -> None:
        self.abandoned.append((group_id, reason))

    def group_committed(self, event: GroupCommitted) -> None:
        self.committed.append(event)


async def test_every_sibling_carries_its_groups_trace_context_from_admission_to_commit():
    engine = GatedEngine(auto=True)
    observer = TracingObserver()
    c = Controller(
        ControllerConfig(group_size=3, max_in_flight=2, buffer_capacity=2),
        engine,
        Sampler(PROMPTS, seed=0),
        observer=observer,
    )
    c.start()
    try:
        await settle(lambda: len(observer.committed) == 2)
    finally:
        await c.stop()
    assert [e.group_id for e in observer.started] == [1, 2]  # once per group, not per sibling
    first = next(r for r in engine.requests if r.group_id == 1)
    assert observer.started[0].group_size == 3
    assert observer.started[0].prompt_id == first.prompt.prompt_id
    for r in engine.requests:
        assert r.trace_headers == {"traceparent": f"trace-of-{r.group_id}"}
    done = observer.committed[0]
    assert (done.group_size, done.prompt_tokens, done.tokens) == (3, 2, 3 * engine.tokens)
    assert observer.abandoned == []


async def test_an_evicted_group_ends_its_generation_as_abandoned():
    engine = GatedEngine()
    observer = TracingObserver()
    c = Controller(
        ControllerConfig(group_size=3, max_in_flight=2, max_staleness=0),
        engine,
        Sampler(PROMPTS, seed=0),
        observer=observer,
    )
    c.start()
    try:
        await settle(lambda: len(engine.requests) == 6)
        await c.update_weights(1, "/weights")
    finally:
        await c.stop()
    assert sorted(gid for gid, _ in observer.abandoned) == [1, 2]
    assert all("evicted" in why for _, why in observer.abandoned)


class _Drops(NullObserver):
    def __init__(self) -> None:
        self.drops: list[tuple[int, str]] = []

    def group_dropped(self, event) -> None:
        self.drops.append((event.group_id, event.reason))


async def test_a_group_whose_leases_keep_expiring_is_dropped_with_a_reason():
    """A group no trainer can take (it fails every fetch) must not cycle through lease, expiry
    and requeue for good: after ``max_lease_expiries`` it is dropped, counted by reason."""
    observer = _Drops()
    c = Controller(
        ControllerConfig(
            group_size=2,
            max_in_flight=1,
            buffer_capacity=1,
            reap_interval_s=0.02,
            lease_timeout_s=0.05,
            max_lease_expiries=3,
        ),
        GatedEngine(auto=True),
        Sampler(PROMPTS[:1], seed=0, epochs=1),
        observer=observer,
    )
    c.start()
    try:
        for _ in range(3):  # never acked: each lease expires and the group comes back
            assert await fetch(c, 1, 2000, "t") is not None
        await settle(lambda: c.rooms.accounting.counters.dropped_by_reason == {"lease_expiries": 1})
        assert await fetch(c, 1, 0, "t") is None
        assert [reason for _, reason in observer.drops] == ["lease_expiries"]
        assert (
            c.rooms.accounting.counters.expired_leases == 3
            and c.rooms.accounting.counters.requeued_groups == 2
        )
        assert not c.rooms.buffer.groups
    finally:
        await c.stop()


async def test_absurd_trainer_steps_are_refused_and_rewind_still_works(running):
    c = running(GatedEngine(auto=True), max_step_ahead=100, rewind_window=1000)
    lease, _ = await fetch(c, 1, 2000, "t")
    with pytest.raises(InvalidArgument, match="max_step_ahead=100"):
        await c.ack(lease.lease_id, 1_000_000_000)
    await c.ack(lease.lease_id, 100)  # the lease was not consumed by the refused ack
    lease, _ = await fetch(c, 1, 2000, "t")
    await c.ack(lease.lease_id, 200)  # 100 ahead of step 100
    with pytest.raises(InvalidArgument, match="trainer_step"):
        c.check_step(301)
    c.check_step(300)
    await c.rewind(2)  # not blocked by a step far ahead
