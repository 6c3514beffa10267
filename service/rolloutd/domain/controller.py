"""The controller: a small façade over the rooms that do its jobs (docs/design.md, "The controller").

The rooms (``rooms.py``) each own their state and their part of a snapshot; the façade is
what the service's adapters call (fetch, ack, finalize, rewind, submit, weight updates, status,
capture and restore), and nothing else reaches past it. Conveniences only tests want live
under ``tests/``.

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

from rolloutd.domain.accounting import Counters
from rolloutd.domain.acking import AckResult, RewindResult
from rolloutd.domain.barrier import MutationBarrier
from rolloutd.domain.buffer import BufferCounts, RolloutBuffer, RowSealer
from rolloutd.domain.concurrency import InFlightReason
from rolloutd.domain.controller_config import ControllerConfig
from rolloutd.domain.encoder import E, GroupEncoder
from rolloutd.domain.engine import GenerationEngine, SamplingParams
from rolloutd.domain.fate import TokenAccount
from rolloutd.domain.finishing import FinishingStage
from rolloutd.domain.group import Group
from rolloutd.domain.ids import ID_BITS, ID_BLOCK, local_id
from rolloutd.domain.journal import DeliveryJournal, Lease
from rolloutd.domain.observer import Observer
from rolloutd.domain.recovery import Recovered, Recovery, RecoveryCounts
from rolloutd.domain.report import PhaseClock
from rolloutd.domain.rooms import Rooms
from rolloutd.domain.runner import SiblingRunner
from rolloutd.domain.sampler import Admission, Sampler, SourceStatus
from rolloutd.domain.snapshot import ControllerState
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
    out of snapshots; see the module docstring. Its methods are what the service's adapters
    (the gRPC servicer, the checkpointer, the weights updater, the server) call; ``rooms`` is
    there for what composes them (recovery) and for tests that look inside."""

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
        self._rooms = Rooms.build(
            config,
            engine,
            sampler,
            observer=observer,
            journal=journal,
            sealer=sealer,
            clock=clock,
            runner=runner,
            stage=stage,
        )
        self._recovery = Recovery(self._rooms)
        self._loops: list[asyncio.Task[None]] = []

    @property
    def rooms(self) -> Rooms:
        """The rooms behind the façade, for their reports and for tests; the service's adapters
        go through the façade's methods."""
        return self._rooms

    @property
    def config(self) -> ControllerConfig:
        return self._rooms.config

    @property
    def barrier(self) -> MutationBarrier:
        """The barrier a checkpoint holds exclusively to capture a consistent cut."""
        return self._rooms.barrier

    @property
    def policy_version(self) -> int:
        return self._rooms.policy.version

    @property
    def weights_path(self) -> str | None:
        return self._rooms.policy.weights_path

    @property
    def fatal(self) -> BaseException | None:
        return self._rooms.liveness.fatal

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Starts admission and lease expiry. Call after any restore."""
        r = self._rooms
        r.liveness.admit(True)
        r.accounting.start_clock(r.engine_state)
        loops = [
            (r.admitter.admission_loop(), "rolloutd-admission"),
            (r.leasing.reap_expired_leases(), "rolloutd-lease-reaper"),
        ]
        if r.admitter.limit.adaptive:
            loops.append((r.admitter.concurrency_loop(), "rolloutd-concurrency"))
        self._loops = [r.liveness.watched(asyncio.create_task(c, name=n)) for c, n in loops]

    async def set_admitting(self, admitting: bool) -> None:
        """Pauses or resumes admission (the service is not ready, or ready again)."""
        self._rooms.liveness.admit(admitting)
        await self._rooms.wakeups.notify()

    async def begin_drain(self) -> None:
        """Stops admission and answers waiting fetches ``Unavailable`` (a trainer must tell
        "shutting down" from "nothing ready" to retry elsewhere); generation continues."""
        self._rooms.liveness.drain()
        await self._rooms.wakeups.notify()

    async def stop(self) -> None:
        """Stops admission, generation and finishing; staged siblings stay in the buffer.
        Idempotent."""
        r = self._rooms
        r.liveness.admit(False)
        for task in self._loops:
            task.cancel()
        await r.flight.stop()
        await asyncio.gather(*self._loops, return_exceptions=True)
        self._loops = []
        await r.wakeups.notify()
        r.accounting.stop_clock()

    async def wait_dead(self) -> BaseException:
        """Returns the fatal error once the controller cannot go on (e.g. the engine died)."""
        return await self._rooms.liveness.wait_dead()

    # --- trainer-facing operations ---------------------------------------------------------

    async def fetch_encoded(
        self, max_groups: int, wait_ms: int, consumer: str, encoder: GroupEncoder[E]
    ) -> tuple[Lease, list[E]] | None:
        return await self._rooms.leasing.fetch_encoded(max_groups, wait_ms, consumer, encoder)

    async def ack(self, lease_id: str, trainer_step: int) -> AckResult:
        return await self._rooms.acking.ack(lease_id, trainer_step)

    def check_step(self, trainer_step: int) -> None:
        """Raises ``InvalidArgument`` for a trainer step the service refuses (``Checkpoint``)."""
        self._rooms.acking.check_step(trainer_step)

    async def finalize(self, through_step: int) -> int:
        return await self._rooms.acking.finalize(through_step)

    async def rewind(self, trainer_step: int) -> RewindResult:
        return await self._rooms.acking.rewind(trainer_step)

    async def submit(self, admissions: list[Admission]) -> tuple[int, int]:
        return await self._rooms.intake.submit(admissions)

    async def update_weights(
        self,
        version: int,
        weights_path: str,
        *,
        timeline: WeightsTimeline | None = None,
        only: tuple[str, ...] | None = None,
    ) -> int:
        return await self._rooms.policy.update_weights(
            version, weights_path, timeline=timeline, only=only
        )

    def check_version(self, version: int) -> None:
        """Raises ``InvalidArgument`` for a policy version a trainer may not ask for."""
        self._rooms.policy.check_version(version)

    # --- persistent state ------------------------------------------------------------------

    def capture(self) -> ControllerState:
        return self._recovery.capture()

    def capture_failed(self, state: ControllerState) -> None:
        self._recovery.capture_failed(state)

    def retained_from_step(self, state: ControllerState) -> int:
        """Snapshots tagged with an older trainer step than this are no longer needed: a
        ``Rewind`` cannot go back further than the rewind window."""
        return state.ledger.max_acked_step - self._rooms.config.rewind_window

    def prepare_restore(self, state: ControllerState) -> RolloutBuffer:
        return self._recovery.prepare(state)

    async def recover(self, recovered: Recovered, clock: PhaseClock) -> RecoveryCounts:
        return await self._recovery.recover(recovered, clock)

    # --- introspection ---------------------------------------------------------------------

    def generation_traces(self, group_ids: Iterable[int]) -> list[tuple[int, Mapping[str, str]]]:
        """(group id, trace context of its generation) of each of ``group_ids`` still buffered
        whose generation was traced (``Group.trace``)."""
        groups = self._rooms.buffer.groups
        return [
            (gid, group.trace)
            for gid in group_ids
            if (group := groups.get(gid)) is not None and group.trace
        ]

    def settings_of(self, group: Group) -> tuple[str, SamplingParams]:
        """A group's source name and the sampling settings it was generated with."""
        r = self._rooms
        return r.sampler.source_name(group.meta.position), r.generation.params_of(group)

    def token_account(self) -> TokenAccount:
        """Where the generated tokens went and the engine's time, ``buffered`` counted in the
        buffer (linear in it: for GetStatus, not for every scrape)."""
        return self._rooms.accounting.token_account(self._rooms.buffer.groups.values())

    def status(self) -> ControllerStatus:
        """What the controller holds now; its counters' engine time is brought up to date."""
        r = self._rooms
        r.accounting.clock_engine(read=True)
        cursor = r.sampler.cursor
        return ControllerStatus(
            policy_version=r.policy.version,
            group_size=r.config.group_size,
            buffer=r.buffer.counts(),
            capacity=r.config.buffer_capacity,
            max_in_flight=r.config.max_in_flight,
            admission=self.admission_status(),
            inflight_samples=r.flight.samples,
            pending_prompts=r.sampler.pending,
            cursor_epoch=cursor.epoch,
            cursor_offset=cursor.offset,
            dataset_exhausted=r.sampler.exhausted,
            counters=r.accounting.counters,
            replica=r.config.replica,
            replicas=r.config.replicas,
            sources=tuple(r.sampler.status()),
            trainer_step=r.ledger.max_acked_step,
        )

    def admission_status(self) -> AdmissionStatus:
        r = self._rooms
        limit = r.admitter.limit
        return AdmissionStatus(
            in_flight_limit=limit.value,
            in_flight_reason=limit.reason,
            in_flight_ceiling=limit.ceiling,
            adaptive=limit.adaptive,
            staleness_gating=r.config.staleness_gating,
            consumed_per_version=r.policy.gate.per_version,
            staleness_room=r.admitter.staleness_room(),
        )
