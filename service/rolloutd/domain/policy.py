"""The policy: which weights generate, and what falls too far behind them (docs/design.md, "The
life of a group", "Admission: what is started and how much").

:class:`Policy` owns the served policy version and weights path, the weight updates that move
them, the staleness gate (the trainers' pace per version, and how many more groups it admits),
and eviction: a group admitted at version v is evicted once the served version passes
v + ``limits.max_staleness``, its prompt admitted again. Eviction happens at a weight update
(every group that is not the trainer's) and whenever a lease expiry, a rewind or a restore makes
a group committed again (only those groups).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from rolloutd.domain.accounting import Accounting
from rolloutd.domain.barrier import MutationBarrier
from rolloutd.domain.buffer import RolloutBuffer
from rolloutd.domain.engine import EngineDeadError, EngineError, GenerationEngine
from rolloutd.domain.errors import InvalidArgument, Unavailable
from rolloutd.domain.flight import Flight
from rolloutd.domain.group import GroupState
from rolloutd.domain.liveness import Liveness
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.observer import Observer
from rolloutd.domain.sampler import Admission, Sampler
from rolloutd.domain.staleness import GateState, StalenessGate
from rolloutd.domain.wakeups import Wakeups
from rolloutd.domain.weights import WeightsTimeline

log = logging.getLogger(__name__)

_NOT_THE_TRAINERS = (GroupState.GENERATING, GroupState.FINISHING, GroupState.COMMITTED)


@dataclass(frozen=True)
class PolicyConfig:
    max_staleness: int = 4
    prior_per_version: float = 16.0
    """The staleness gate's estimate of groups consumed a version before it measures one."""
    max_version_step: int = 1_000_000


@dataclass(frozen=True)
class PolicyState:
    """The policy's part of a snapshot."""

    policy_version: int = 0
    weights_path: str | None = None
    gate: GateState = field(default_factory=GateState)
    """The trainers' pace the staleness gate measured."""


