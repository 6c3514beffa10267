"""The controller's shared core: what its rooms (generation, delivery, recovery) all work on.

The buffer, the barrier every change goes through, the sampler, the counters, the policy
version, the delivery ledger (acks' high-water marks, what the journal holds for groups no
snapshot held), the staged tokens of generating siblings, the pauses that lease time does not
count, the clock of the engine's time, the wake-ups that admission and fetches wait on, and the
one way the controller dies. The rooms hold a reference to one :class:`Core` and nothing of each
other's state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rolloutd.domain.admission import StalenessGate
from rolloutd.domain.barrier import MutationBarrier
from rolloutd.domain.buffer import RolloutBuffer, RowSealer
from rolloutd.domain.concurrency import ConcurrencyConfig
from rolloutd.domain.engine import GenerationEngine, SamplingParams
from rolloutd.domain.errors import Unavailable
from rolloutd.domain.fate import EngineState, TokenAccount, TokenFate
from rolloutd.domain.group import GroupMeta, GroupState, Position
from rolloutd.domain.observer import NullObserver, Observer
from rolloutd.domain.partial import TokenDelta, delta_tokens
from rolloutd.domain.pauses import Pauses
from rolloutd.domain.sampler import SUBMITTED, Admission, Sampler
from rolloutd.domain.spec import SpecLimits
from rolloutd.domain.state import Counters, DeliveryJournal, LostAck, NullJournal

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ControllerConfig:
    """The controller's settings; ``config.py`` exposes them as keys (``limits.*``,
    ``group_size``) with these defaults and meanings."""

    group_size: int = 4
    """Siblings per prompt (N in GRPO)."""
    max_in_flight: int = 16
    """Most groups generating or finishing at once (with ``concurrency``: the most its adaptive
    limit may reach)."""
    concurrency: ConcurrencyConfig | None = None
    """The adaptive limit on groups in flight (``limits.max_in_flight: auto``,
    domain/concurrency.py); None: ``max_in_flight`` is fixed."""
    buffer_capacity: int = 256
    """Most groups generating, finishing, ready or leased. Acked groups waiting for finalization
    are not counted (else a trainer could stall admission for good); ``rewind_window`` bounds
    them."""
    max_staleness: int = 4
    """Groups more than this many policy versions old are evicted."""
    staleness_gating: bool = True
    """Admit only as many groups as trainers can still consume within ``max_staleness`` policy
    versions, at the pace they were seen to consume per version (until a version change shows
    it: ``max_in_flight`` groups a version), so that eviction is left for what no pace foresees
    (a trainer that stops). Off: admission fills the buffer, and what falls too far behind is
    evicted."""
    lease_timeout_s: float = 300.0
    """An unacknowledged lease expires after this long and its groups become available again.
    Time the service did not run (frozen, a paused VM) does not count."""
    rewind_window: int = 8
    """Acked groups wait at most this many trainer steps for Checkpoint before finalizing."""
    max_fetch_groups: int = 1024
    """Largest max_groups a FetchGroups request may ask for."""
    max_wait_ms: int = 600_000
    """Longest wait_ms a FetchGroups request may ask for."""
    seed: int = 0
    """Root of every group's and sibling's seed."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """The service's sampling settings: a group's unless its prompt or source sets its own."""
    spec_limits: SpecLimits = field(default_factory=SpecLimits)
    """What a prompt's generation settings may ask for."""
    sibling_retries: int = 2
    """Attempts after a recoverable engine error before the group is dropped."""
    reap_interval_s: float = 1.0
    """How often expired leases are looked for."""
    replica: int = 0
    """This replica's index in the fleet, from 0 (``--replica``; in Kubernetes the pod's
    ordinal). It owns the dataset rows whose index modulo ``fleet.replicas`` is this one, and it
    is the high bits of every group id the replica issues, so ids are unique across the fleet."""
    replicas: int = 1
    """Replicas sharing one dataset (``--replicas``): each prompt is owned by one of them, so the
    fleet delivers each prompt once an epoch. A store restores only under the fleet size (and
    replica index) it was written with."""
    capture_partials: bool = True
    """Stream each sibling's tokens into a staging area that checkpoints capture, so a restart
    continues unfinished siblings from their tokens (``recovery.granularity: token``)."""
    max_metadata_bytes: int = 8 << 20
    """Largest prompt ``metadata``, as JSON in UTF-8, that ``SubmitPrompts`` accepts (it is
    delivered with every group of the prompt, so it must fit a gRPC message twice over)."""
    max_submit_bytes: int = 32 << 20
    """Most bytes of prompts (text, messages and metadata as JSON) one ``SubmitPrompts`` may
    carry; a larger call is refused whole."""
    max_lease_expiries: int = 8
    """A group whose leases expired this many times unacknowledged is dropped
    (``lease_expiries``) instead of being leased again: a group no trainer can take must not
    cycle for good. Counted since the service started."""
    max_version_step: int = 1_000_000
    """How far one ``UpdateWeights`` may move the policy version ahead of the current one: a
    version beyond it is refused, so one wrong value cannot block every later update."""
    max_step_ahead: int = 1_000_000
    """How far the trainer step of one ``AckGroups`` or ``Checkpoint`` may be ahead of the
    highest step the service has seen (acked or finalized): one wrong value would otherwise
    finalize everything before it and refuse every ``Rewind`` below it."""


