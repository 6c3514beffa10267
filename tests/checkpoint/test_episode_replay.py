"""Episode groups admitted after the newest snapshot (or with no snapshot at all) come back
from the journal under their own ids, so that their durable turns and steps are reused and
their prompts are not admitted again. The stopped controller stands for a process killed at
that instant."""

from __future__ import annotations

import asyncio

import pytest

from rolloutd.domain.episode import EpisodeLimits, EpisodeStart, StepResult
from rolloutd.domain.episode_runner import EpisodeRunner
from rolloutd.domain.group import GroupState
from rolloutd.domain.observer import EpisodeTurn, NullObserver
from rolloutd.domain.report import Disposition
from rolloutd.engines.synthetic import SyntheticConfig, SyntheticEngine
from tests.checkpoint.test_checkpointer import nodes  # noqa: F401  (the fixture)
from tests.controllers import fetch
from tests.fakes import settle

FAST = SyntheticConfig(tokens_per_s=0, min_tokens=4)


class GatedEnv:
    """Three turns; the tool answers with the completion's length. With ``hold_at`` a live step
    of that turn waits forever (the process dies there). Records every step call."""

    name = "gated"
    has_state = False

    def __init__(self, hold_at: int | None = None) -> None:
        self.hold_at = hold_at
        self.calls: list[tuple[str, int, str, bool]] = []

    async def reset(self, start: EpisodeStart):  # type: ignore[no-untyped-def]
        return ({"role": "system", "content": f"episode {start.episode_id}"},)

    async def step(self, episode_id: str, turn: int, completion: str, *, replay: bool = False):  # type: ignore[no-untyped-def]
        self.calls.append((episode_id, turn, completion, replay))
        if turn == self.hold_at and not replay:
            await asyncio.Event().wait()
        return StepResult(({"role": "tool", "content": f"len {len(completion)}"},), turn >= 2)

    async def state(self, episode_id: str) -> bytes:
        raise AssertionError("no state")

    async def restore(self, start: EpisodeStart, state: bytes) -> None:
        raise AssertionError("no state")

    async def close(self) -> None:
        return None


class TurnsSeen(NullObserver):
    """Records the episode turns the runner reports."""

    def __init__(self) -> None:
        self.turns: list[EpisodeTurn] = []

    def episode_turn(self, event: EpisodeTurn) -> None:
        self.turns.append(event)


def episode_node(nodes, env, observer=None):  # type: ignore[no-untyped-def]  # noqa: F811
    runner = EpisodeRunner({}, env, EpisodeLimits(max_turns=5))
    node = nodes(
        engine=SyntheticEngine(FAST),
        runner=runner,
        max_in_flight=2,
        buffer_capacity=2,
        observer=observer,
    )
    return node, runner


@pytest.mark.parametrize("snapshot", [True, False], ids=["after-a-snapshot", "no-snapshot"])
async def test_an_episode_group_no_snapshot_held_comes_back_with_its_durable_turns(
    nodes,  # noqa: F811
    snapshot: bool,
):
    first = GatedEnv(hold_at=1)
    a, _ = episode_node(nodes, first)
    if snapshot:
        await a.checkpoint()  # before any admission: it holds none of the groups
    a.controller.start()
    # every episode's turn 1 is durable and its step running (turn 0 and step 0 durable)
    await settle(lambda: sum(1 for c in first.calls if c[1] == 1) == 4)
    admitted = {gid: g.meta.prompt.prompt_id for gid, g in a.controller.rooms.buffer.groups.items()}
    assert len(admitted) == 2
    await a.controller.stop()

    second = GatedEnv()
    seen = TurnsSeen()
    b, _ = episode_node(nodes, second, seen)
    await b.restore()
    b.controller.start()
    groups = b.controller.rooms.buffer.groups
    await settle(
        lambda: all(gid in groups and groups[gid].state is GroupState.COMMITTED for gid in admitted)
    )
    # the same groups under the same ids; no durable turn generated, no durable step called live
    assert {gid: g.meta.prompt.prompt_id for gid, g in groups.items()} == admitted
    assert sum(1 for t in seen.turns if t.recovered is Disposition.REUSED) == 8
    live = [(e, t, c) for e, t, c, replay in second.calls if not replay]
    assert sorted((e, t) for e, t, _ in live) == sorted(
        (f"g{gid}-s{i}", t) for gid in admitted for i in range(2) for t in (1, 2)
    )
    before = {(e, t): c for e, t, c, _ in first.calls}
    assert all(before[(e, t)] == c for e, t, c in live if t == 1)  # the same completion again
    assert {t for _, t, _, replay in second.calls if replay} == {0}
    # a snapshot that holds them while the sampler's cursor is not past them restores
    await b.checkpoint()
    # the prompts are not admitted again: what comes after them is the dataset's next prompts
    lease, delivered = await fetch(b.controller, 2, 2000, "t")
    assert {g.group_id for g in delivered} == set(admitted)
    await b.controller.ack(lease.lease_id, 1)
    await settle(lambda: len(groups) == 4)
    later = {g.meta.prompt.prompt_id for gid, g in groups.items() if gid not in admitted}
    assert len(later) == 2 and not later & set(admitted.values())
    await b.controller.stop()
    c, _ = episode_node(nodes, GatedEnv())
    await c.restore()
    assert {c.controller.rooms.buffer.groups[gid].state for gid in admitted} == {GroupState.ACKED}
