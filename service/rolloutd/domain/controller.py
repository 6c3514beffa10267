"""The controller: admits prompts, dispatches siblings, commits groups, leases and acknowledges them.

Background loops (one task each): admission and lease expiry. Every change to the buffer or the
sampler happens inside a barrier mutation of one kind, so a checkpoint's exclusive hold sees a
consistent cut. Generation and weight updates run outside mutations; aborting the siblings of a
group being dropped or evicted happens inside one (the engine only cancels requests there).

Persistent state goes in and out in one value (:class:`ControllerState`): ``capture()`` under the
checkpoint's exclusive hold, ``restore(state)`` before ``start()``, then ``replay(events)`` of what
the journal holds after that snapshot. Acks, live or replayed, take one path (``_apply_ack``).

What a client is told is journaled before it is told (DESIGN.md §2): acks, lease grants and
accepted submissions, each inside its mutation so that a snapshot's journal position and its cut
agree. Group ids are reserved in blocks in the journal before they are handed out, so a restore
never issues one again; the replica is part of every id, so ids are unique across the fleet.

Delivery contract (DESIGN.md §2): an ack is durable (journaled) before ``ack`` returns and is
idempotent; ``finalize(step)`` drops groups acked at steps <= step; ``rewind(step)`` makes groups
acked after ``step`` available again; acks older than ``rewind_window`` steps finalize by themselves.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from rolloutd.domain.barrier import MutationBarrier
from rolloutd.domain.buffer import (
    AckRecord,
    BufferCounts,
    Lease,
    RolloutBuffer,
    RowSealer,
    check_same_step,
    restored_groups,
)
from rolloutd.domain.engine import (
    EngineDeadError,
    EngineError,
    GenerationEngine,
    GenerationRequest,
    SamplingParams,
)
from rolloutd.domain.errors import (
    FailedPrecondition,
    InvalidArgument,
    InvariantError,
    NotFound,
    RestoreRefused,
    Unavailable,
)
from rolloutd.domain.group import Group, GroupMeta, GroupState
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.observer import GenerationStarted, GroupCommitted, NullObserver, Observer
from rolloutd.domain.partial import PartialSibling, TokenDelta
from rolloutd.domain.sampler import Admission, Sampler
from rolloutd.domain.state import (
    ControllerState,
    Counters,
    DeliveryJournal,
    IdReservation,
    Journaled,
    JournaledAck,
    JournaledLease,
    JournaledSubmission,
    LostAck,
    LostLease,
    NullJournal,
)
from rolloutd.domain.weights import WeightsTimeline

log = logging.getLogger(__name__)

ID_BITS = 40
"""Low bits of a group id count within a replica; the bits above are the replica's index, so ids
are unique across a fleet (replica 0's ids are the plain counter)."""
ID_BLOCK = 1024
"""Group ids reserved in the journal at a time: one durable write per this many admissions."""


def local_id(group_id: int) -> int:
    """The replica-local counter of a group id."""
    return group_id & ((1 << ID_BITS) - 1)


@dataclass(frozen=True)
class ControllerConfig:
    """The controller's settings; ``config.py`` exposes them as keys (``limits.*``,
    ``group_size``) with these defaults and meanings."""

    group_size: int = 4
    """Siblings per prompt (N in GRPO)."""
    max_in_flight: int = 16
    """Most groups generating at once."""
    buffer_capacity: int = 256
    """Most groups generating, ready or leased. Acked groups waiting for finalization are not
    counted (else a trainer could stall admission for good); ``rewind_window`` bounds them."""
    max_staleness: int = 4
    """Groups more than this many policy versions old are evicted."""
    lease_timeout_s: float = 300.0
    """An unacknowledged lease expires after this long and its groups become available again."""
    rewind_window: int = 8
    """Acked groups wait at most this many trainer steps for Checkpoint before finalizing."""
    max_fetch_groups: int = 1024
    """Largest max_groups a FetchGroups request may ask for."""
    max_wait_ms: int = 600_000
    """Longest wait_ms a FetchGroups request may ask for."""
    seed: int = 0
    """Root of every group's and sibling's seed."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
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


@dataclass(frozen=True)
class Resumption:
    """What ``resume_group`` did with one unfinished group after a restore."""

    rerun: list[int]
    """Siblings generated (again or continued)."""
    continued: list[int]
    """Of those, the ones continued from their partial tokens."""
    reused_tokens: int
    """Partial tokens continued from."""
    regenerated_tokens: int
    """Partial tokens the snapshot held but that are generated again."""


@dataclass(eq=False)
class _PendingAck:
    """An ack between its journal record being queued and being applied."""

    ack: JournaledAck
    durable: asyncio.Future[int]
    """Resolves once the record is durable (the journal's position covers it)."""


@dataclass(frozen=True)
class AckResult:
    acked_groups: int
    already_acked: bool


@dataclass(frozen=True)
class RewindResult:
    redelivered_groups: int
    readmitted_prompts: int


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
    replica: int
    replicas: int
    trainer_step: int = -1
    """The highest trainer step acked (lowered by a Rewind); -1 before the first ack."""


class Controller:
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
    ) -> None:
        self.config = config
        self.engine = engine
        self.sampler = sampler
        self.observer: Observer = observer or NullObserver()
        self.journal: DeliveryJournal = journal or NullJournal()
        self.clock = clock
        self.barrier = MutationBarrier(on_blocked=self.observer.mutation_blocked)
        self.buffer = RolloutBuffer(sealer)
        self.counters = Counters()
        self.policy_version = engine.policy_version
        self.weights_path: str | None = None
        self.next_group_id = 1
        """The replica-local counter of the next group id (see :data:`ID_BITS`)."""
        self.ids_reserved_through = 0
        """Local ids up to this one are journaled as reserved and may be issued."""
        self._lost_leased: dict[str, dict[int, Admission]] = {}
        """Live leases restored from the journal whose groups no snapshot held, by lease id: the
        admissions of those groups, skipped by the sampler until the lease is acked or expires."""
        self.max_acked_step = -1
        self._told_step_went_back = False
        self.finalized_through = -1
        self.lost_acks: list[LostAck] = []
        """Acks journaled for groups no snapshot held (found by a restore)."""
        self._siblings: dict[int, dict[int, asyncio.Task[None]]] = {}
        self._trace_headers: dict[int, Mapping[str, str]] = {}
        """Trace context of each group whose generation the observer was told about."""
        self._staging: dict[tuple[int, int], list[TokenDelta]] = {}
        """(group id, index) -> the deltas of a generating sibling so far, its restored prefix
        first. Append-only while the sibling generates; removed in the mutation that stages the
        sibling's sample or drops its group, so a capture never holds both."""
        self._resumable: dict[tuple[int, int], PartialSibling] = {}
        """Partial siblings a restore found, until ``resume_group`` continues or discards them."""
        self._changed = asyncio.Condition()
        """Admission waits on it for room; every change notifies it."""
        self._fetchable = asyncio.Condition()
        """Fetches wait on it for ready groups: a change wakes as many of them as there are
        ready groups (all of them when draining or failed), not every waiting trainer."""
        self._loops: list[asyncio.Task[None]] = []
        self._admitting = False
        self._draining = False
        self._acking: dict[str, _PendingAck] = {}
        """Acks queued for the journal and not applied yet, by lease id."""
        self._orphans: set[asyncio.Future[None]] = set()
        """Settlements of acks whose callers went away, kept until done."""
        self._submitting = asyncio.Lock()
        """Serialises submissions: check, journal, accept, with no other in between."""
        self.fatal: BaseException | None = None
        self._dead = asyncio.Event()

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Starts admission and lease expiry. Call after any restore."""
        self._admitting = True
        self._loops = [
            self._watched(asyncio.create_task(self._admission_loop(), name="rolloutd-admission")),
            self._watched(asyncio.create_task(self._lease_reaper(), name="rolloutd-lease-reaper")),
        ]

    async def set_admitting(self, admitting: bool) -> None:
        """Pauses or resumes admission (the service is not ready, or ready again)."""
        self._admitting = admitting and not self._draining and self.fatal is None
        await self._notify()

    async def begin_drain(self) -> None:
        """Stops admission and answers waiting fetches ``Unavailable`` (a trainer must tell
        "shutting down" from "nothing ready" to retry elsewhere); generation continues."""
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
            if self.next_group_id > self.ids_reserved_through:
                try:
                    await self._reserve_ids()
                except OSError as exc:
                    log.error("cannot reserve group ids in the journal: %s; retrying", exc)
                    await asyncio.sleep(1.0)
                    continue
            async with self.barrier.mutation(MutationKind.ADMIT):
                if not self._can_admit() or self.next_group_id > self.ids_reserved_through:
                    continue
                admission = self.sampler.next()
                if admission is None:
                    continue
                group = self._new_group(admission)
                self.buffer.add(group)
                self.counters.admitted_groups += 1
            self.dispatch(group, group.missing)

    async def _reserve_ids(self) -> None:
        """Journals the next block of ids before any of it is handed out."""
        through = self.next_group_id + ID_BLOCK - 1
        await self.journal.reserve_ids(through)
        self.ids_reserved_through = through

    def _new_group(self, admission: Admission) -> Group:
        if self.next_group_id > self.ids_reserved_through:
            raise InvariantError(f"group id {self.next_group_id} issued before it was reserved")
        gid = (self.config.replica << ID_BITS) | self.next_group_id
        self.next_group_id += 1
        return Group(
            GroupMeta(
                group_id=gid,
                prompt=admission.prompt,
                position=admission.position,
                group_size=self.config.group_size,
                policy_version=self.policy_version,
                admitted_at=self.clock(),
                seed=(self.config.seed * 7_919 + gid * 104_729) % (2**31 - 1),
            )
        )

    @staticmethod
    def _request_id(group_id: int, index: int) -> str:
        return f"g{group_id}-s{index}"

    def dispatch(
        self,
        group: Group,
        indices: list[int],
        prefixes: Mapping[int, PartialSibling] | None = None,
    ) -> None:
        """Starts one engine request per missing sibling, each with its own seed; a sibling with
        a prefix in ``prefixes`` continues from it."""
        if group.group_id not in self._trace_headers:
            p = self.config.sampling
            self._trace_headers[group.group_id] = self.observer.generation_started(
                GenerationStarted(
                    group.group_id,
                    group.meta.prompt.prompt_id,
                    group.meta.group_size,
                    group.meta.admitted_at,
                    p.max_tokens,
                    p.temperature,
                    p.top_p,
                )
            )
        tasks = self._siblings.setdefault(group.group_id, {})
        for index in indices:
            if self.config.capture_partials:
                # Staged now, not when the task first runs, so that a checkpoint taken meanwhile
                # still holds a restored prefix.
                prefix = (prefixes or {}).get(index)
                self._staging[(group.group_id, index)] = list(prefix.deltas) if prefix else []
            tasks[index] = self._watched(
                asyncio.create_task(
                    self._run_sibling(group, index, (prefixes or {}).get(index)),
                    name=f"rolloutd-{self._request_id(group.group_id, index)}",
                )
            )

    async def _run_sibling(
        self, group: Group, index: int, prefix: PartialSibling | None = None
    ) -> None:
        request = GenerationRequest(
            request_id=self._request_id(group.group_id, index),
            group_id=group.group_id,
            index=index,
            prompt=group.meta.prompt,
            seed=group.meta.sibling_seed(index),
            params=self.config.sampling,
            trace_headers=self._trace_headers.get(group.group_id, {}),
            prefix=prefix,
        )
        key = (group.group_id, index)
        for attempt in range(self.config.sibling_retries + 1):
            on_delta = None
            if self.config.capture_partials:
                if attempt:  # a retry starts again from the prefix: a failed attempt's tokens go
                    self._staging[key] = list(prefix.deltas) if prefix else []
                on_delta = self._staging[key].append
            try:
                sample = await self.engine.generate(request, on_delta)
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
            self._staging.pop(key, None)
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
            # read before the commit: it may seal the rows, and reading them would decode them
            tokens = group.generated_tokens
            prompt_tokens = len(group.samples[0].prompt_token_ids)
            self.buffer.commit(group.group_id, now)
            self._siblings.pop(group.group_id, None)
            self.counters.committed_groups += 1
            self.counters.committed_tokens += tokens
        self._trace_headers.pop(group.group_id, None)
        self.observer.group_committed(
            GroupCommitted(
                group.group_id,
                tokens,
                exact=True,
                completion_s=now - group.meta.admitted_at,
                prompt_tokens=prompt_tokens,
                group_size=group.meta.group_size,
            )
        )
        await self._notify()

    async def _drop_group(self, group_id: int, why: str) -> None:
        async with self.barrier.mutation(MutationKind.EVICT):
            if group_id not in self.buffer.groups:
                return
            await self._cancel_siblings(group_id)
            self.buffer.remove(group_id)
            self.counters.dropped_groups += 1
        self._abandoned(group_id, why)
        log.error("group %d dropped: %s", group_id, why)
        await self._notify()

    async def _cancel_siblings(self, group_id: int) -> None:
        current = asyncio.current_task()
        tasks = self._siblings.pop(group_id, {})
        for index in tasks:
            self._staging.pop((group_id, index), None)
        await self.engine.abort([self._request_id(group_id, i) for i in tasks])
        for task in tasks.values():
            if task is not current:
                task.cancel()

    def _abandoned(self, group_id: int, reason: str) -> None:
        if self._trace_headers.pop(group_id, None) is not None:
            self.observer.generation_abandoned(group_id, reason)

    def _watched(self, task: asyncio.Task[None]) -> asyncio.Task[None]:
        """A task of the controller whose unexpected error ends the controller (never silently:
        the service waits on :meth:`wait_dead`)."""

        def ended(t: asyncio.Task[None]) -> None:
            if not t.cancelled() and t.exception() is not None:
                self._die(t.exception())  # type: ignore[arg-type]

        task.add_done_callback(ended)
        return task

    def _die(self, exc: BaseException) -> None:
        if self.fatal is None:
            log.critical("controller cannot go on: %s", exc)
            self.fatal = exc
            self._admitting = False
            self._dead.set()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()
        async with self._fetchable:
            if self._draining or self.fatal is not None:
                self._fetchable.notify_all()
            else:
                self._fetchable.notify(self.buffer.ready_count)

    # --- trainer-facing operations ---------------------------------------------------------

    def _check_serving(self) -> None:
        if self.fatal is not None:
            raise Unavailable(f"the service failed: {self.fatal}")
        if self._draining:
            raise Unavailable("the service is draining (shutting down); fetch from another replica")

    async def fetch(
        self, max_groups: int, wait_ms: int, consumer: str
    ) -> tuple[Lease, list[Group]] | None:
        """Leases up to ``max_groups`` training-ready groups, waiting up to ``wait_ms``.

        The grant is journaled before it is returned, but the LEASE mutation only queues the
        record: a checkpoint may capture the grant while it syncs. Replay grants it again when
        the record is durable; when the sync fails the groups are requeued and the call fails
        ``Unavailable``, and a snapshot captured in between holds a grant nobody received,
        which after a restart from it expires like any unacked lease (its groups come back
        after ``lease_timeout_s``; none is lost or delivered twice).
        """
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
                        durable = self.journal.lease(lease, self._admissions(lease.group_ids))
                if lease is not None:
                    try:
                        await durable
                    except OSError as exc:
                        async with self.barrier.mutation(MutationKind.REQUEUE):
                            if lease.lease_id in self.buffer.leases:
                                self.buffer.requeue(lease.lease_id)
                        await self._notify()
                        raise Unavailable(f"the lease could not be made durable: {exc}") from exc
                    self.observer.groups_leased(
                        [now - (g.meta.committed_at or now) for g in groups],
                        [self.policy_version - g.policy_version for g in groups],
                    )
                    return lease, groups
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            async with self._fetchable:
                try:
                    await asyncio.wait_for(
                        self._fetchable.wait_for(self._fetch_may_proceed),
                        remaining,
                    )
                except TimeoutError:
                    return None
            self._check_serving()

    def _admissions(self, group_ids: Iterable[int]) -> dict[int, Admission]:
        """What a journal record keeps of each group: enough to never admit it again."""
        return {
            gid: Admission(g.meta.prompt, g.meta.position)
            for gid in group_ids
            for g in (self.buffer.groups[gid],)
        }

    def _fetch_may_proceed(self) -> bool:
        return self.buffer.ready_count > 0 or self.fatal is not None or self._draining

    async def ack(self, lease_id: str, trainer_step: int) -> AckResult:
        """Consumes a lease at ``trainer_step``; durable (journaled) before it returns, and
        idempotent: acking a lease acked before (also before a restart) succeeds again.

        The record is queued for the journal inside the ACK mutation, but the mutation does not
        wait for the sync: a checkpoint may come in between. The ack is applied once durable,
        by :meth:`_settle_ack` or by the capture of a checkpoint that finds it durable first
        (:meth:`_apply_durable_acks`), so a snapshot holds an ack exactly when its
        ``acks_through`` covers the record. A failed sync applies nothing: the lease stays
        granted and the call fails ``Unavailable``, to be retried. A second ack of the lease
        while the first is pending waits for the same record.
        """
        if not lease_id:
            raise InvalidArgument("lease_id", "must not be empty")
        if trainer_step < 0:
            raise InvalidArgument("trainer_step", f"must be >= 0, got {trainer_step}")
        async with self.barrier.mutation(MutationKind.ACK):
            known = self.buffer.acks.get(lease_id)
            if known is not None:
                check_same_step(lease_id, known.trainer_step, trainer_step)
                return AckResult(len(known.group_ids), already_acked=True)
            if lease_id in self.buffer.finalized_leases:
                check_same_step(lease_id, self.buffer.finalized_leases[lease_id], trainer_step)
                return AckResult(0, already_acked=True)
            pending = self._acking.get(lease_id)
            if pending is not None:
                check_same_step(lease_id, pending.ack.record.trainer_step, trainer_step)
            else:
                lease = self.buffer.leases.get(lease_id)
                if lease is None:
                    raise NotFound(f"lease {lease_id!r} is unknown or expired")
                if trainer_step < self.max_acked_step and not self._told_step_went_back:
                    self._told_step_went_back = True  # once until a Rewind: trainers may lag
                    log.warning(
                        "ack at trainer step %d, below step %d acked before: a trainer restarted "
                        "from its checkpoint S calls Rewind(trainer_step=S) before fetching, or "
                        "the groups it acked after S are not delivered again (trainers whose "
                        "steps lag one another's can ignore this; said once until a Rewind)",
                        trainer_step,
                        self.max_acked_step,
                    )
                lost = self._lost_leased.get(lease_id, {})
                record = AckRecord(
                    lease_id, lease.group_ids + tuple(lost), trainer_step, self.clock()
                )
                admissions = {**self._admissions(lease.group_ids), **lost}
                pending = _PendingAck(
                    JournaledAck(record, lost), self.journal.ack(record, admissions)
                )
                self._acking[lease_id] = pending
        try:
            await self._settle_ack(pending)
        except asyncio.CancelledError:
            # the caller went away: a durable ack is applied all the same
            orphan = asyncio.ensure_future(self._settle_ack(pending))
            self._orphans.add(orphan)
            orphan.add_done_callback(self._orphans.discard)
            raise
        await self._notify()  # acked groups no longer count against the buffer's capacity
        through = max(self.max_acked_step - self.config.rewind_window, self.finalized_through)
        if through > self.finalized_through or trainer_step <= self.finalized_through:
            # the window moved on, or this ack is below it (a trainer whose steps lag another's):
            # no rewind can reach it, so it must not wait in the buffer for the window
            await self.finalize(through)
        return AckResult(len(pending.ack.record.group_ids), already_acked=False)

    async def _settle_ack(self, pending: _PendingAck) -> None:
        """Waits for the ack's record outside the barrier, then applies it (once, whoever of
        its callers or a capture comes first)."""
        lease_id = pending.ack.record.lease_id
        try:
            await asyncio.shield(pending.durable)  # shared by every caller of this ack
        except OSError as exc:
            if self._acking.get(lease_id) is pending:
                del self._acking[lease_id]
            raise Unavailable(f"the ack could not be made durable: {exc}") from exc
        async with self.barrier.mutation(MutationKind.ACK):
            self._apply_pending_ack(pending)

    def _apply_pending_ack(self, pending: _PendingAck) -> None:
        """Applies a durable ack once (inside an ACK mutation or the exclusive hold)."""
        lease_id = pending.ack.record.lease_id
        if self._acking.get(lease_id) is not pending:
            return  # a capture applied it already
        del self._acking[lease_id]
        self._lost_leased.pop(lease_id, None)
        self._apply_ack(pending.ack)

    def _apply_durable_acks(self) -> None:
        """Under the exclusive hold, before a capture: applies every ack whose record the
        journal's position already covers, so the snapshot agrees with its ``acks_through``.
        Acks still syncing are left to :meth:`_settle_ack` and to replay."""
        for pending in list(self._acking.values()):
            durable = pending.durable
            if durable.done() and not durable.cancelled() and durable.exception() is None:
                self._apply_pending_ack(pending)

    def _apply_ack(self, ack: JournaledAck) -> None:
        """The one ack path, live and in journal replay; inside an ACK or RESTORE mutation.

        Groups of the ack that the buffer does not hold (admitted and acked after the snapshot
        a restore started from) are never admitted again, but remembered so that a ``Rewind``
        to before the ack re-admits them.
        """
        record = ack.record
        lost = self.buffer.ack(record)
        if lost is None:
            return  # acked already: idempotent
        self.counters.acked_groups += len(record.group_ids)
        self.max_acked_step = max(self.max_acked_step, record.trainer_step)
        if lost:
            if not ack.admissions:
                raise InvariantError(f"live ack of lease {record.lease_id} lost groups {lost}")
            admissions = tuple(ack.admissions[gid] for gid in lost)
            for admission in admissions:
                self.sampler.skip(admission)
            self.lost_acks.append(LostAck(record.trainer_step, admissions))

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
            keep: list[LostAck] = []
            for lost in self.lost_acks:
                if lost.trainer_step > trainer_step:
                    for a in lost.admissions:
                        self.sampler.readmit(a)
                    readmitted += len(lost.admissions)
                else:
                    keep.append(lost)
            self.lost_acks = keep
            self.counters.requeued_groups += len(groups)
            self.max_acked_step = min(self.max_acked_step, trainer_step)
            self._told_step_went_back = False
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
                    for admission in self._lost_leased.pop(lease.lease_id, {}).values():
                        self.sampler.unskip(admission)
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
        """Queues trainer-supplied prompts; the accepted ones are journaled (durable) before
        this returns, and a prompt id accepted before, also before a restart, is a duplicate."""
        self._check_serving()
        prompts = [a.prompt for a in admissions]
        async with self._submitting, self.barrier.mutation(MutationKind.ADMIT):
            fresh = self.sampler.fresh(prompts)
            if fresh:
                try:
                    await self.journal.submit(fresh)
                except OSError as exc:
                    raise Unavailable(f"the prompts could not be made durable: {exc}") from exc
            accepted, duplicates = self.sampler.submit(prompts)
        await self._notify()
        return accepted, duplicates

    async def update_weights(
        self, version: int, weights_path: str, *, timeline: WeightsTimeline | None = None
    ) -> int:
        """Loads new weights, bumps the policy version, evicts groups now too stale.

        An engine that fails while loading may hold a mix of old and new weights: the controller
        then stops (not ready) rather than generate from them.
        """
        if version <= self.policy_version:
            raise InvalidArgument(
                "version", f"must be greater than the current policy version {self.policy_version}"
            )
        if not weights_path:
            raise InvalidArgument("weights_path", "must not be empty")
        self._check_serving()
        try:
            await self.engine.update_weights(weights_path, version, timeline=timeline)
        except EngineDeadError as exc:
            self._die(exc)
            raise Unavailable(f"the service is not ready: {exc}") from exc
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
                if g.policy_version < limit  # not g.meta: a restored group's stays undecoded
                and g.state in (GroupState.GENERATING, GroupState.COMMITTED)
            ]
            for g in stale:
                self._abandoned(g.group_id, "evicted: too stale")
                await self._cancel_siblings(g.group_id)
                self.buffer.remove(g.group_id)
                self.sampler.readmit(Admission(g.meta.prompt, g.meta.position))
            self.counters.evicted_groups += len(stale)
        if stale:
            self.observer.groups_evicted(len(stale))
            await self._notify()
        return len(stale)

    # --- persistent state ------------------------------------------------------------------

    def capture(self) -> ControllerState:
        """The changes since the last capture and the rest of the state, no I/O: pointer work
        proportional to the changed rows and groups, plus copies of the lease and ack tables and
        of the sampler's queues (bounded by leases and acks outstanding, not by the buffer), plus
        one reference and one length per generating sibling (its partial tokens, whole).
        Call only while holding the barrier exclusively."""
        if not self.barrier.exclusive_held:
            raise RuntimeError("capture() needs the exclusive hold of the barrier")
        self._apply_durable_acks()
        return ControllerState(
            buffer=self.buffer.capture(),
            sampler=self.sampler.capture(),
            counters=replace(self.counters),
            # the next id a restore may issue: past every id that may have been handed out
            next_group_id=max(self.next_group_id, self.ids_reserved_through + 1),
            policy_version=self.policy_version,
            weights_path=self.weights_path,
            max_acked_step=self.max_acked_step,
            finalized_through=self.finalized_through,
            lost_acks=tuple(self.lost_acks),
            lost_leases=tuple(
                LostLease(lease_id, tuple(lost), tuple(lost.values()))
                for lease_id, lost in self._lost_leased.items()
            ),
            partials=tuple(
                PartialSibling(gid, index, chunks, len(chunks))
                for (gid, index), chunks in self._staging.items()
                if chunks
            ),
        )

    def capture_failed(self, state: ControllerState) -> None:
        """Hands back a capture whose snapshot failed, so the next capture includes it."""
        self.buffer.restore_uncaptured(state.buffer)

    def retained_from_step(self, state: ControllerState) -> int:
        """Snapshots tagged with an older trainer step than this are no longer needed: a
        ``Rewind`` cannot go back further than the rewind window."""
        return state.max_acked_step - self.config.rewind_window

    def prepare_restore(self, state: ControllerState) -> RolloutBuffer:
        """The buffer of ``state``, built apart from this controller, so that a restore builds it
        while the snapshot's rows are still being read and verified (the state holds none of
        them yet: :meth:`RolloutBuffer.keep_rows` gives them once they verify, then
        :meth:`restore`). Touches nothing here.

        Raises :class:`RestoreRefused` when the sampler's cursor is not ahead of every group's
        position (admission would create a second group for a buffered position).
        """
        cursor = state.sampler.cursor
        groups = restored_groups(state.buffer.groups)
        ahead = sorted(map(str, groups.positions_from(cursor.epoch, cursor.offset)))
        if ahead:
            raise RestoreRefused(
                f"sampler cursor {cursor} is not ahead of restored group positions "
                + ", ".join(ahead[:10])
                + (" ..." if len(ahead) > 10 else "")
            )
        buffer = RolloutBuffer(self.buffer.sealer)
        buffer.load(replace(state.buffer, groups=groups))
        return buffer

    async def restore(self, state: ControllerState, prepared: RolloutBuffer | None = None) -> None:
        """Rebuilds the controller from a whole state, before ``start()``: its buffer is
        ``prepared`` (from :meth:`prepare_restore`, its kept rows given) or built here from
        ``state`` alone.

        Raises :class:`RestoreRefused` as :meth:`prepare_restore` does. Leases that have not
        expired stay granted (their ack succeeds after the restart); the groups of expired ones
        become available again. The engine gets the state's weights when it is behind them.
        """
        if self.buffer.groups:
            raise InvariantError("restore into a non-empty buffer")
        if prepared is None:
            prepared = self.prepare_restore(state)
        async with self.barrier.mutation(MutationKind.RESTORE):
            self.sampler.restore(state.sampler)
            self.buffer = prepared
            self.counters = replace(state.counters)
            self.next_group_id = state.next_group_id
            self.max_acked_step = state.max_acked_step
            self.finalized_through = state.finalized_through
            self.lost_acks = list(state.lost_acks)
            self._lost_leased = {
                lost.lease_id: dict(zip(lost.group_ids, lost.admissions, strict=True))
                for lost in state.lost_leases
            }
            for lease in self.buffer.expired_leases(self.clock()):
                for admission in self._lost_leased.pop(lease.lease_id, {}).values():
                    self.sampler.unskip(admission)
                self.buffer.requeue(lease.lease_id)
            self._resumable = {(p.group_id, p.index): p for p in state.partials}
        if state.weights_path and state.policy_version > self.engine.policy_version:
            await self.engine.update_weights(state.weights_path, state.policy_version)
        self.policy_version, self.weights_path = state.policy_version, state.weights_path

    async def replay(self, events: Iterable[Journaled]) -> None:
        """Applies what was journaled after the restored snapshot (or into an empty controller
        when there is none), in journal order:

        * an ack goes through the one ack path;
        * a lease grant that has not expired is granted again: its groups the buffer holds are
          leased to it, and the prompts of those it does not hold (admitted after the snapshot)
          are kept from admission until the lease is acked or expires;
        * accepted prompts are queued again (duplicates by id are ignored);
        * the id counter moves past every reserved and every journaled id.
        """
        now = self.clock()
        async with self.barrier.mutation(MutationKind.RESTORE):
            for event in events:
                if isinstance(event, IdReservation):
                    self.next_group_id = max(self.next_group_id, event.through + 1)
                elif isinstance(event, JournaledSubmission):
                    self.sampler.submit(event.prompts, bounded=False)
                elif isinstance(event, JournaledLease):
                    self._bump_ids(event.lease.group_ids)
                    if event.lease.expires_at > now:
                        self._regrant(event)
                else:
                    self._bump_ids(event.record.group_ids)
                    self._lost_leased.pop(event.record.lease_id, None)
                    self._apply_ack(event)

    def _bump_ids(self, group_ids: Iterable[int]) -> None:
        mine = [local_id(g) for g in group_ids if g >> ID_BITS == self.config.replica]
        if mine:
            self.next_group_id = max(self.next_group_id, max(mine) + 1)

    def _regrant(self, event: JournaledLease) -> None:
        """A live lease from the journal, granted again (inside the RESTORE mutation)."""
        lease = event.lease
        if lease.lease_id in self.buffer.acks or lease.lease_id in self.buffer.finalized_leases:
            return
        if lease.lease_id in self.buffer.leases:
            self.buffer.requeue(lease.lease_id)
        held = tuple(
            g
            for g in lease.group_ids
            if g in self.buffer.groups and self.buffer.groups[g].state is GroupState.COMMITTED
        )
        for gid in lease.group_ids:
            g = self.buffer.groups.get(gid)
            if g is not None and g.state is GroupState.GENERATING:
                self.buffer.remove(gid)  # finished and leased after the snapshot: gone
        lost = {g: event.admissions[g] for g in lease.group_ids if g not in held}
        for admission in lost.values():
            self.sampler.skip(admission)
        self.buffer.grant(replace(lease, group_ids=held))
        if lost:
            self._lost_leased[lease.lease_id] = lost

    def generating_groups(self, among: Iterable[int] | None = None) -> list[Group]:
        """Groups being generated; of ``among`` when given (ids to look at instead of every
        group: a restore knows which were generating without asking each group)."""
        groups = self.buffer.groups
        candidates = groups.values() if among is None else (groups[g] for g in among if g in groups)
        return [g for g in candidates if g.state is GroupState.GENERATING]

    async def resume_group(
        self, group: Group, *, rerun_all: bool, from_tokens: bool = False
    ) -> Resumption:
        """After a restore: generate a group's missing siblings (or all of them). With
        ``from_tokens`` a missing sibling whose partial tokens the snapshot held continues from
        them; otherwise they are discarded and the sibling starts again."""
        if rerun_all and group.samples:
            async with self.barrier.mutation(MutationKind.RESTORE):
                self.buffer.drop_samples(group.group_id)
        missing = group.missing
        found = {
            i: self._resumable.pop((group.group_id, i), None) for i in range(group.meta.group_size)
        }
        partials = {i: p for i, p in found.items() if p is not None}
        prefixes = {i: p for i, p in partials.items() if from_tokens and i in missing}
        if not missing:
            await self._commit(group)
        else:
            self.dispatch(group, missing, prefixes)
        held = sum(len(p) for p in partials.values())
        reused = sum(len(p) for p in prefixes.values())
        return Resumption(missing, sorted(prefixes), reused, held - reused)

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
            replica=self.config.replica,
            replicas=self.config.replicas,
            trainer_step=self.max_acked_step,
        )
