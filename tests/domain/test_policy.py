"""The policy room on its own: the served version and weights, weight updates, the staleness
bound, eviction of what fell behind, and its part of a snapshot."""

from __future__ import annotations

import asyncio

import pytest

from rolloutd.domain.engine import EngineDeadError, EngineError
from rolloutd.domain.errors import InvalidArgument, Unavailable
from rolloutd.domain.group import GroupState, Position
from rolloutd.domain.policy import PolicyConfig, PolicyState
from rolloutd.domain.staleness import GateState
from tests.domain.fakes import Shared
from tests.fakes import GatedEngine
from tests.waiting import eventually


class LoadingEngine(GatedEngine):
    """Loads weights when the test lets it, or fails as told."""

    def __init__(self) -> None:
        super().__init__()
        self.loading = asyncio.Event()
        self.loaded = asyncio.Event()
        self.fail: BaseException | None = None
        self.loads: list[tuple[str, int]] = []

    async def update_weights(self, path, version, *, timeline=None, only=None):  # type: ignore[no-untyped-def]
        self.loading.set()
        await self.loaded.wait()
        if self.fail is not None:
            raise self.fail
        self.loads.append((path, version))
        await super().update_weights(path, version)


def loaded(engine: LoadingEngine, fail: BaseException | None = None) -> LoadingEngine:
    engine.fail = fail
    engine.loaded.set()
    return engine


async def test_a_group_is_too_stale_once_more_than_max_staleness_versions_behind_the_served_one():
    shared = Shared()
    policy = shared.policy(PolicyConfig(max_staleness=2))
    await policy.update_weights(5, "/w/5")
    assert [v for v in range(7) if policy.too_stale(v)] == [0, 1, 2]
    assert policy.lag(3) == 2


async def test_a_weight_update_moves_the_served_version_and_weights():
    shared = Shared()
    policy = shared.policy()
    assert await policy.update_weights(3, "/w/3") == 0
    assert (policy.version, policy.weights_path) == (3, "/w/3")
    assert shared.engine.policy_version == 3
    assert policy.gate.version == 3


@pytest.mark.parametrize(
    ("version", "path", "field"), [(2, "/w", "version"), (4, "", "weights_path")]
)
async def test_a_weight_update_back_in_version_or_without_weights_is_refused(version, path, field):
    shared = Shared()
    policy = shared.policy()
    await policy.update_weights(2, "/w/2")
    with pytest.raises(InvalidArgument) as refused:
        await policy.update_weights(version, path)
    assert refused.value.field == field
    assert (policy.version, policy.weights_path) == (2, "/w/2")


async def test_a_weight_update_is_refused_once_the_service_drains():
    shared = Shared()
    policy = shared.policy()
    shared.liveness.drain()
    with pytest.raises(Unavailable):
        await policy.update_weights(1, "/w/1")
    assert policy.version == 0


def test_a_version_asked_for_too_far_ahead_is_refused():
    shared = Shared()
    policy = shared.policy(PolicyConfig(max_version_step=10))
    policy.check_version(10)
    with pytest.raises(InvalidArgument, match="max_version_step=10"):
        policy.check_version(11)


async def test_the_policy_is_updating_exactly_while_the_engine_loads():
    shared = Shared(engine=LoadingEngine())
    policy = shared.policy()
    update = asyncio.create_task(policy.update_weights(1, "/w/1"))
    await shared.engine.loading.wait()
    assert policy.updating and policy.version == 0
    loaded(shared.engine)
    await update
    assert not policy.updating and policy.version == 1


async def test_weights_the_engine_refuses_leave_the_served_version_as_it_was():
    shared = Shared(engine=loaded(LoadingEngine(), EngineError("no such file")))
    policy = shared.policy()
    with pytest.raises(InvalidArgument, match="no such file") as refused:
        await policy.update_weights(1, "/missing")
    assert refused.value.field == "weights_path"
    assert (policy.version, policy.weights_path) == (0, None)
    assert not policy.updating and shared.liveness.fatal is None


