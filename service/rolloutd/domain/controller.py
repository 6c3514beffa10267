"""The controller: admits prompts, dispatches siblings, commits groups, leases and acknowledges them.

Background loops (one task each): admission and lease expiry. Every change to the buffer or the
sampler happens inside a barrier mutation of one kind, so a checkpoint's exclusive hold sees a
consistent cut. Engine calls happen outside mutations.

Delivery contract (DESIGN.md §2): an ack is durable (journaled) before ``ack`` returns and is
idempotent; ``finalize(step)`` drops groups acked at steps <= step; ``rewind(step)`` makes groups
acked after ``step`` available again; acks older than ``rewind_window`` steps finalize by themselves.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from rolloutd.domain.barrier import MutationBarrier
from rolloutd.domain.buffer import AckRecord, BufferCounts, BufferDelta, Lease, RolloutBuffer
from rolloutd.domain.errors import FailedPrecondition, InvalidArgument, Unavailable
from rolloutd.domain.group import Group, GroupState
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.observer import GroupCommitted, NullObserver, Observer
from rolloutd.domain.sampler import Admission, Sampler, SamplerCapture
from rolloutd.engines.base import (
    EngineDeadError,
    EngineError,
    GenerationEngine,
    GenerationRequest,
    SamplingParams,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ControllerConfig:
    group_size: int = 4
    """Siblings per prompt."""
    max_in_flight: int = 16
    """Most groups generating at once."""
    buffer_capacity: int = 256
    """Most groups generating, ready or leased. Acked groups waiting for finalization are not
    counted (else a trainer could stall admission for good); ``rewind_window`` bounds them."""
    max_staleness: int = 4
    """Groups more than this many policy versions behind are evicted."""
    lease_timeout_s: float = 300.0
    """Unacked leases expire after this long."""
    rewind_window: int = 8
    """Acks older than this many trainer steps finalize by themselves."""
    max_fetch_groups: int = 1024
    """Upper bound of FetchGroups.max_groups."""
    max_wait_ms: int = 600_000
    """Upper bound of FetchGroups.wait_ms."""
    seed: int = 0
    """Root of every group's and sibling's seed."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    sibling_retries: int = 2
    """Attempts after a recoverable engine error before the group is dropped."""
    reap_interval_s: float = 1.0
    """How often expired leases are looked for."""


class AckJournal(Protocol):
    """Makes an ack durable before the RPC returns."""

    async def append(self, record: AckRecord, groups: list[Group]) -> None: ...


class NullJournal:
    async def append(self, record: AckRecord, groups: list[Group]) -> None:
        return None


@dataclass
class Counters:
    admitted_groups: int = 0
    committed_groups: int = 0
    acked_groups: int = 0
    finalized_groups: int = 0
    evicted_groups: int = 0
    requeued_groups: int = 0
    dropped_groups: int = 0
    committed_tokens: int = 0
    expired_leases: int = 0


@dataclass(frozen=True)
class AckResult:
    acked_groups: int
    already_acked: bool


@dataclass(frozen=True)
class RewindResult:
    redelivered_groups: int
    readmitted_prompts: int


@dataclass(frozen=True)
class ControllerCapture:
    """A consistent cut of everything a snapshot holds, taken under the exclusive hold."""

    buffer: BufferDelta
    sampler: SamplerCapture
    next_group_id: int
    policy_version: int
    weights_path: str | None
    max_acked_step: int
    finalized_through: int
    counters: Counters
    lost_acks: tuple[tuple[int, tuple[Admission, ...]], ...]


@dataclass(frozen=True)
class ControllerStatus:
    policy_version: int
    group_size: int
    buffer: BufferCounts
    capacity: int
    max_in_flight: int
    inflight_samples: int
    pending_prompts: int
    cursor_epoch: int
    cursor_offset: int
    dataset_exhausted: bool
    counters: Counters


