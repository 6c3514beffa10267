"""The staleness gate: how many groups may still be admitted, from the trainers' pace."""

import pytest

from rolloutd.domain.controller import Controller, ControllerConfig
from rolloutd.domain.fate import TokenFate
from rolloutd.domain.group import Prompt
from rolloutd.domain.sampler import Sampler
from rolloutd.domain.staleness import GateState, StalenessGate
from tests.controllers import fetch
from tests.fakes import GatedEngine, settle


def test_before_any_version_change_the_window_is_the_prior():
    gate = StalenessGate(max_staleness=1, prior_per_version=8)
    assert gate.room(outstanding=0) == 16
    assert gate.room(outstanding=10) == 6
    assert gate.room(outstanding=20) == 0  # never negative


def test_what_was_consumed_in_the_first_version_replaces_the_prior():
    gate = StalenessGate(max_staleness=2, prior_per_version=16)
    gate.leased(4)
    gate.version_changed(1)
    assert gate.per_version == 4
    # 4 at this version and 4 at each of the 2 next: 12 groups, behind the 5 outstanding
    assert gate.room(outstanding=5) == 7


def test_the_current_versions_consumption_so_far_counts_against_the_window():
    gate = StalenessGate(max_staleness=1, prior_per_version=1)
    gate.leased(6)
    gate.version_changed(1)
    gate.leased(4)
    assert gate.room(outstanding=0) == 8  # 2 more at version 1, then 6 at version 2
    gate.leased(4)  # more than the pace: the rest of this version is 0, not negative
    assert gate.room(outstanding=0) == 6


def test_the_pace_is_smoothed_over_versions_and_an_update_that_skips_versions_divides_it():
    gate = StalenessGate(max_staleness=0, prior_per_version=1, smoothing=0.5)
    gate.leased(8)
    gate.version_changed(1)
    gate.leased(4)
    gate.version_changed(2)
    assert gate.per_version == 6
    gate.leased(12)
    gate.version_changed(5)  # 12 groups over three versions: 4 a version
    assert gate.per_version == 5


def test_versions_before_any_group_reached_a_trainer_teach_nothing():
    gate = StalenessGate(max_staleness=1, prior_per_version=8)
    gate.version_changed(1)  # a trainer loads its first weights before it fetches
    assert gate.per_version is None
    assert gate.room(outstanding=0) == 16


def test_a_trainer_that_never_changes_the_version_is_not_held_by_the_prior():
    gate = StalenessGate(max_staleness=1, prior_per_version=2)
    gate.leased(50)
    assert gate.room(outstanding=10) == 40  # 50 a version so far: 50 more in the next one


def test_a_waiting_fetch_makes_room_for_up_to_one_versions_consumption():
    gate = StalenessGate(max_staleness=0, prior_per_version=1)
    gate.leased(3)
    gate.version_changed(1)
    gate.leased(3)
    assert gate.room(outstanding=0) == 0  # the pace says version 1 is done
    gate.wait_started(1000)  # ...but a trainer asks for more: up to one version's worth
    assert gate.room(outstanding=0) == 3
    gate.wait_started(1)
    assert gate.room(outstanding=1) == 3
    gate.wait_ended(1000)
    gate.wait_ended(1)
    assert gate.room(outstanding=0) == 0


def test_after_versions_with_nothing_consumed_a_trainer_still_gets_a_group():
    gate = StalenessGate(max_staleness=0, prior_per_version=1, smoothing=1.0)
    gate.leased(4)
    gate.version_changed(1)
    gate.version_changed(2)  # trained on something else: consumed nothing
    assert gate.per_version == 0
    assert gate.room(outstanding=0) == 1


def test_the_estimate_survives_through_its_state():
    gate = StalenessGate(max_staleness=1, prior_per_version=9)
    gate.leased(5)
    gate.version_changed(1)
    restored = StalenessGate(max_staleness=1, prior_per_version=9)
    restored.restore(gate.state(), version=1)
    assert restored.state() == GateState(5.0)
    assert restored.room(outstanding=0) == gate.room(outstanding=0) == 10


def test_smoothing_must_be_a_fraction():
    with pytest.raises(ValueError, match="smoothing"):
        StalenessGate(max_staleness=1, prior_per_version=1, smoothing=0)


# --- the gate in the controller -------------------------------------------------------------

PROMPTS = [Prompt(f"p{i}", f"question {i}") for i in range(200)]


def controller(engine, **kw):
    cfg = ControllerConfig(
        **{"group_size": 2, "max_in_flight": 4, "buffer_capacity": 64, "max_staleness": 1, **kw}
    )
    return Controller(cfg, engine, Sampler(PROMPTS, seed=0))


async def test_admission_stops_at_what_the_trainer_can_consume_in_time():
    engine = GatedEngine(auto=True)
    c = controller(engine)
    c.start()

    async def step(version: int) -> None:
        lease, groups = await fetch(c, 2, 1000, "t")
        assert all(version - 1 - g.policy_version <= 1 for g in groups)  # within max_staleness
        await c.ack(lease.lease_id, version)
        await c.update_weights(version, "/w")

    try:
        # before any version change the pace is taken to be max_in_flight: 4 x 2 versions
        await settle(lambda: c.status().buffer.committed == 8)
        # nothing generating, so nothing more is admitted until a fetch or a version change
        assert not c.rooms.admitter.can_admit()
        assert c.rooms.accounting.counters.admitted_groups == 8
        # the trainer takes 2 a version: what it cannot take of the first 8 in time is evicted,
        # once (8 - 2 x 2); from then on the window is 2 x (max_staleness + 1) = 4 groups
        await step(1)
        assert c.admission_status().consumed_per_version == 2
        await step(2)
        assert c.rooms.accounting.counters.evicted_groups == 4
        for version in range(3, 8):
            await settle(lambda: c.status().buffer.committed == 4)
            assert not c.rooms.admitter.can_admit()
            assert c.admission_status().staleness_room == 0
            await step(version)
        assert c.rooms.accounting.counters.evicted_groups == 4
    finally:
        await c.stop()


async def test_without_gating_admission_fills_the_buffer_and_eviction_throws_it_away():
    engine = GatedEngine(auto=True, tokens=5)
    c = controller(engine, staleness_gating=False, buffer_capacity=20)
    c.start()
    try:
        await settle(lambda: c.status().buffer.committed == 20)
        await c.update_weights(1, "/w")
        await c.update_weights(2, "/w")
        assert c.rooms.accounting.counters.evicted_groups == 20
        assert (
            c.rooms.accounting.counters.evicted_tokens == 20 * 2 * 5
        )  # groups x siblings x tokens
    finally:
        await c.stop()


async def test_evicting_a_generating_group_counts_the_tokens_its_siblings_streamed():
    engine = GatedEngine(tokens=10, early=4)  # 4 tokens streamed, then it waits
    c = controller(engine, max_in_flight=1, max_staleness=0)
    c.start()
    try:
        await settle(lambda: len(engine.requests) == 2)
        group = c.rooms.buffer.groups[engine.requests[0].group_id]
        engine.release(1)  # one sibling staged whole (10), the other streamed 4 so far
        await settle(lambda: len(group.samples) == 1)
        await c.update_weights(1, "/w")
        assert c.rooms.accounting.counters.evicted_groups == 1
        # the evicted fate of the token account, which still adds up with the gate on
        account = c.token_account()
        assert account.fates[TokenFate.EVICTED] == 10 + 4
        assert sum(account.fates.values()) == account.generated
    finally:
        await c.stop()