class Policy:
    """The served version, weight updates, the staleness gate and eviction; see the module
    docstring."""

    def __init__(
        self,
        config: PolicyConfig,
        engine: GenerationEngine,
        buffer: RolloutBuffer,
        barrier: MutationBarrier,
        flight: Flight,
        sampler: Sampler,
        accounting: Accounting,
        observer: Observer,
        wakeups: Wakeups,
        liveness: Liveness,
    ) -> None:
        self._config = config
        self._engine = engine
        self._buffer = buffer
        self._barrier = barrier
        self._flight = flight
        self._sampler = sampler
        self._accounting = accounting
        self._observer = observer
        self._wakeups = wakeups
        self._liveness = liveness
        self._version = engine.policy_version
        self._weights_path: str | None = None
        self._gate = StalenessGate(
            config.max_staleness, config.prior_per_version, version=self._version
        )
        self._updating = False
        """The engine is loading new weights."""

    # --- reading ---------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def weights_path(self) -> str | None:
        return self._weights_path

    @property
    def updating(self) -> bool:
        return self._updating

    @property
    def gate(self) -> StalenessGate:
        """The staleness gate; leasing tells it what was leased and what fetches wait for,
        admission asks it for room (its own methods keep its counts)."""
        return self._gate

    def too_stale(self, policy_version: int) -> bool:
        """A group generated at ``policy_version`` is more than ``max_staleness`` versions behind
        (docs/design.md, "The life of a group")."""
        return policy_version < self._version - self._config.max_staleness

    def lag(self, policy_version: int) -> int:
        """Policy versions between the weights generating now and ``policy_version``."""
        return self._version - policy_version

    # --- weight updates --------------------------------------------------------------------

    def check_version(self, version: int) -> None:
        """Refuses a version a trainer asks for (``UpdateWeights``, ``PushWeights``) more than
        ``max_version_step`` ahead of the served one: one absurd version would refuse every
        later update (docs/operations.md, "Resetting a policy version or trainer step"). A
        catch-up from the weights store is not asked for, so it is not bounded."""
        step = self._config.max_version_step
        if version > self._version + step:
            raise InvalidArgument(
                "version",
                f"{version} is more than limits.max_version_step={step} ahead of the current "
                f"policy version {self._version}",
            )

    async def update_weights(
        self,
        version: int,
        weights_path: str,
        *,
        timeline: WeightsTimeline | None = None,
        only: tuple[str, ...] | None = None,
    ) -> int:
        """Loads new weights (``only``: just these tensors changed), bumps the policy version,
        evicts groups now too stale; returns how many.

        An engine that fails while loading may hold a mix of old and new weights: the controller
        then stops (not ready) rather than generate from them.
        """
        if version <= self._version:
            raise InvalidArgument(
                "version", f"must be greater than the current policy version {self._version}"
            )
        if not weights_path:
            raise InvalidArgument("weights_path", "must not be empty")
        self._liveness.check_serving()
        try:
            self._updating = True
            self._accounting.clock_engine()
            await self._engine.update_weights(weights_path, version, timeline=timeline, only=only)
        except EngineDeadError as exc:
            self._liveness.die(exc)
            raise Unavailable(f"the service is not ready: {exc}") from exc
        except EngineError as exc:  # refused before anything was loaded (a wrong path)
            raise InvalidArgument("weights_path", str(exc)) from exc
        finally:
            self._updating = False
            self._accounting.clock_engine()
        self._version, self._weights_path = version, weights_path
        self._gate.version_changed(version)
        return await self.evict_stale()

    # --- eviction --------------------------------------------------------------------------

    async def evict_stale(self) -> int:
        """Evicts every group too stale to deliver that is not the trainer's (generating,
        finishing or committed); a leased or acked group is looked at again when it becomes
        committed again (:meth:`evict_returned`)."""
        async with self._barrier.mutation(MutationKind.EVICT):
            stale = [
                g.group_id
                for g in self._buffer.groups.values()
                # not g.meta: a restored group's stays undecoded
                if self.too_stale(g.policy_version) and g.state in _NOT_THE_TRAINERS
            ]
            for gid in stale:
                self._flight.abandon(gid, "evicted: too stale")
                await self._flight.cancel(gid)
                self._evict(gid)
        if stale:
            self._observer.groups_evicted(len(stale))
            await self._wakeups.notify()
        return len(stale)

    def evict_returned(self, group_ids: Iterable[int]) -> int:
        """Evicts those of ``group_ids``, committed again just now (an expired lease, a rewind,
        a restore), that fell more than ``max_staleness`` policy versions behind while the
        trainer held them: eviction at a weight update passes over a trainer's groups, so this is
        where a stale group is kept from being delivered. Inside the mutation that committed them
        again; returns how many."""
        groups = self._buffer.groups
        stale = [gid for gid in group_ids if self.too_stale(groups[gid].policy_version)]
        for gid in stale:
            self._evict(gid)
        return len(stale)

    def _evict(self, group_id: int) -> None:
        """Removes a too-stale group whose generation has ended (inside a mutation); its prompt
        is admitted again."""
        g = self._buffer.groups[group_id]
        self._accounting.left(g, GroupState.EVICTED)
        self._buffer.remove(group_id, GroupState.EVICTED)
        self._sampler.readmit(Admission(g.meta.prompt, g.meta.position))

    # --- snapshots -------------------------------------------------------------------------

    def capture(self) -> PolicyState:
        return PolicyState(self._version, self._weights_path, self._gate.state())

    async def restore(self, state: PolicyState) -> None:
        """The snapshot's version and weights, loaded into the engine when it serves older
        ones, and the gate's pace, counted from the restored version."""
        if state.weights_path and state.policy_version > self._engine.policy_version:
            await self._engine.update_weights(state.weights_path, state.policy_version)
        self._version, self._weights_path = state.policy_version, state.weights_path
        self._gate.restore(state.gate, self._version)
