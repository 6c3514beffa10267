"""Generation: a group's siblings dispatched to the sibling runner, each its own task.

Each sibling is its own engine request with its own seed, run through the :class:`SiblingRunner`,
so siblings finish independently and a restart reuses each finished one. A sibling streams its
tokens into the accounting's staging (captured by checkpoints, continued from after a restart);
a recoverable engine error is retried from the sibling's prefix, and one that outlasts the
retries (or a request the engine refuses) drops the group. The mutation that stages a group's
last sibling moves the group to FINISHING, and the finishing room takes it from there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from rolloutd.domain.accounting import Accounting
from rolloutd.domain.barrier import MutationBarrier
from rolloutd.domain.buffer import RolloutBuffer
from rolloutd.domain.drops import Drops
from rolloutd.domain.engine import (
    EngineDeadError,
    EngineError,
    GenerationEngine,
    GenerationRequest,
    RequestRefused,
    SamplingParams,
)
from rolloutd.domain.episode_log import EpisodeLog, EpisodeRecord, GroupAdmission
from rolloutd.domain.fate import DropReason
from rolloutd.domain.finisher import Finisher
from rolloutd.domain.flight import Flight
from rolloutd.domain.group import Group
from rolloutd.domain.ids import request_id
from rolloutd.domain.journal import DeliveryJournal
from rolloutd.domain.liveness import Liveness
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.observer import GenerationStarted, Observer
from rolloutd.domain.partial import PartialSibling
from rolloutd.domain.runner import SiblingJob, SiblingRunner
from rolloutd.domain.sampler import Sampler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationConfig:
    sampling: SamplingParams
    """The service's sampling settings: a group's unless it has its own."""
    sibling_retries: int = 2
    capture_partials: bool = True
    durable_turns: bool = True
    """Whether episode records are journaled (``episodes.durable_turns``)."""


class Generation:
    """Dispatches and runs siblings; see the module docstring."""

    def __init__(
        self,
        config: GenerationConfig,
        engine: GenerationEngine,
        runner: SiblingRunner,
        buffer: RolloutBuffer,
        barrier: MutationBarrier,
        flight: Flight,
        accounting: Accounting,
        drops: Drops,
        finisher: Finisher,
        sampler: Sampler,
        journal: DeliveryJournal,
        observer: Observer,
        liveness: Liveness,
    ) -> None:
        self._config = config
        self._engine = engine
        self._runner = runner
        self._buffer = buffer
        self._barrier = barrier
        self._flight = flight
        self._accounting = accounting
        self._drops = drops
        self._finisher = finisher
        self._sampler = sampler
        self._journal = journal
        self._observer = observer
        self._liveness = liveness

    def params_of(self, group: Group) -> SamplingParams:
        """The sampling settings a group's siblings are generated with."""
        params = group.meta.params
        return self._config.sampling if params is None else params

    def dispatch(
        self,
        group: Group,
        indices: list[int],
        prefixes: Mapping[int, PartialSibling] | None = None,
        episodes: Mapping[int, list[EpisodeRecord]] | None = None,
        *,
        fresh: bool = False,
    ) -> None:
        """Starts the runner on each sibling of ``indices``, each with its own seed; a sibling
        with a prefix in ``prefixes`` continues from it, one with records in ``episodes``
        continues its episode from them. A ``fresh`` group (just admitted, held by no snapshot
        or journal record yet) has its admission journaled with its first episode record."""
        cfg = self._config
        meta = group.meta
        admission = GroupAdmission(meta) if fresh else None
        p = self.params_of(group)
        group.trace = self._flight.traced(
            group.group_id,
            GenerationStarted(
                group.group_id,
                meta.prompt.prompt_id,
                meta.group_size,
                meta.admitted_at,
                p.max_tokens,
                p.temperature,
                p.top_p,
                p.top_k,
                meta.seed,
                self._sampler.source_name(meta.position),
            ),
        )
        self._flight.enter(group.group_id)
        for index in indices:
            key = (group.group_id, index)
            prefix = (prefixes or {}).get(index)
            episode = (prefix is not None and prefix.turn is not None) or index in (episodes or {})
            if (cfg.capture_partials or prefix is not None) and not episode:
                # Staged now, not when the task first runs, so that a checkpoint taken meanwhile
                # still holds a restored prefix (and its tokens stay buffered).
                self._accounting.stage(key, prefix.deltas if prefix else ())
            log_ = EpisodeLog(
                group.group_id,
                index,
                self._journal if cfg.durable_turns else None,
                list((episodes or {}).get(index, ())),
                cfg.capture_partials,
                admission=admission,
            )
            if prefix is not None and prefix.turn is not None:
                log_.begin_turn(prefix.turn, prefix.deltas)
            task = asyncio.create_task(
                self._run_sibling(group, index, prefix),
                name=f"rolloutd-{request_id(group.group_id, index)}",
            )
            self._flight.sibling(key, self._liveness.watched(task), log_)
        self._accounting.clock_engine()

    async def _run_sibling(
        self, group: Group, index: int, prefix: PartialSibling | None = None
    ) -> None:
        cfg = self._config
        gid = group.group_id
        request = GenerationRequest(
            request_id=request_id(gid, index),
            group_id=gid,
            index=index,
            prompt=group.meta.prompt,
            seed=group.meta.sibling_seed(index),
            params=self.params_of(group),
            trace_headers=self._flight.trace(gid),
            prefix=prefix,
        )
        key = (gid, index)
        source = self._sampler.source_name(group.meta.position)
        for attempt in range(cfg.sibling_retries + 1):
            on_delta = None
            if cfg.capture_partials and self._accounting.staging(key):
                if attempt:  # a retry starts again from the prefix: a failed attempt's tokens go
                    self._accounting.restart(key, prefix)
                on_delta = self._accounting.sink(key)
            try:
                sample = await self._runner.run(
                    SiblingJob(
                        self._engine,
                        request,
                        on_delta,
                        source,
                        self._flight.episode(key),
                        self._observer,
                    )
                )
                break
            except RequestRefused as exc:
                await self._drops.drop(gid, DropReason.REFUSED, str(exc), error=True)
                return
            except EngineError as exc:
                log.warning(
                    "sibling %s failed (attempt %d): %s", request.request_id, attempt + 1, exc
                )
                if attempt == cfg.sibling_retries:
                    await self._drops.drop(gid, DropReason.ENGINE_ERROR, str(exc), error=True)
                    return
                await asyncio.sleep(0.1 * 2**attempt)
            except EngineDeadError as exc:
                self._liveness.die(exc)
                return
        async with self._barrier.mutation(MutationKind.STAGE_SAMPLE):
            if self._buffer.groups.get(gid) is not group:
                return  # evicted while generating
            self._buffer.stage(gid, sample)
            self._flight.sibling_done(key)
            self._accounting.staged(key, sample)
            last = group.complete  # exactly one sibling's task stages the last one
            if last:
                self._buffer.finish(gid)
        self._accounting.clock_engine()
        if last:
            await self._finisher.finish(group)
