"""Admission: which prompt becomes a group next, and when (docs/design.md, "Admission").

One background loop admits a prompt whenever there is room: admission is on, the groups in
flight are under their limit (fixed, or following the engine's KV cache: ``concurrency.py``), the
buffer holds fewer than ``limits.buffer_capacity`` groups a trainer has not acked, the staleness
gate expects the group to be consumed in time (``staleness.py``), and the sampler has a prompt. A
group's settings are resolved once, here (``spec.py``), and its id is issued from a block the
journal reserved. A second loop feeds the adaptive in-flight limit a reading of the engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from rolloutd.domain.accounting import Accounting
from rolloutd.domain.barrier import MutationBarrier
from rolloutd.domain.buffer import RolloutBuffer
from rolloutd.domain.concurrency import (
    ConcurrencyConfig,
    ConcurrencyState,
    EngineReading,
    InFlightLimit,
)
from rolloutd.domain.engine import GenerationEngine, SamplingParams
from rolloutd.domain.flight import Flight
from rolloutd.domain.generation import Generation
from rolloutd.domain.group import Group, GroupMeta
from rolloutd.domain.ids import GroupIds
from rolloutd.domain.liveness import Liveness
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.policy import Policy
from rolloutd.domain.sampler import Admission, Sampler
from rolloutd.domain.spec import EMPTY, resolve
from rolloutd.domain.wakeups import Wakeups

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdmissionConfig:
    group_size: int
    max_in_flight: int
    buffer_capacity: int
    staleness_gating: bool
    seed: int
    sampling: SamplingParams
    concurrency: ConcurrencyConfig | None = None


class Admitter:
    """The admission loop and the in-flight limit; see the module docstring."""

    def __init__(
        self,
        config: AdmissionConfig,
        engine: GenerationEngine,
        buffer: RolloutBuffer,
        barrier: MutationBarrier,
        sampler: Sampler,
        ids: GroupIds,
        policy: Policy,
        flight: Flight,
        generation: Generation,
        accounting: Accounting,
        liveness: Liveness,
        wakeups: Wakeups,
        clock: Callable[[], float],
    ) -> None:
        self._config = config
        self._engine = engine
        self._buffer = buffer
        self._barrier = barrier
        self._sampler = sampler
        self._ids = ids
        self._policy = policy
        self._flight = flight
        self._generation = generation
        self._accounting = accounting
        self._liveness = liveness
        self._wakeups = wakeups
        self._clock = clock
        self._limit = InFlightLimit(config.max_in_flight, config.concurrency)
        """How many groups may be in flight: fixed, or following the engine."""

    @property
    def limit(self) -> InFlightLimit:
        """The in-flight limit (read its value and reason; it changes only by its readings)."""
        return self._limit

    def can_admit(self) -> bool:
        return (
            self._liveness.admitting
            and self._flight.groups < self._limit.value
            and self._buffer.held < self._config.buffer_capacity
            and (not self._config.staleness_gating or self.staleness_room() > 0)
            and self._sampler.has_next()
        )

    def staleness_room(self) -> int:
        """Groups the staleness gate would still admit, behind those generating, finishing or
        ready (staleness.py)."""
        return self._policy.gate.room(self._flight.groups + self._buffer.ready_count)

    async def concurrency_loop(self) -> None:
        """Feeds the adaptive in-flight limit a reading of the engine every ``interval_s``
        (concurrency.py); wakes admission when the limit changes."""
        assert self._config.concurrency is not None
        interval = self._config.concurrency.interval_s
        while True:
            engine = self._engine.counters()
            reading = EngineReading(
                engine.kv_cache_usage,
                engine.preemptions,
                self._flight.groups,
                self._flight.departed,
            )
            if self._limit.observe(reading):
                log.debug(
                    "groups in flight: at most %d (%s)", self._limit.value, self._limit.reason
                )
                await self._wakeups.notify()
            await asyncio.sleep(interval)

    async def admission_loop(self) -> None:
        changed = self._wakeups.changed
        while True:
            async with changed:
                await changed.wait_for(self.can_admit)
            if not self._ids.reserved:
                try:
                    await self._ids.reserve()
                except OSError as exc:
                    log.error("cannot reserve group ids in the journal: %s; retrying", exc)
                    await asyncio.sleep(1.0)
                    continue
            async with self._barrier.mutation(MutationKind.ADMIT):
                if not self.can_admit() or not self._ids.reserved:
                    continue
                admission = self._sampler.next()
                if admission is None:
                    continue
                group = self._new_group(admission)
                self._buffer.add(group)
                self._accounting.admitted()
            self._generation.dispatch(group, group.missing, fresh=True)

    def _new_group(self, admission: Admission) -> Group:
        cfg = self._config
        gid = self._ids.issue()
        position = admission.position
        source = EMPTY if position is None else self._sampler.sources[position.source].generation
        spec = resolve(admission.prompt.generation.over(source), cfg.sampling, cfg.group_size)
        return Group(
            GroupMeta(
                group_id=gid,
                prompt=admission.prompt,
                position=position,
                group_size=spec.group_size,
                policy_version=self._policy.version,
                admitted_at=self._clock(),
                seed=(cfg.seed * 7_919 + gid * 104_729) % (2**31 - 1)
                if spec.seed is None
                else spec.seed,
                params=spec.params,
            )
        )

    def capture(self) -> ConcurrencyState:
        return self._limit.state()

    def restore(self, state: ConcurrencyState) -> None:
        self._limit.restore(state)
