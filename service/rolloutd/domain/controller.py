"""The controller: a small façade over the rooms that do its jobs (docs/design.md, "The controller").

* :mod:`~rolloutd.domain.core` — what every room shares: buffer, barrier, sampler, counters,
  policy version, the delivery ledger, wake-ups, and the one way the controller dies;
* :mod:`~rolloutd.domain.generation` — admission, dispatch through the sibling runner, the
  finishing stage, commit, weight updates and eviction of stale groups;
* :mod:`~rolloutd.domain.delivery` — fetch, lease, ack durability, finalize, rewind, submit, and
  the lease reaper;
* :mod:`~rolloutd.domain.recovery` — capture, restore, journal replay, and resume of unfinished
  groups.

A group moves through one declared life cycle (:data:`~rolloutd.domain.group.TRANSITIONS`); every
change to the buffer or the sampler happens inside a barrier mutation of one kind, so a
checkpoint's exclusive hold sees a consistent cut. Persistent state goes in and out in one value
(:class:`ControllerState`): ``capture()`` under the exclusive hold, ``recover(recovered)`` once
before ``start()``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from rolloutd.domain.barrier import MutationBarrier
from rolloutd.domain.buffer import BufferCounts, Lease, RolloutBuffer, RowSealer
from rolloutd.domain.concurrency import InFlightReason
from rolloutd.domain.core import ControllerConfig, Core
from rolloutd.domain.delivery import AckResult, Delivery, RewindResult
from rolloutd.domain.encoder import E, GroupEncoder
from rolloutd.domain.engine import GenerationEngine, SamplingParams
from rolloutd.domain.fate import TokenAccount
from rolloutd.domain.finishing import FinishingStage
from rolloutd.domain.generation import Generation
from rolloutd.domain.group import Group, GroupState
from rolloutd.domain.ids import ID_BITS, ID_BLOCK, local_id
from rolloutd.domain.observer import Observer
from rolloutd.domain.recovery import Recovered, Recovery, RecoveryCounts
from rolloutd.domain.report import PhaseClock
from rolloutd.domain.runner import SiblingRunner
from rolloutd.domain.sampler import Admission, Sampler, SourceStatus
from rolloutd.domain.state import ControllerState, Counters, DeliveryJournal
from rolloutd.domain.weights import WeightsTimeline

__all__ = [
    "ID_BITS",
    "ID_BLOCK",
    "AckResult",
    "AdmissionStatus",
    "Controller",
    "ControllerConfig",
    "ControllerStatus",
    "RewindResult",
    "local_id",
]


@dataclass(frozen=True)
class AdmissionStatus:
    """The limits admission works under right now."""

    in_flight_limit: int
    """Groups that may be generating or finishing at once now."""
    in_flight_reason: InFlightReason
    in_flight_ceiling: int
    """``limits.max_in_flight``, or ``limits.max_in_flight_ceiling`` with ``auto``."""
    adaptive: bool
    staleness_gating: bool
    consumed_per_version: float | None
    """Groups trainers consumed per policy version (smoothed); None before a version change."""
    staleness_room: int
    """Groups the staleness gate would still admit now (whether or not gating is on)."""


@dataclass(frozen=True)
class ControllerStatus:
    policy_version: int
    group_size: int
    buffer: BufferCounts
    capacity: int
    max_in_flight: int
    admission: AdmissionStatus
    """What holds admission back: the in-flight limit and the staleness gate."""
    inflight_samples: int
    pending_prompts: int
    cursor_epoch: int
    cursor_offset: int
    dataset_exhausted: bool
    counters: Counters
    replica: int
    replicas: int
    sources: tuple[SourceStatus, ...] = ()
    """Each dataset source's cursor and size."""
    trainer_step: int = -1
    """The highest trainer step acked (lowered by a Rewind); -1 before the first ack."""


