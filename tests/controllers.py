"""Conveniences for tests that drive a :class:`~rolloutd.domain.controller.Controller` in the same
process: what the service's adapters do through the façade, in the shape a test wants it."""

from __future__ import annotations

from rolloutd.domain.controller import Controller
from rolloutd.domain.encoder import AS_IS
from rolloutd.domain.group import Group, GroupState
from rolloutd.domain.journal import Lease


async def fetch(
    controller: Controller, max_groups: int, wait_ms: int, consumer: str
) -> tuple[Lease, list[Group]] | None:
    """Leases groups as they are (no encoding), as a trainer in the same process would."""
    return await controller.fetch_encoded(max_groups, wait_ms, consumer, AS_IS)


def generating_groups(controller: Controller) -> list[Group]:
    """Groups whose siblings are being generated."""
    return [g for g in controller.rooms.buffer.groups.values() if g.state is GroupState.GENERATING]
