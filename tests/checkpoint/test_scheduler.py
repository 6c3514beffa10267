"""The periodic cadence: attempts start every ``interval_s``, however long each one takes.

A fake clock and sleep make the cadence exact: each attempt advances the clock by its duration,
and the scheduler's sleeps are recorded instead of waited for.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from rolloutd.checkpoint.checkpointer import Checkpointer
from rolloutd.checkpoint.scheduler import CheckpointScheduler
from rolloutd.domain.lifecycle import Lifecycle
from rolloutd.domain.report import CheckpointReport, Outcome, Reason, Trigger


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)


class TimedCheckpointer:
    """Attempts that take ``durations`` seconds of the fake clock, one after the other."""

    def __init__(self, clock: FakeClock, durations: list[float]) -> None:
        self.clock, self.durations = clock, list(durations)
        self.started: list[float] = []
        self.failing, self.consecutive_failures, self.shutting_down = False, 0, False
        self.done = asyncio.Event()

    async def checkpoint(self, trigger: Trigger, *_: Any) -> CheckpointReport:
        self.started.append(self.clock.now)
        self.clock.now += self.durations.pop(0)
        if not self.durations:
            self.done.set()
        return CheckpointReport(trigger, Outcome.COMPLETED, Reason.COMPLETED, 0, 0)


async def _periodic(interval_s: float, durations: list[float]) -> TimedCheckpointer:
    clock = FakeClock()
    fake = TimedCheckpointer(clock, durations)

    async def on_change(_: object) -> None:
        return None

    scheduler = CheckpointScheduler(
        cast(Checkpointer, fake),
        Lifecycle(on_change),
        interval_s,
        clock=clock,
        sleep=clock.sleep,
    )
    loop = asyncio.create_task(scheduler.run_periodic())
    try:
        await asyncio.wait_for(fake.done.wait(), 10)
    finally:
        loop.cancel()
    return fake


async def test_attempts_start_every_interval_whatever_they_take() -> None:
    fake = await _periodic(0.5, [0.3, 0.1, 0.45, 0.0])
    spacing = [b - a for a, b in zip(fake.started, fake.started[1:], strict=False)]
    assert fake.started[0] == pytest.approx(100.5)
    assert spacing == pytest.approx([0.5, 0.5, 0.5])


async def test_an_attempt_longer_than_the_interval_is_followed_at_once() -> None:
    fake = await _periodic(0.5, [0.8, 0.2, 0.0])
    spacing = [b - a for a, b in zip(fake.started, fake.started[1:], strict=False)]
    assert spacing == pytest.approx([0.8, 0.5])