class Controller:
    """Admits prompts, generates and finishes groups, delivers them, and keeps its state in and
    out of snapshots; see the module docstring."""

    def __init__(
        self,
        config: ControllerConfig,
        engine: GenerationEngine,
        sampler: Sampler,
        *,
        observer: Observer | None = None,
        journal: DeliveryJournal | None = None,
        sealer: RowSealer | None = None,
        clock: Callable[[], float] = time.time,
        runner: SiblingRunner | None = None,
        stage: FinishingStage | None = None,
    ) -> None:
        self.core = Core(
            config, engine, sampler, observer=observer, journal=journal, sealer=sealer, clock=clock
        )
        self.generation = Generation(self.core, runner, stage)
        self.delivery = Delivery(self.core)
        self.recovery = Recovery(self.core, self.generation, self.delivery)
        self._loops: list[asyncio.Task[None]] = []

    # --- what the rooms share, read-only here ----------------------------------------------

    @property
    def config(self) -> ControllerConfig:
        return self.core.config

    @property
    def engine(self) -> GenerationEngine:
        return self.core.engine

    @property
    def sampler(self) -> Sampler:
        return self.core.sampler

    @property
    def observer(self) -> Observer:
        return self.core.observer

    @property
    def barrier(self) -> MutationBarrier:
        return self.core.barrier

    @property
    def buffer(self) -> RolloutBuffer:
        return self.core.buffer

    @property
    def counters(self) -> Counters:
        return self.core.counters

    @property
    def policy_version(self) -> int:
        return self.core.policy_version

    @property
    def weights_path(self) -> str | None:
        return self.core.weights_path

    @property
    def next_group_id(self) -> int:
        return self.core.next_group_id

    @property
    def finalized_through(self) -> int:
        return self.core.finalized_through

    @property
    def fatal(self) -> BaseException | None:
        return self.core.fatal

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Starts admission and lease expiry. Call after any restore."""
        core = self.core
        core.admitting = True
        core.start_engine_clock()
        self._loops = [
            core.watched(
                asyncio.create_task(self.generation.admission_loop(), name="rolloutd-admission")
            ),
            core.watched(
                asyncio.create_task(
                    self.delivery.reap_expired_leases(), name="rolloutd-lease-reaper"
                )
            ),
        ]
        if self.generation.limit.adaptive:
            self._loops.append(
                core.watched(
                    asyncio.create_task(
                        self.generation.concurrency_loop(), name="rolloutd-concurrency"
                    )
                )
            )

    async def set_admitting(self, admitting: bool) -> None:
        """Pauses or resumes admission (the service is not ready, or ready again)."""
        core = self.core
        core.admitting = admitting and not core.draining and core.fatal is None
        await core.notify()

    async def begin_drain(self) -> None:
        """Stops admission and answers waiting fetches ``Unavailable`` (a trainer must tell
        "shutting down" from "nothing ready" to retry elsewhere); generation continues."""
        self.core.admitting, self.core.draining = False, True
        await self.core.notify()

    async def stop(self) -> None:
        """Stops admission, generation and finishing; staged siblings stay in the buffer.
        Idempotent."""
        self.core.admitting = False
        for task in self._loops:
            task.cancel()
        await self.generation.stop()
        await asyncio.gather(*self._loops, return_exceptions=True)
        self._loops = []
        await self.core.notify()
        self.core.stop_engine_clock()

    async def wait_dead(self) -> BaseException:
        """Returns the fatal error once the controller cannot go on (e.g. the engine died)."""
        return await self.core.wait_dead()

    # --- trainer-facing operations ---------------------------------------------------------

    async def fetch(
        self, max_groups: int, wait_ms: int, consumer: str
    ) -> tuple[Lease, list[Group]] | None:
        return await self.delivery.fetch(max_groups, wait_ms, consumer)

    async def fetch_encoded(
        self, max_groups: int, wait_ms: int, consumer: str, encoder: GroupEncoder[E]
    ) -> tuple[Lease, list[E]] | None:
        return await self.delivery.fetch_encoded(max_groups, wait_ms, consumer, encoder)

    async def ack(self, lease_id: str, trainer_step: int) -> AckResult:
        return await self.delivery.ack(lease_id, trainer_step)

    def check_step(self, trainer_step: int) -> None:
        """Raises ``InvalidArgument`` for a trainer step the service refuses (``Checkpoint``)."""
        self.delivery.check_step(trainer_step)

    async def finalize(self, through_step: int) -> int:
        return await self.delivery.finalize(through_step)

    async def rewind(self, trainer_step: int) -> RewindResult:
        return await self.delivery.rewind(trainer_step)

    async def submit(self, admissions: list[Admission]) -> tuple[int, int]:
        return await self.delivery.submit(admissions)

    async def update_weights(
        self,
        version: int,
        weights_path: str,
        *,
        timeline: WeightsTimeline | None = None,
        only: tuple[str, ...] | None = None,
    ) -> int:
        return await self.generation.update_weights(
            version, weights_path, timeline=timeline, only=only
        )

    def check_version(self, version: int) -> None:
        """Raises ``InvalidArgument`` for a policy version a trainer may not ask for."""
        self.generation.check_version(version)

    async def evict_stale(self) -> int:
        return await self.generation.evict_stale()

    # --- persistent state ------------------------------------------------------------------

    def capture(self) -> ControllerState:
        return self.recovery.capture()

    def capture_failed(self, state: ControllerState) -> None:
        self.recovery.capture_failed(state)

    def retained_from_step(self, state: ControllerState) -> int:
        """Snapshots tagged with an older trainer step than this are no longer needed: a
        ``Rewind`` cannot go back further than the rewind window."""
        return state.max_acked_step - self.core.config.rewind_window

    def prepare_restore(self, state: ControllerState) -> RolloutBuffer:
        return self.recovery.prepare(state)

    async def recover(self, recovered: Recovered, clock: PhaseClock) -> RecoveryCounts:
        return await self.recovery.recover(recovered, clock)

    # --- introspection ---------------------------------------------------------------------

    def generating_groups(self) -> list[Group]:
        """Groups whose siblings are being generated."""
        return [g for g in self.core.buffer.groups.values() if g.state is GroupState.GENERATING]

    @property
    def inflight_samples(self) -> int:
        return self.generation.inflight_samples

    def generation_traces(self, group_ids: Iterable[int]) -> list[tuple[int, Mapping[str, str]]]:
        """(group id, trace context of its generation) of each of ``group_ids`` still buffered
        whose generation was traced (``Group.trace``)."""
        groups = self.core.buffer.groups
        return [
            (gid, group.trace)
            for gid in group_ids
            if (group := groups.get(gid)) is not None and group.trace
        ]

    def settings_of(self, group: Group) -> tuple[str, SamplingParams]:
        """A group's source name and the sampling settings it was generated with."""
        return self.core.source_of(group.meta), self.core.params_of(group.meta)

    def token_account(self) -> TokenAccount:
        """Where the generated tokens went and the engine's time, ``buffered`` counted in the
        buffer (linear in it: for GetStatus, not for every scrape)."""
        return self.core.token_account()

    def status(self) -> ControllerStatus:
        """What the controller holds now; its counters' engine time is brought up to date."""
        core = self.core
        core.clock_engine(read=True)
        cursor = core.sampler.cursor
        return ControllerStatus(
            policy_version=core.policy_version,
            group_size=core.config.group_size,
            buffer=core.buffer.counts(),
            capacity=core.config.buffer_capacity,
            max_in_flight=core.config.max_in_flight,
            admission=self.admission_status(),
            inflight_samples=self.inflight_samples,
            pending_prompts=core.sampler.pending,
            cursor_epoch=cursor.epoch,
            cursor_offset=cursor.offset,
            dataset_exhausted=core.sampler.exhausted,
            counters=core.counters,
            replica=core.config.replica,
            replicas=core.config.replicas,
            sources=tuple(core.sampler.status()),
            trainer_step=core.max_acked_step,
        )

    def admission_status(self) -> AdmissionStatus:
        core, limit = self.core, self.generation.limit
        return AdmissionStatus(
            in_flight_limit=limit.value,
            in_flight_reason=limit.reason,
            in_flight_ceiling=limit.ceiling,
            adaptive=limit.adaptive,
            staleness_gating=core.config.staleness_gating,
            consumed_per_version=core.gate.per_version,
            staleness_room=self.generation.staleness_room(),
        )