class Core:
    """State every room of the controller shares; see the module docstring."""

    def __init__(
        self,
        config: ControllerConfig,
        engine: GenerationEngine,
        sampler: Sampler,
        *,
        observer: Observer | None,
        journal: DeliveryJournal | None,
        sealer: RowSealer | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.engine = engine
        self.sampler = sampler
        self.observer: Observer = observer or NullObserver()
        self.journal: DeliveryJournal = journal or NullJournal()
        self.clock = clock
        self.pauses = Pauses()
        """When the service did not run; leases do not count it (pauses.py)."""
        self.barrier = MutationBarrier(on_blocked=self.observer.mutation_blocked)
        self.buffer = RolloutBuffer(sealer)
        self.counters = Counters()
        self.policy_version = engine.policy_version
        self.gate = StalenessGate(
            config.max_staleness, config.max_in_flight, version=self.policy_version
        )
        """Trainers' pace per policy version, and the admissions it allows (admission.py)."""
        self.weights_path: str | None = None
        self.next_group_id = 1
        """The replica-local counter of the next group id (see ``ids.ID_BITS``)."""
        self.ids_reserved_through = 0
        """Local ids up to this one are journaled as reserved and may be issued."""
        self.max_acked_step = -1
        self.finalized_through = -1
        self.lost_acks: list[LostAck] = []
        """Acks journaled for groups no snapshot held (found by a restore)."""
        self.lost_leased: dict[str, dict[int, Admission]] = {}
        """Live leases restored from the journal whose groups no snapshot held, by lease id: the
        admissions of those groups, skipped by the sampler until the lease is acked or expires."""
        self.staging: dict[tuple[int, int], list[TokenDelta]] = {}
        """(group id, index) -> the deltas of a generating sibling so far, its restored prefix
        first. Append-only while the sibling generates; removed in the mutation that stages the
        sibling's sample or removes its group, so a capture never holds both. Its tokens count
        as generated and ``buffered`` (domain/fate.py)."""
        self.engine_state: Callable[[], EngineState] = lambda: EngineState.IDLE_NO_WORK
        """What the engine does right now (the generation room sets it)."""
        self._engine_clock: tuple[EngineState, float] | None = None
        """The engine's state since a monotonic instant, while the controller runs."""
        self.admitting = False
        self.draining = False
        self.fatal: BaseException | None = None
        self._dead = asyncio.Event()
        self.changed = asyncio.Condition()
        """Admission waits on it for room; every change notifies it."""
        self.fetchable = asyncio.Condition()
        """Fetches wait on it for ready groups: a change wakes as many of them as there are
        ready groups (all of them when draining or failed), not every waiting trainer."""

    async def notify(self) -> None:
        """Wakes admission, and as many waiting fetches as there are ready groups."""
        self.clock_engine()
        async with self.changed:
            self.changed.notify_all()
        async with self.fetchable:
            if self.draining or self.fatal is not None:
                self.fetchable.notify_all()
            else:
                self.fetchable.notify(self.buffer.ready_count)

    def too_stale(self, policy_version: int) -> bool:
        """A group generated at ``policy_version`` is more than ``max_staleness`` versions behind
        (docs/design.md, "The life of a group")."""
        return policy_version < self.policy_version - self.config.max_staleness

    def evict(self, group_id: int) -> None:
        """Removes a too-stale group whose generation has ended (inside a mutation); its prompt
        is admitted again."""
        tokens = self.buffer.groups[group_id].generated_tokens + self.release_partials(group_id)
        g = self.buffer.remove(group_id, GroupState.EVICTED)
        self.sampler.readmit(Admission(g.meta.prompt, g.meta.position))
        self.counters.evicted_groups += 1
        self.counters.evicted_tokens += tokens

    async def wake_admission(self) -> None:
        """Wakes admission alone (a fetch began to wait: the staleness gate may admit more)."""
        async with self.changed:
            self.changed.notify_all()

    # --- where generation goes (domain/fate.py) --------------------------------------------

    def release_partials(self, group_id: int) -> int:
        """Forgets the staged tokens of a group's generating siblings (its group leaves the
        buffer, or they are generated again); returns how many tokens they held."""
        keys = [key for key in self.staging if key[0] == group_id]
        return sum(delta_tokens(self.staging.pop(key)) for key in keys)

    def held_tokens(self) -> tuple[int, int]:
        """Tokens the buffer holds, counted group by group: (buffered, acked). Buffered are the
        siblings of groups generating, finishing, ready or leased and the staged tokens of
        generating siblings; acked are those of groups acked and not yet finalized (delivered).
        Linear in the buffer: for status, not for every scrape."""
        buffered = sum(delta_tokens(deltas) for deltas in self.staging.values())
        acked = 0
        for g in self.buffer.groups.values():
            if g.state is GroupState.ACKED:
                acked += g.generated_tokens
            else:
                buffered += g.generated_tokens
        return buffered, acked

    def token_account(self) -> TokenAccount:
        """Where the generated tokens went, ``buffered`` counted in the buffer
        (:meth:`held_tokens`), and the engine's time so far."""
        self.clock_engine(read=True)
        counters = self.counters
        fates = {**counters.settled(), TokenFate.BUFFERED: self.held_tokens()[0]}
        seconds = {s: counters.engine_seconds.get(s.value, 0.0) for s in EngineState}
        return TokenAccount(counters.generated_tokens, fates, seconds)

    def start_engine_clock(self) -> None:
        """Starts splitting the engine's time by state (the controller starts)."""
        self._engine_clock = (self.engine_state(), time.monotonic())

    def clock_engine(self, *, read: bool = False) -> None:
        """When the engine's state changed, counts the time since the last change in the state
        it was in. Called whenever the state may have changed (a sibling starts or ends, a
        weight update, every :meth:`notify`); with ``read``, counts the time so far even when
        it did not change (before the counters are read)."""
        if self._engine_clock is None:
            return
        held, since = self._engine_clock
        state = self.engine_state()
        if state is held and not read:
            return  # the cheap common case: a sibling ends while others run
        now = time.monotonic()
        self.counters.engine_time(held, now - since)
        self._engine_clock = (state, now)

    def stop_engine_clock(self) -> None:
        """Counts the last stretch and stops (the controller stops)."""
        self.clock_engine(read=True)
        self._engine_clock = None

    def watched(self, task: asyncio.Task[None]) -> asyncio.Task[None]:
        """A task of the controller whose unexpected error ends the controller (never silently:
        the service waits on :meth:`wait_dead`)."""

        def ended(t: asyncio.Task[None]) -> None:
            if not t.cancelled() and t.exception() is not None:
                self.die(t.exception())  # type: ignore[arg-type]

        task.add_done_callback(ended)
        return task

    def die(self, exc: BaseException) -> None:
        if self.fatal is None:
            log.critical("controller cannot go on: %s", exc)
            self.fatal = exc
            self.admitting = False
            self._dead.set()

    async def wait_dead(self) -> BaseException:
        await self._dead.wait()
        assert self.fatal is not None
        return self.fatal

    def check_serving(self) -> None:
        if self.fatal is not None:
            raise Unavailable(f"the service failed: {self.fatal}")
        if self.draining:
            raise Unavailable("the service is draining (shutting down); fetch from another replica")

    # --- a group's settings ----------------------------------------------------------------

    def params_of(self, meta: GroupMeta) -> SamplingParams:
        """The sampling settings a group's siblings are generated with."""
        return self.config.sampling if meta.params is None else meta.params

    def source_of(self, meta: GroupMeta) -> str:
        """The name of a group's source (``submitted`` for a submitted prompt's)."""
        return self.source_name(meta.position)

    def source_name(self, position: Position | None) -> str:
        """The name of the source of a prompt at ``position`` (None: a submitted prompt)."""
        if position is None:
            return SUBMITTED
        return self.sampler.sources[position.source].name