async def test_an_engine_that_dies_loading_weights_ends_the_controller():
    dead = EngineDeadError("worker gone")
    shared = Shared(engine=loaded(LoadingEngine(), dead))
    policy = shared.policy()
    with pytest.raises(Unavailable):
        await policy.update_weights(1, "/w/1")
    assert shared.liveness.fatal is dead
    assert policy.version == 0


async def test_a_weight_update_evicts_the_stale_groups_that_are_not_the_trainers():
    shared = Shared()
    policy = shared.policy(PolicyConfig(max_staleness=1))
    shared.generating(1, version=0, position=Position(0, 1))
    shared.finishing(2, version=0, position=Position(0, 2))
    shared.committed(3, version=0, position=Position(0, 3))
    shared.committed(4, version=0, position=Position(0, 4))
    shared.buffer.lease("L", 1)  # group 3 is the trainer's
    shared.committed(5, version=1, position=Position(0, 5))
    shared.flight.enter(1)

    assert await policy.update_weights(2, "/w/2") == 3
    assert sorted(shared.buffer.groups) == [3, 5]
    assert shared.buffer.groups[3].state is GroupState.LEASED
    assert shared.accounting.counters.evicted_groups == 3
    assert shared.observer.evicted == [3]
    assert shared.flight.groups == 0
    # an evicted group's prompt is admitted again
    readmitted = [shared.sampler.next() for _ in range(3)]
    assert sorted(a.position.offset for a in readmitted) == [1, 2, 4]


async def test_a_trainers_group_committed_again_is_evicted_when_stale_and_kept_otherwise():
    shared = Shared()
    policy = shared.policy(PolicyConfig(max_staleness=1))
    shared.committed(1, version=0)
    shared.committed(2, version=1)
    shared.buffer.lease("L", 2)
    await policy.update_weights(2, "/w/2")
    assert sorted(shared.buffer.groups) == [1, 2]  # both leased: not evicted at the update
    shared.buffer.requeue([1, 2])
    assert policy.evict_returned([1, 2]) == 1
    assert list(shared.buffer.groups) == [2]
    assert shared.buffer.groups[2].state is GroupState.COMMITTED


async def test_eviction_aborts_a_stale_groups_running_siblings():
    shared = Shared()
    policy = shared.policy(PolicyConfig(max_staleness=0))
    shared.generating(1, version=0)
    sibling = asyncio.create_task(asyncio.Event().wait())
    shared.flight.sibling((1, 0), sibling, None)  # type: ignore[arg-type]
    await policy.update_weights(1, "/w/1")
    assert shared.engine.aborted == ["g1-s0"]
    await eventually("the sibling's task is cancelled", sibling.cancelled)


async def test_capture_then_restore_gives_the_served_version_weights_and_pace():
    shared = Shared()
    policy = shared.policy()
    await policy.update_weights(1, "/w/1")
    policy.gate.leased(12)
    await policy.update_weights(3, "/w/3")
    state = policy.capture()
    assert state == PolicyState(3, "/w/3", GateState(6.0))

    fresh = Shared(engine=loaded(LoadingEngine()))
    restored = fresh.policy()
    await restored.restore(state)
    assert (restored.version, restored.weights_path) == (3, "/w/3")
    assert restored.gate.state() == GateState(6.0) and restored.gate.version == 3
    assert fresh.engine.loads == [("/w/3", 3)]  # the engine served older weights
    assert restored.capture() == state


async def test_a_restore_leaves_an_engine_already_serving_the_version_alone():
    fresh = Shared(engine=loaded(LoadingEngine()))
    await fresh.engine.update_weights("/w/3", 3)
    fresh.engine.loads.clear()
    policy = fresh.policy()
    await policy.restore(PolicyState(3, "/w/3"))
    assert fresh.engine.loads == []
    assert policy.version == 3
