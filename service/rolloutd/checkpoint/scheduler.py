"""When checkpoints are attempted, and the readiness policy that follows their outcomes.

* Periodic attempts every ``checkpoint.interval_s``, measured from the start of one attempt to the
  start of the next, so the cadence is the configured one and not the interval plus the time an
  attempt takes (under load, 0.5 s plus attempts of 0.3 s had made it 0.8 s); an attempt longer
  than the interval is followed at once by the next. One that finds another attempt running is
  skipped (``in_progress``): the next tick comes soon enough.
* On-demand attempts (``Checkpoint`` RPC, ``POST /v1/checkpoints``) wait for a running attempt and
  then run their own, so a trainer's ``Checkpoint(trainer_step=S)`` always finalizes the acks up
  to S before it returns.
* The final attempt at shutdown follows the attempts in flight.

Every attempt runs as a task of its own that its caller's cancellation does not reach (an RPC past
its deadline, a client gone, shutdown stopping the periodic loop): cut short while a worker thread
writes and publishes its snapshot, it would leave the checkpointer a sequence number behind the
store, and every later attempt would fail.

Readiness: after ``max_consecutive_failures`` failed attempts in a row the service is not ready
(admission pauses); the next completed attempt makes it ready again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from rolloutd.checkpoint.checkpointer import Checkpointer
from rolloutd.domain.lifecycle import Lifecycle
from rolloutd.domain.report import CheckpointReport, Outcome, Trigger

log = logging.getLogger(__name__)

FAILING = "checkpoint"
"""The cause under which repeated checkpoint failures hold readiness off."""


class KeptForSnapshots(Protocol):
    """Files a snapshot refers to but does not hold (the staged weights it records): they must
    stay while it is written and, once it is published, until a later snapshot replaces it."""

    def snapshot_started(self) -> int: ...

    def snapshot_ended(self, token: int, *, published: bool) -> None: ...


class CheckpointScheduler:
    def __init__(
        self,
        checkpointer: Checkpointer,
        lifecycle: Lifecycle,
        interval_s: float,
        *,
        kept: KeptForSnapshots | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.checkpointer = checkpointer
        self.lifecycle = lifecycle
        self.interval_s = interval_s
        self._kept = kept
        self._clock, self._sleep = clock, sleep
        self._attempts: set[asyncio.Task[CheckpointReport]] = set()

    async def on_demand(self, tag: str = "", trainer_step: int | None = None) -> CheckpointReport:
        return await self._attempt(Trigger.ON_DEMAND, tag, trainer_step)

    async def run_periodic(self) -> None:
        """The periodic loop (a background task); runs until cancelled. An invariant violation
        ends it: the supervisor stops the service."""
        due = self._clock() + self.interval_s
        while True:
            await self._sleep(max(0.0, due - self._clock()))
            due = self._clock() + self.interval_s
            await self._attempt(Trigger.PERIODIC)

    async def final(self) -> CheckpointReport:
        """The shutdown checkpoint, after the attempts in flight; later attempts are skipped."""
        if self._attempts:
            await asyncio.wait(self._attempts)
        self.checkpointer.shutting_down = True
        report = await self._keeping(lambda: self.checkpointer.checkpoint(Trigger.SHUTDOWN))
        if report.outcome is Outcome.FAILED:
            log.error(
                "final checkpoint failed: %s; restart restores snapshot %d",
                report.error,
                self.checkpointer.sequence,
            )
        return report

    async def _attempt(
        self, trigger: Trigger, tag: str = "", trainer_step: int | None = None
    ) -> CheckpointReport:
        async def attempt() -> CheckpointReport:
            report = await self._keeping(
                lambda: self.checkpointer.checkpoint(trigger, tag, trainer_step)
            )
            await self._follow_health()
            return report

        task = asyncio.create_task(attempt(), name=f"rolloutd-checkpoint-{trigger.value}")
        self._attempts.add(task)
        task.add_done_callback(self._attempts.discard)
        return await asyncio.shield(task)

    async def _keeping(
        self, checkpoint: Callable[[], Awaitable[CheckpointReport]]
    ) -> CheckpointReport:
        """One attempt, with what its snapshot refers to kept as long as it may be restored."""
        if self._kept is None:
            return await checkpoint()
        token = self._kept.snapshot_started()
        published = False
        try:
            report = await checkpoint()
            published = report.outcome is Outcome.COMPLETED
        finally:
            self._kept.snapshot_ended(token, published=published)
        return report

    async def _follow_health(self) -> None:
        c = self.checkpointer
        if c.failing and not self.lifecycle.blocked(FAILING):
            log.error(
                "%d checkpoint failures in a row: not ready, admission paused",
                c.consecutive_failures,
            )
            await self.lifecycle.block(
                FAILING, f"{c.consecutive_failures} checkpoint failures in a row"
            )
        elif not c.failing and self.lifecycle.blocked(FAILING):
            await self.lifecycle.unblock(FAILING)
