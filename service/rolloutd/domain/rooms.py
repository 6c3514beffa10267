"""The rooms of the controller, built and wired once (docs/design.md, "The controller").

Each room owns its state and changes another room's only through that room's methods:

* shared, small and named for what they are: the :class:`RolloutBuffer` (groups and rows), the
  :class:`MutationBarrier` every change goes through, the :class:`Sampler` (prompts to admit),
  the :class:`Wakeups` that admission and fetches sleep on, and :class:`Liveness` (admitting,
  draining, the one way the controller dies);
* :class:`Accounting` — the counters, the staging of generating siblings, the engine's time;
* :class:`GroupIds` — the id allocator;
* :class:`Policy` — the served version, weight updates, the staleness gate, eviction;
* :class:`Flight` — what runs for each group in flight;
* :class:`Drops` — the one way a group is dropped;
* :class:`Generation` — siblings dispatched to the sibling runner;
* :class:`Finisher` — the finishing stage's verdict carried out;
* :class:`Admitter` — the admission loop and the in-flight limit;
* :class:`DeliveryLedger` — leases, acks, trainer steps (delivery's state);
* :class:`Leasing` — fetches, leases, their expiry;
* :class:`Acking` — acks, finalization, rewinds;
* :class:`Intake` — submitted prompts;
* recovery (``recovery.py``) composes their ``capture`` and ``restore``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from rolloutd.domain.accounting import Accounting
from rolloutd.domain.acking import Acking, AckingConfig
from rolloutd.domain.admission import AdmissionConfig, Admitter
from rolloutd.domain.barrier import MutationBarrier
from rolloutd.domain.buffer import RolloutBuffer, RowSealer
from rolloutd.domain.controller_config import ControllerConfig
from rolloutd.domain.drops import Drops
from rolloutd.domain.engine import GenerationEngine
from rolloutd.domain.fate import EngineState
from rolloutd.domain.finisher import Finisher
from rolloutd.domain.finishing import CommitAll, FinishingStage
from rolloutd.domain.flight import Flight
from rolloutd.domain.generation import Generation, GenerationConfig
from rolloutd.domain.ids import GroupIds
from rolloutd.domain.intake import Intake, IntakeConfig
from rolloutd.domain.journal import DeliveryJournal, NullJournal
from rolloutd.domain.leasing import Leasing, LeasingConfig
from rolloutd.domain.ledger import DeliveryLedger
from rolloutd.domain.liveness import Liveness
from rolloutd.domain.observer import NullObserver, Observer
from rolloutd.domain.policy import Policy, PolicyConfig
from rolloutd.domain.runner import EngineRunner, SiblingRunner
from rolloutd.domain.sampler import Sampler
from rolloutd.domain.wakeups import Wakeups


@dataclass(frozen=True)
class Rooms:
    """Every room of one controller (see the module docstring)."""

    config: ControllerConfig
    engine: GenerationEngine
    observer: Observer
    clock: Callable[[], float]
    buffer: RolloutBuffer
    barrier: MutationBarrier
    sampler: Sampler
    wakeups: Wakeups
    liveness: Liveness
    accounting: Accounting
    ids: GroupIds
    policy: Policy
    flight: Flight
    drops: Drops
    generation: Generation
    finisher: Finisher
    admitter: Admitter
    ledger: DeliveryLedger
    leasing: Leasing
    acking: Acking
    intake: Intake

    @staticmethod
    def build(
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
    ) -> Rooms:
        """The rooms of a controller, wired: the one place they are built."""
        observer = observer or NullObserver()
        journal = journal or NullJournal()
        cfg = config
        buffer = RolloutBuffer(sealer)
        barrier = MutationBarrier(on_blocked=observer.mutation_blocked)
        liveness = Liveness()
        accounting = Accounting()
        wakeups = Wakeups(buffer, liveness, accounting.clock_engine)
        ids = GroupIds(cfg.replica, journal.reserve_ids)
        flight = Flight(engine, observer)
        policy = Policy(
            PolicyConfig(cfg.max_staleness, cfg.max_in_flight, cfg.max_version_step),
            engine,
            buffer,
            barrier,
            flight,
            sampler,
            accounting,
            observer,
            wakeups,
            liveness,
        )
        drops = Drops(buffer, barrier, flight, accounting, sampler, journal, observer, wakeups)
        finisher = Finisher(
            stage or CommitAll(),
            buffer,
            barrier,
            flight,
            accounting,
            drops,
            sampler,
            observer,
            wakeups,
            liveness,
            clock,
        )
        generation = Generation(
            GenerationConfig(
                cfg.sampling, cfg.sibling_retries, cfg.capture_partials, cfg.durable_turns
            ),
            engine,
            runner or EngineRunner(),
            buffer,
            barrier,
            flight,
            accounting,
            drops,
            finisher,
            sampler,
            journal,
            observer,
            liveness,
        )
        admitter = Admitter(
            AdmissionConfig(
                cfg.group_size,
                cfg.max_in_flight,
                cfg.buffer_capacity,
                cfg.staleness_gating,
                cfg.seed,
                cfg.sampling,
                cfg.concurrency,
            ),
            engine,
            buffer,
            barrier,
            sampler,
            ids,
            policy,
            flight,
            generation,
            accounting,
            liveness,
            wakeups,
            clock,
        )
        ledger = DeliveryLedger()
        leasing = Leasing(
            LeasingConfig(
                cfg.lease_timeout_s,
                cfg.max_fetch_groups,
                cfg.max_wait_ms,
                cfg.max_lease_expiries,
                cfg.reap_interval_s,
            ),
            buffer,
            ledger,
            barrier,
            policy,
            drops,
            accounting,
            sampler,
            journal,
            observer,
            wakeups,
            liveness,
            clock,
        )
        acking = Acking(
            AckingConfig(cfg.rewind_window, cfg.max_step_ahead),
            buffer,
            ledger,
            barrier,
            policy,
            accounting,
            sampler,
            journal,
            observer,
            wakeups,
            clock,
        )
        intake = Intake(
            IntakeConfig(
                cfg.max_metadata_bytes,
                cfg.max_submit_bytes,
                cfg.spec_limits,
                cfg.sampling.max_tokens,
            ),
            engine,
            sampler,
            barrier,
            journal,
            liveness,
            wakeups,
        )
        return Rooms(
            cfg,
            engine,
            observer,
            clock,
            buffer,
            barrier,
            sampler,
            wakeups,
            liveness,
            accounting,
            ids,
            policy,
            flight,
            drops,
            generation,
            finisher,
            admitter,
            ledger,
            leasing,
            acking,
            intake,
        )

    def engine_state(self) -> EngineState:
        """What the engine does right now (domain/fate.py)."""
        if self.policy.updating:
            return EngineState.WEIGHT_UPDATE
        if self.flight.running:
            return EngineState.GENERATING
        if self.buffer.held >= self.config.buffer_capacity:
            return EngineState.IDLE_BUFFER_FULL
        return EngineState.IDLE_NO_WORK
