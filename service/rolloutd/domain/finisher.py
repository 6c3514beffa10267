"""Finishing: a FINISHING group handed to the finishing stage, then committed or dropped as the
stage decides (docs/design.md, "The pipeline").

The stage runs outside the barrier, so acks, fetches and checkpoints go on meanwhile; a stage
that raises drops its group (``stage_failed``). After a restore the stage runs again for exactly
the groups the snapshot holds as FINISHING.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from rolloutd.domain.accounting import Accounting
from rolloutd.domain.barrier import MutationBarrier
from rolloutd.domain.buffer import RolloutBuffer
from rolloutd.domain.drops import Drops
from rolloutd.domain.fate import DropReason
from rolloutd.domain.finishing import FinishingGroup, FinishingStage, Verdict
from rolloutd.domain.flight import Flight
from rolloutd.domain.group import Group, GroupScores, GroupState
from rolloutd.domain.liveness import Liveness
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.observer import GroupCommitted, GroupFinished, Observer
from rolloutd.domain.sampler import Sampler
from rolloutd.domain.wakeups import Wakeups

log = logging.getLogger(__name__)


class Finisher:
    """Runs the finishing stage and carries out its verdict; see the module docstring."""

    def __init__(
        self,
        stage: FinishingStage,
        buffer: RolloutBuffer,
        barrier: MutationBarrier,
        flight: Flight,
        accounting: Accounting,
        drops: Drops,
        sampler: Sampler,
        observer: Observer,
        wakeups: Wakeups,
        liveness: Liveness,
        clock: Callable[[], float],
    ) -> None:
        self._stage = stage
        self._buffer = buffer
        self._barrier = barrier
        self._flight = flight
        self._accounting = accounting
        self._drops = drops
        self._sampler = sampler
        self._observer = observer
        self._wakeups = wakeups
        self._liveness = liveness
        self._clock = clock

    def finish_later(self, group: Group) -> None:
        """Runs the finishing stage of a FINISHING group in a task of its own (after a
        restore)."""
        self._flight.enter(group.group_id)
        self._liveness.watched(
            asyncio.create_task(self.finish(group), name=f"rolloutd-finish-g{group.group_id}")
        )

    async def finish(self, group: Group) -> None:
        """Asks the finishing stage about a FINISHING group, outside the barrier, then commits
        or drops it as the stage decides. A stage that fails drops the group with the error."""
        task = asyncio.current_task()
        assert task is not None
        self._flight.finishing(group.group_id, task)  # type: ignore[arg-type]
        try:
            view = FinishingGroup(
                group.group_id,
                group.meta.prompt,
                group.meta.position,
                group.meta.policy_version,
                group.ordered_samples(),
                self._sampler.source_name(group.meta.position),
            )
            started = time.time_ns()
            try:
                verdict = await self._stage.finish(view)
            except Exception as exc:  # the stage is the operator's code: its failure is the group's
                log.exception("finishing stage failed on group %d", group.group_id)
                verdict = Verdict(DropReason.STAGE_FAILED, f"{type(exc).__name__}: {exc}")
        finally:
            self._flight.finished(group.group_id, task)  # type: ignore[arg-type]
        self._observer.group_finished(
            GroupFinished(
                group.group_id,
                started,
                time.time_ns(),
                verdict,
                sum(len(s.token_ids) for s in view.samples),
            )
        )
        if verdict.drop_reason is None:
            await self._commit(group, verdict.scores)
        else:
            await self._drops.drop(group.group_id, verdict.drop_reason, verdict.detail)

    async def _commit(self, group: Group, scores: GroupScores | None) -> None:
        gid = group.group_id
        async with self._barrier.mutation(MutationKind.COMMIT_GROUP):
            if self._buffer.groups.get(gid) is not group or group.state is not GroupState.FINISHING:
                return
            now = self._clock()
            # read before the commit: it may seal the rows, and reading them would decode them
            tokens = group.generated_tokens
            prompt_tokens = len(group.samples[0].prompt_token_ids)
            self._buffer.commit(gid, now, scores)
            self._flight.leave(gid)
            source = self._sampler.source_name(group.meta.position)
            self._accounting.committed(source, tokens)
        self._flight.committed(gid)
        self._observer.group_committed(
            GroupCommitted(
                gid,
                tokens,
                exact=True,
                completion_s=now - group.meta.admitted_at,
                prompt_tokens=prompt_tokens,
                group_size=group.meta.group_size,
                source=source,
            )
        )
        await self._wakeups.notify()
