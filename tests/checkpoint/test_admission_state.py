"""What admission learned (the adaptive in-flight limit, the trainers' pace) survives a restore
through a real snapshot store."""

from rolloutd.domain.concurrency import ConcurrencyConfig, EngineReading, InFlightReason
from rolloutd.domain.group import Prompt
from tests.checkpoint.helpers import Location, StoreNode
from tests.controllers import fetch
from tests.fakes import settle

ADAPTIVE = ConcurrencyConfig(ceiling=40, initial=4)


def node(location: Location, prompts: list[Prompt]) -> StoreNode:
    return StoreNode(
        location, prompts, max_in_flight=40, buffer_capacity=64, keep_latest=2,
        concurrency=ADAPTIVE,
    )  # fmt: skip


async def test_the_adaptive_limit_and_the_trainers_pace_come_back_after_a_restore(tmp_path):
    prompts = [Prompt(f"p{i}", f"question {i}") for i in range(20)]
    first = node(Location(str(tmp_path / "store")), prompts)
    c = first.controller
    limit = c.rooms.admitter.limit
    # the engine turned over twice with room to spare: 4 -> 8 -> 12 (0.6 at 8 groups: 0.9 at 12)
    for usage, departed in ((0.1, 0), (0.1, 4), (0.6, 4), (0.6, 12)):
        limit.observe(EngineReading(usage, 0, limit.value, departed))
    assert (limit.value, limit.reason) == (12, InFlightReason.GROWING)
    c.start()
    await settle(lambda: c.rooms.buffer.ready_count >= 3)
    lease, _ = await fetch(c, 3, 0, "t")
    await c.ack(lease.lease_id, 1)
    await c.update_weights(1, "/w")  # 3 groups consumed at version 0
    await first.checkpoint()
    await c.stop()

    second = node(first.location, prompts)
    assert second.controller.rooms.admitter.limit.value == ADAPTIVE.initial
    await second.restore()
    status = second.controller.admission_status()
    assert (status.in_flight_limit, status.in_flight_reason) == (12, InFlightReason.STARTING)
    assert status.consumed_per_version == 3
    assert second.controller.rooms.policy.gate.version == 1
