"""The engine's time split by state while the controller runs (domain/fate.py)."""

from __future__ import annotations

import time

from rolloutd.domain.controller import Controller, ControllerConfig
from rolloutd.domain.fate import EngineState
from rolloutd.domain.group import Prompt
from rolloutd.domain.sampler import Sampler
from tests.controllers import fetch
from tests.fakes import GatedEngine, settle


def seconds(c: Controller, state: EngineState) -> float:
    return c.token_account().engine_seconds[state]


async def test_the_engine_time_is_split_by_state_and_adds_up_to_the_time_run():
    engine = GatedEngine()
    prompts = [Prompt(f"p{i}", f"question {i}") for i in range(3)]
    c = Controller(
        ControllerConfig(group_size=2, max_in_flight=2, buffer_capacity=2),
        engine,
        Sampler(prompts, seed=0, epochs=1),
    )
    before = time.monotonic()
    c.start()
    started = time.monotonic()
    await settle(lambda: len(engine.requests) == 4)  # two groups generate, held by the engine
    await settle(lambda: seconds(c, EngineState.GENERATING) > 0)
    assert seconds(c, EngineState.IDLE_BUFFER_FULL) == 0
    engine.release()
    # both groups ready: the buffer is full and the third prompt waits for room
    await settle(lambda: c.status().buffer.committed == 2)
    await settle(lambda: seconds(c, EngineState.IDLE_BUFFER_FULL) > 0)
    lease, _ = await fetch(c, 2, 1000, "trainer")
    await c.ack(lease.lease_id, 1)
    await c.finalize(1)  # room again: the last prompt is admitted, then nothing is left
    await settle(lambda: len(engine.requests) == 6)
    engine.release()
    await settle(lambda: c.status().buffer.committed == 1)
    await settle(lambda: seconds(c, EngineState.IDLE_NO_WORK) > 0)
    stopping = time.monotonic()
    await c.stop()
    after = time.monotonic()
    total = sum(c.token_account().engine_seconds.values())
    assert stopping - started <= total <= after - before
    assert seconds(c, EngineState.WEIGHT_UPDATE) == 0