class Controller:
    def __init__(
        self,
        config: ControllerConfig,
        engine: GenerationEngine,
        sampler: Sampler,
        *,
        observer: Observer | None = None,
        journal: AckJournal | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.engine = engine
        self.sampler = sampler
        self.observer: Observer = observer or NullObserver()
        self.journal: AckJournal = journal or NullJournal()
        self.clock = clock
        self.barrier = MutationBarrier(on_blocked=self.observer.mutation_blocked)
        self.buffer = RolloutBuffer()
        self.counters = Counters()
        self.policy_version = engine.policy_version
        self.weights_path: str | None = None
        self.next_group_id = 1
        self.max_acked_step = -1
        self.finalized_through = -1
        self.lost_acks: list[tuple[int, list[Admission]]] = []
        """(trainer_step, prompts) of acks journaled for groups no snapshot held (after restore)."""
        self._siblings: dict[int, dict[int, asyncio.Task[None]]] = {}
        self._changed = asyncio.Condition()
        self._loops: list[asyncio.Task[None]] = []
        self._admitting = False
        self._draining = False
        self.fatal: BaseException | None = None
        self._dead = asyncio.Event()

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Starts admission and lease expiry. Call after any restore."""
        self._admitting = True
        self._loops = [
            asyncio.create_task(self._admission_loop(), name="rolloutd-admission"),
            asyncio.create_task(self._lease_reaper(), name="rolloutd-lease-reaper"),
        ]

    async def set_admitting(self, admitting: bool) -> None:
        """Pauses or resumes admission (the service is not ready, or ready again)."""
        self._admitting = admitting and not self._draining and self.fatal is None
        await self._notify()

    async def begin_drain(self) -> None:
        """Stops admission and releases waiting fetches; generation in progress continues."""
        self._admitting, self._draining = False, True
        await self._notify()

    async def stop(self) -> None:
        """Stops admission and generation; staged siblings stay in the buffer. Idempotent."""
        self._admitting = False
        tasks = [t for sibs in self._siblings.values() for t in sibs.values()]
        await self.engine.abort(
            [self._request_id(gid, i) for gid, s in self._siblings.items() for i in s]
        )
        for task in [*self._loops, *tasks]:
            task.cancel()
        await asyncio.gather(*self._loops, *tasks, return_exceptions=True)
        self._loops = []
        await self._notify()

    async def wait_dead(self) -> BaseException:
        """Returns the fatal error once the controller cannot go on (e.g. the engine died)."""
        await self._dead.wait()
        assert self.fatal is not None
        return self.fatal

    # --- admission and generation ----------------------------------------------------------

    def _can_admit(self) -> bool:
        return (
            self._admitting
            and len(self._siblings) < self.config.max_in_flight
            and len(self.buffer.groups) - self.buffer.acked_groups < self.config.buffer_capacity
            and self.sampler.has_next()
        )

    async def _admission_loop(self) -> None:
        while True:
            async with self._changed:
                await self._changed.wait_for(self._can_admit)
            async with self.barrier.mutation(MutationKind.ADMIT):
                if not self._can_admit():
                    continue
                admission = self.sampler.next()
                if admission is None:
                    continue
                group = self._new_group(admission)
                self.buffer.add(group)
                self.counters.admitted_groups += 1
            self.dispatch(group, group.missing)

    def _new_group(self, admission: Admission) -> Group:
        gid = self.next_group_id
        self.next_group_id += 1
        return Group(
            group_id=gid,
            prompt=admission.prompt,
            position=admission.position,
            group_size=self.config.group_size,
            policy_version=self.policy_version,
            admitted_at=self.clock(),
            seed=(self.config.seed * 7_919 + gid * 104_729) % (2**31 - 1),
        )

    @staticmethod
    def _request_id(group_id: int, index: int) -> str:
        return f"g{group_id}-s{index}"

    def dispatch(self, group: Group, indices: list[int]) -> None:
        """Starts one engine request per missing sibling, each with its own seed."""
        tasks = self._siblings.setdefault(group.group_id, {})
        for index in indices:
            tasks[index] = asyncio.create_task(
                self._run_sibling(group, index),
                name=f"rolloutd-{self._request_id(group.group_id, index)}",
            )

    async def _run_sibling(self, group: Group, index: int) -> None:
        request = GenerationRequest(
            request_id=self._request_id(group.group_id, index),
            group_id=group.group_id,
            index=index,
            prompt=group.prompt,
            seed=group.sibling_seed(index),
            params=self.config.sampling,
        )
        for attempt in range(self.config.sibling_retries + 1):
            try:
                sample = await self.engine.generate(request)
                break
            except EngineError as exc:
                log.warning(
                    "sibling %s failed (attempt %d): %s", request.request_id, attempt + 1, exc
                )
                if attempt == self.config.sibling_retries:
                    await self._drop_group(group.group_id, f"engine error: {exc}")
                    return
                await asyncio.sleep(0.1 * 2**attempt)
            except EngineDeadError as exc:
                self._die(exc)
                return
        async with self.barrier.mutation(MutationKind.STAGE_SAMPLE):
            if self.buffer.groups.get(group.group_id) is not group:
                return  # evicted while generating
            self.buffer.stage(group.group_id, sample)
            self._siblings[group.group_id].pop(index, None)
        if group.complete:
            await self._commit(group)

    async def _commit(self, group: Group) -> None:
        async with self.barrier.mutation(MutationKind.COMMIT_GROUP):
            if (
                self.buffer.groups.get(group.group_id) is not group
                or group.state is not GroupState.GENERATING
            ):
                return
            now = self.clock()
            self.buffer.commit(group.group_id, now)
            self._siblings.pop(group.group_id, None)
            tokens = group.generated_tokens
            self.counters.committed_groups += 1
            self.counters.committed_tokens += tokens
        self.observer.group_committed(
            GroupCommitted(group.group_id, tokens, exact=True, completion_s=now - group.admitted_at)
        )
        await self._notify()

    async def _drop_group(self, group_id: int, why: str) -> None:
        async with self.barrier.mutation(MutationKind.EVICT):
            if group_id not in self.buffer.groups:
                return
            await self._cancel_siblings(group_id)
            self.buffer.remove(group_id)
            self.counters.dropped_groups += 1
        log.error("group %d dropped: %s", group_id, why)
        await self._notify()

    async def _cancel_siblings(self, group_id: int) -> None:
        current = asyncio.current_task()
        tasks = self._siblings.pop(group_id, {})
        await self.engine.abort([self._request_id(group_id, i) for i in tasks])
        for task in tasks.values():
            if task is not current:
                task.cancel()

    def _die(self, exc: BaseException) -> None:
        if self.fatal is None:
            log.critical("controller cannot go on: %s", exc)
            self.fatal = exc
            self._admitting = False
            self._dead.set()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # --- trainer-facing operations ---------------------------------------------------------

    def _check_serving(self) -> None:
        if self.fatal is not None:
            raise Unavailable(f"the service failed: {self.fatal}")

    async def fetch(
        self, max_groups: int, wait_ms: int, consumer: str
    ) -> tuple[Lease, list[Group]] | None:
        """Leases up to ``max_groups`` training-ready groups, waiting up to ``wait_ms``."""
        cfg = self.config
        if not 1 <= max_groups <= cfg.max_fetch_groups:
            raise InvalidArgument(
                "max_groups", f"must be between 1 and {cfg.max_fetch_groups}, got {max_groups}"
            )
        if not 0 <= wait_ms <= cfg.max_wait_ms:
            raise InvalidArgument(
                "wait_ms", f"must be between 0 and {cfg.max_wait_ms}, got {wait_ms}"
            )
        if len(consumer) > 256:
            raise InvalidArgument("consumer", "must be at most 256 characters")
        self._check_serving()
        deadline = time.monotonic() + wait_ms / 1000
        while True:
            if self.buffer.ready_count:
                async with self.barrier.mutation(MutationKind.LEASE):
                    now = self.clock()
                    lease = self.buffer.lease(
                        uuid.uuid4().hex, max_groups, consumer, now, cfg.lease_timeout_s
                    )
                    groups = (
                        [] if lease is None else [self.buffer.groups[g] for g in lease.group_ids]
                    )
                if lease is not None:
                    self.observer.groups_leased([now - (g.committed_at or now) for g in groups])
                    return lease, groups
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            async with self._changed:
                try:
                    await asyncio.wait_for(
                        self._changed.wait_for(self._fetch_may_proceed),
                        remaining,
                    )
                except TimeoutError:
                    return None
            self._check_serving()
            if self._draining:
                return None

    def _fetch_may_proceed(self) -> bool:
        return self.buffer.ready_count > 0 or self.fatal is not None or self._draining

    async def ack(self, lease_id: str, trainer_step: int) -> AckResult:
        if not lease_id:
            raise InvalidArgument("lease_id", "must not be empty")
        if trainer_step < 0:
            raise InvalidArgument("trainer_step", f"must be >= 0, got {trainer_step}")
        async with self.barrier.mutation(MutationKind.ACK):
            lease = self.buffer.leases.get(lease_id)
            if lease is not None:
                groups = [self.buffer.groups[g] for g in lease.group_ids]
                record = AckRecord(lease_id, lease.group_ids, trainer_step, self.clock())
                await self.journal.append(record, groups)
            result, already = self.buffer.ack(lease_id, trainer_step, self.clock())
            acked = 0 if result is None else len(result.group_ids)
            if not already:
                self.counters.acked_groups += acked
                self.max_acked_step = max(self.max_acked_step, trainer_step)
        if not already:
            await self._notify()  # acked groups no longer count against the buffer's capacity
            if self.max_acked_step - self.config.rewind_window > self.finalized_through:
                await self.finalize(self.max_acked_step - self.config.rewind_window)
        return AckResult(acked, already)

    async def finalize(self, through_step: int) -> int:
        """Drops groups acked at steps <= ``through_step``; returns how many."""
        async with self.barrier.mutation(MutationKind.FINALIZE):
            dropped = self.buffer.finalize(through_step)
            self.finalized_through = max(self.finalized_through, through_step)
            self.counters.finalized_groups += len(dropped)
        if dropped:
            await self._notify()
        return len(dropped)

    async def rewind(self, trainer_step: int) -> RewindResult:
        if trainer_step < 0:
            raise InvalidArgument("trainer_step", f"must be >= 0, got {trainer_step}")
        if trainer_step < self.finalized_through:
            raise FailedPrecondition(
                f"acks through trainer step {self.finalized_through} are finalized; cannot rewind to "
                f"{trainer_step} (limits.rewind_window={self.config.rewind_window})"
            )
        async with self.barrier.mutation(MutationKind.REQUEUE):
            groups = self.buffer.rewind(trainer_step)
            readmitted = 0
            keep: list[tuple[int, list[Admission]]] = []
            for step, admissions in self.lost_acks:
                if step > trainer_step:
                    for a in admissions:
                        self.sampler.readmit(a)
                    readmitted += len(admissions)
                else:
                    keep.append((step, admissions))
            self.lost_acks = keep
            self.counters.requeued_groups += len(groups)
            self.max_acked_step = min(self.max_acked_step, trainer_step)
        await self._notify()
        return RewindResult(len(groups), readmitted)

    async def _lease_reaper(self) -> None:
        while True:
            await asyncio.sleep(self.config.reap_interval_s)
            expired = self.buffer.expired_leases(self.clock())
            if not expired:
                continue
            async with self.barrier.mutation(MutationKind.REQUEUE):
                for lease in self.buffer.expired_leases(self.clock()):
                    requeued = self.buffer.requeue(lease.lease_id)
                    self.counters.requeued_groups += len(requeued)
                    self.counters.expired_leases += 1
                    log.info(
                        "lease %s of %s expired; %d groups available again",
                        lease.lease_id,
                        lease.consumer or "?",
                        len(requeued),
                    )
            await self._notify()

    async def submit(self, admissions: list[Admission]) -> tuple[int, int]:
        self._check_serving()
        async with self.barrier.mutation(MutationKind.ADMIT):
            accepted, duplicates = self.sampler.submit(a.prompt for a in admissions)
        await self._notify()
        return accepted, duplicates

    async def update_weights(self, version: int, weights_path: str) -> int:
        """Loads new weights, bumps the policy version, evicts groups now too stale."""
        if version <= self.policy_version:
            raise InvalidArgument(
                "version", f"must be greater than the current policy version {self.policy_version}"
            )
        if not weights_path:
            raise InvalidArgument("weights_path", "must not be empty")
        self._check_serving()
        try:
            await self.engine.update_weights(weights_path, version)
        except EngineError as exc:  # refused before anything was loaded (a wrong path)
            raise InvalidArgument("weights_path", str(exc)) from exc
        self.policy_version, self.weights_path = version, weights_path
        return await self.evict_stale()

    async def evict_stale(self) -> int:
        limit = self.policy_version - self.config.max_staleness
        async with self.barrier.mutation(MutationKind.EVICT):
            stale = [
                g
                for g in self.buffer.groups.values()
                if g.policy_version < limit
                and g.state in (GroupState.GENERATING, GroupState.COMMITTED)
            ]
            for g in stale:
                await self._cancel_siblings(g.group_id)
                self.buffer.remove(g.group_id)
                self.sampler.readmit(Admission(g.prompt, g.position))
            self.counters.evicted_groups += len(stale)
        if stale:
            self.observer.groups_evicted(len(stale))
            await self._notify()
        return len(stale)

    # --- snapshots -------------------------------------------------------------------------

    def capture(self) -> ControllerCapture:
        """O(changes since the last capture). Call only while holding the barrier exclusively."""
        if not self.barrier.exclusive_held:
            raise RuntimeError("capture() needs the exclusive hold of the barrier")
        return ControllerCapture(
            buffer=self.buffer.capture(),
            sampler=self.sampler.capture(),
            next_group_id=self.next_group_id,
            policy_version=self.policy_version,
            weights_path=self.weights_path,
            max_acked_step=self.max_acked_step,
            finalized_through=self.finalized_through,
            counters=replace(self.counters),
            lost_acks=tuple((step, tuple(adm)) for step, adm in self.lost_acks),
        )

    def generating_groups(self) -> list[Group]:
        return [g for g in self.buffer.groups.values() if g.state is GroupState.GENERATING]

    async def resume_group(self, group: Group, *, rerun_all: bool) -> list[int]:
        """After a restore: generate a group's missing siblings (or all of them); returns them."""
        if rerun_all and group.samples:
            async with self.barrier.mutation(MutationKind.RESTORE):
                self.buffer.drop_samples(group.group_id)
        missing = group.missing
        if not missing:
            await self._commit(group)
        else:
            self.dispatch(group, missing)
        return missing

    # --- introspection ---------------------------------------------------------------------

    @property
    def inflight_samples(self) -> int:
        return sum(len(s) for s in self._siblings.values())

    def status(self) -> ControllerStatus:
        cursor = self.sampler.cursor
        return ControllerStatus(
            policy_version=self.policy_version,
            group_size=self.config.group_size,
            buffer=self.buffer.counts(),
            capacity=self.config.buffer_capacity,
            max_in_flight=self.config.max_in_flight,
            inflight_samples=self.inflight_samples,
            pending_prompts=self.sampler.pending,
            cursor_epoch=cursor.epoch,
            cursor_offset=cursor.offset,
            dataset_exhausted=self.sampler.exhausted,
            counters=self.counters,
        )
