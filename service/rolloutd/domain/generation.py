"""Generation: admission, dispatch of siblings to the sibling runner, the finishing stage, commit.

One background loop admits prompts while there is room. Each admitted group's siblings run as
tasks of their own (each its own engine request and seed, through the :class:`SiblingRunner`),
so siblings finish independently and a restart reuses each finished one. The task that stages
a group's last sibling moves the group to FINISHING in the same mutation and then asks the
:class:`FinishingStage` for a verdict outside the barrier; the verdict commits or drops the group
in a mutation of its own. Weight updates and eviction of stale groups are here too: they decide
what is generated next.

Every change to the buffer or the sampler happens inside a barrier mutation of one kind, so a
checkpoint's exclusive hold sees a consistent cut. Aborting the siblings of a group being
dropped or evicted happens inside one (the engine only cancels requests there).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

from rolloutd.domain.concurrency import EngineReading, InFlightLimit
from rolloutd.domain.core import Core
from rolloutd.domain.engine import (
    DeltaSink,
    EngineDeadError,
    EngineError,
    GenerationRequest,
    RequestRefused,
)
from rolloutd.domain.episode_log import EpisodeLog, EpisodeRecord, GroupAdmission
from rolloutd.domain.errors import InvalidArgument, InvariantError, Unavailable
from rolloutd.domain.fate import ENGINE_ERROR, REFUSED, STAGE_FAILED, EngineState
from rolloutd.domain.finishing import CommitAll, FinishingGroup, FinishingStage, Verdict
from rolloutd.domain.group import Group, GroupMeta, GroupScores, GroupState, Sample
from rolloutd.domain.ids import ID_BITS, ID_BLOCK, request_id
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.observer import (
    GenerationStarted,
    GroupCommitted,
    GroupDropped,
    GroupFinished,
)
from rolloutd.domain.partial import PartialSibling, TokenDelta, delta_tokens
from rolloutd.domain.runner import EngineRunner, SiblingJob, SiblingRunner
from rolloutd.domain.sampler import Admission
from rolloutd.domain.spec import EMPTY, resolve
from rolloutd.domain.state import JournaledDrop
from rolloutd.domain.weights import WeightsTimeline

log = logging.getLogger(__name__)


class Generation:
    """Admits groups, runs their siblings and finishes them; see the module docstring."""

    def __init__(
        self,
        core: Core,
        runner: SiblingRunner | None = None,
        stage: FinishingStage | None = None,
    ) -> None:
        self.core = core
        self.runner: SiblingRunner = runner or EngineRunner()
        self.stage: FinishingStage = stage or CommitAll()
        self.siblings: dict[int, dict[int, asyncio.Task[None]]] = {}
        """Groups in flight (generating or finishing) -> their siblings still running."""
        self._finishing: dict[int, asyncio.Task[None]] = {}
        """Groups whose finishing stage runs -> the task that runs it."""
        self._trace_headers: dict[int, Mapping[str, str]] = {}
        """Trace context of each group whose generation the observer was told about."""
        self.limit = InFlightLimit(core.config.max_in_flight, core.config.concurrency)
        """How many groups may be in flight: fixed, or following the engine."""
        self.departed = 0
        """Groups that left flight (committed, dropped, evicted) since the controller started."""
        self.episodes: dict[tuple[int, int], EpisodeLog] = {}
        """(group id, index) -> the episode records of a generating sibling (a restore's first)
        and its current turn's tokens; kept and removed as its staged tokens are."""
        self.durable_turns = True
        """Whether episode records are journaled (``episodes.durable_turns``)."""
        self._updating = False
        """The engine is loading new weights."""
        core.engine_state = self.engine_state

    def engine_state(self) -> EngineState:
        """What the engine does right now (domain/fate.py)."""
        if self._updating:
            return EngineState.WEIGHT_UPDATE
        if any(self.siblings.values()):
            return EngineState.GENERATING
        buffer = self.core.buffer
        if len(buffer.groups) - buffer.acked_groups >= self.core.config.buffer_capacity:
            return EngineState.IDLE_BUFFER_FULL
        return EngineState.IDLE_NO_WORK

    # --- admission -------------------------------------------------------------------------

    def can_admit(self) -> bool:
        core = self.core
        buffer = core.buffer
        return (
            core.admitting
            and len(self.siblings) < self.limit.value
            and len(buffer.groups) - buffer.acked_groups < core.config.buffer_capacity
            and (not core.config.staleness_gating or self.staleness_room() > 0)
            and core.sampler.has_next()
        )

    def staleness_room(self) -> int:
        """Groups the staleness gate would still admit, behind those generating, finishing or
        ready (admission.py)."""
        return self.core.gate.room(len(self.siblings) + self.core.buffer.ready_count)

    async def concurrency_loop(self) -> None:
        """Feeds the adaptive in-flight limit a reading of the engine every ``interval_s``
        (concurrency.py); wakes admission when the limit changes."""
        core = self.core
        assert core.config.concurrency is not None
        interval = core.config.concurrency.interval_s
        while True:
            engine = core.engine.counters()
            in_flight = len(self.siblings)
            reading = EngineReading(
                engine.kv_cache_usage, engine.preemptions, in_flight, self.departed
            )
            if self.limit.observe(reading):
                log.debug("groups in flight: at most %d (%s)", self.limit.value, self.limit.reason)
                await core.notify()
            await asyncio.sleep(interval)

    async def admission_loop(self) -> None:
        core = self.core
        while True:
            async with core.changed:
                await core.changed.wait_for(self.can_admit)
            if core.next_group_id > core.ids_reserved_through:
                try:
                    await self._reserve_ids()
                except OSError as exc:
                    log.error("cannot reserve group ids in the journal: %s; retrying", exc)
                    await asyncio.sleep(1.0)
                    continue
            async with core.barrier.mutation(MutationKind.ADMIT):
                if not self.can_admit() or core.next_group_id > core.ids_reserved_through:
                    continue
                admission = core.sampler.next()
                if admission is None:
                    continue
                group = self._new_group(admission)
                core.buffer.add(group)
                core.counters.admitted_groups += 1
            self.dispatch(group, group.missing, fresh=True)

    async def _reserve_ids(self) -> None:
        """Journals the next block of ids before any of it is handed out."""
        through = self.core.next_group_id + ID_BLOCK - 1
        await self.core.journal.reserve_ids(through)
        self.core.ids_reserved_through = through

    def _new_group(self, admission: Admission) -> Group:
        core = self.core
        if core.next_group_id > core.ids_reserved_through:
            raise InvariantError(f"group id {core.next_group_id} issued before it was reserved")
        gid = (core.config.replica << ID_BITS) | core.next_group_id
        core.next_group_id += 1
        position = admission.position
        source = EMPTY if position is None else core.sampler.sources[position.source].generation
        spec = resolve(
            admission.prompt.generation.over(source), core.config.sampling, core.config.group_size
        )
        return Group(
            GroupMeta(
                group_id=gid,
                prompt=admission.prompt,
                position=position,
                group_size=spec.group_size,
                policy_version=core.policy_version,
                admitted_at=core.clock(),
                seed=(core.config.seed * 7_919 + gid * 104_729) % (2**31 - 1)
                if spec.seed is None
                else spec.seed,
                params=spec.params,
            )
        )

    # --- siblings --------------------------------------------------------------------------

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
        core = self.core
        admission = GroupAdmission(group.meta) if fresh else None
        if group.group_id not in self._trace_headers:
            meta = group.meta
            p = core.params_of(meta)
            group.trace = self._trace_headers[group.group_id] = core.observer.generation_started(
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
                    core.source_of(meta),
                )
            )
        tasks = self.siblings.setdefault(group.group_id, {})
        for index in indices:
            prefix = (prefixes or {}).get(index)
            episode = (prefix is not None and prefix.turn is not None) or index in (episodes or {})
            if (core.config.capture_partials or prefix is not None) and not episode:
                # Staged now, not when the task first runs, so that a checkpoint taken meanwhile
                # still holds a restored prefix (and its tokens stay buffered).
                core.staging[(group.group_id, index)] = list(prefix.deltas) if prefix else []
            log_ = EpisodeLog(
                group.group_id,
                index,
                core.journal if self.durable_turns else None,
                list((episodes or {}).get(index, ())),
                core.config.capture_partials,
                admission=admission,
            )
            if prefix is not None and prefix.turn is not None:
                log_.begin_turn(prefix.turn, prefix.deltas)
            self.episodes[(group.group_id, index)] = log_
            tasks[index] = core.watched(
                asyncio.create_task(
                    self._run_sibling(group, index, prefix),
                    name=f"rolloutd-{request_id(group.group_id, index)}",
                )
            )
        core.clock_engine()

    async def _run_sibling(
        self, group: Group, index: int, prefix: PartialSibling | None = None
    ) -> None:
        core = self.core
        request = GenerationRequest(
            request_id=request_id(group.group_id, index),
            group_id=group.group_id,
            index=index,
            prompt=group.meta.prompt,
            seed=group.meta.sibling_seed(index),
            params=core.params_of(group.meta),
            trace_headers=self._trace_headers.get(group.group_id, {}),
            prefix=prefix,
        )
        key = (group.group_id, index)
        source = core.source_of(group.meta)
        for attempt in range(core.config.sibling_retries + 1):
            on_delta = None
            if core.config.capture_partials and key in core.staging:
                if attempt:  # a retry starts again from the prefix: a failed attempt's tokens go
                    self._restart(key, prefix)
                on_delta = self._sink(key)
            try:
                sample = await self.runner.run(
                    SiblingJob(
                        core.engine,
                        request,
                        on_delta,
                        source,
                        self.episodes.get(key),
                        core.observer,
                    )
                )
                break
            except RequestRefused as exc:
                await self.drop(group.group_id, REFUSED, str(exc), error=True)
                return
            except EngineError as exc:
                log.warning(
                    "sibling %s failed (attempt %d): %s", request.request_id, attempt + 1, exc
                )
                if attempt == core.config.sibling_retries:
                    await self.drop(group.group_id, ENGINE_ERROR, str(exc), error=True)
                    return
                await asyncio.sleep(0.1 * 2**attempt)
            except EngineDeadError as exc:
                core.die(exc)
                return
        async with core.barrier.mutation(MutationKind.STAGE_SAMPLE):
            if core.buffer.groups.get(group.group_id) is not group:
                return  # evicted while generating
            core.buffer.stage(group.group_id, sample)
            self.siblings[group.group_id].pop(index, None)
            self._staged(key, sample)
            self.episodes.pop(key, None)
            last = group.complete  # exactly one sibling's task stages the last one
            if last:
                core.buffer.finish(group.group_id)
        core.clock_engine()
        if last:
            await self.finish(group)

    def _sink(self, key: tuple[int, int]) -> DeltaSink:
        """Where a sibling's attempt streams its tokens: its staging, each token counted as
        generated. A delta that arrives after the attempt was given up (its group removed, a
        retry begun) is not its sibling's any more and is left out."""
        core = self.core
        deltas = core.staging[key]

        def sink(delta: TokenDelta) -> None:
            if core.staging.get(key) is deltas:
                deltas.append(delta)
                core.counters.generated_tokens += len(delta.token_ids)

        return sink

    def _restart(self, key: tuple[int, int], prefix: PartialSibling | None) -> None:
        """A retried sibling starts again from its prefix: the failed attempt's tokens are
        thrown away (``regenerated``)."""
        core = self.core
        kept = list(prefix.deltas) if prefix else []
        thrown = core.staging.get(key, [])
        core.counters.regenerated_tokens += delta_tokens(thrown) - delta_tokens(kept)
        core.staging[key] = kept

    def _staged(self, key: tuple[int, int], sample: Sample) -> None:
        """A sibling's sample replaces its staged tokens in the buffer (inside the mutation).
        What it holds beyond them was never streamed and counts as generated now (all of it
        without ``capture_partials``); streamed tokens it left out are ``regenerated``."""
        counters = self.core.counters
        unseen = len(sample.token_ids) - delta_tokens(self.core.staging.pop(key, []))
        if unseen >= 0:
            counters.generated_tokens += unseen
        else:
            counters.regenerated_tokens -= unseen

    # --- finishing -------------------------------------------------------------------------

    def finish_later(self, group: Group) -> None:
        """Runs the finishing stage of a FINISHING group in a task of its own (after a
        restore)."""
        self.siblings.setdefault(group.group_id, {})
        self.core.watched(
            asyncio.create_task(self.finish(group), name=f"rolloutd-finish-g{group.group_id}")
        )

    async def finish(self, group: Group) -> None:
        """Asks the finishing stage about a FINISHING group, outside the barrier, then commits
        or drops it as the stage decides. A stage that fails drops the group with the error."""
        task = asyncio.current_task()
        assert task is not None
        self._finishing[group.group_id] = task  # type: ignore[assignment]
        try:
            view = FinishingGroup(
                group.group_id,
                group.meta.prompt,
                group.meta.position,
                group.meta.policy_version,
                group.ordered_samples(),
                self.core.source_of(group.meta),
            )
            started = time.time_ns()
            try:
                verdict = await self.stage.finish(view)
            except Exception as exc:  # the stage is the operator's code: its failure is the group's
                log.exception("finishing stage failed on group %d", group.group_id)
                verdict = Verdict(STAGE_FAILED, f"{type(exc).__name__}: {exc}")
        finally:
            if self._finishing.get(group.group_id) is task:
                del self._finishing[group.group_id]
        self.core.observer.group_finished(
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
            await self.drop(group.group_id, verdict.drop_reason, verdict.detail)

    async def _commit(self, group: Group, scores: GroupScores | None) -> None:
        core = self.core
        async with core.barrier.mutation(MutationKind.COMMIT_GROUP):
            if (
                core.buffer.groups.get(group.group_id) is not group
                or group.state is not GroupState.FINISHING
            ):
                return
            now = core.clock()
            # read before the commit: it may seal the rows, and reading them would decode them
            tokens = group.generated_tokens
            prompt_tokens = len(group.samples[0].prompt_token_ids)
            core.buffer.commit(group.group_id, now, scores)
            self._leave(group.group_id)
            source = core.source_of(group.meta)
            core.counters.committed(source, tokens)
        self._trace_headers.pop(group.group_id, None)
        core.observer.group_committed(
            GroupCommitted(
                group.group_id,
                tokens,
                exact=True,
                completion_s=now - group.meta.admitted_at,
                prompt_tokens=prompt_tokens,
                group_size=group.meta.group_size,
                source=source,
            )
        )
        await core.notify()

    async def drop(self, group_id: int, reason: str, detail: str, *, error: bool = False) -> None:
        """Drops a group (an engine error, or the finishing stage's verdict) for ``reason``:
        its prompt position counts as consumed.

        The drop is journaled before the group leaves the buffer, so it is exactly-once like
        what a client is told: a restart replays it (the group, or its position when no
        snapshot held it, is never admitted again), and a snapshot taken in between holds the
        group with a journal position that covers the record, so its stage runs again."""
        core = self.core
        group = core.buffer.groups.get(group_id)
        if group is None:
            return
        tokens = group.generated_tokens
        record = JournaledDrop(
            group_id, Admission(group.meta.prompt, group.meta.position), reason, tokens
        )
        try:
            await core.journal.drop(record)
        except OSError as exc:
            log.error(
                "the drop of group %d could not be journaled (%s): until the next checkpoint, "
                "a restart may generate its prompt again",
                group_id,
                exc,
            )
        async with core.barrier.mutation(MutationKind.EVICT):
            if core.buffer.groups.get(group_id) is not group:
                return
            await self.cancel(group_id)
            # its partial siblings too, some of which may have streamed since the record
            tokens = group.generated_tokens + core.release_partials(group_id)
            core.buffer.remove(group_id, GroupState.DROPPED)
            core.counters.dropped(reason, tokens)
        why = f"{reason}: {detail}" if detail else reason
        core.observer.group_dropped(GroupDropped(group_id, reason, tokens))
        self._abandoned(group_id, why)
        # an engine error is a fault; a verdict is routine (counted), so it logs at DEBUG
        log.log(
            logging.ERROR if error else logging.DEBUG,
            "group %d (prompt %s) dropped: %s",
            group_id,
            group.meta.prompt.prompt_id,
            why,
        )
        await core.notify()

    async def cancel(self, group_id: int) -> None:
        """Aborts a group's running siblings and its finishing stage (inside a mutation); the
        caller removes the group, and with it their staged tokens."""
        current = asyncio.current_task()
        tasks = self._leave(group_id)
        for index in tasks:
            self.episodes.pop((group_id, index), None)
        await self.core.engine.abort([request_id(group_id, i) for i in tasks])
        finishing = self._finishing.pop(group_id, None)
        for task in [*tasks.values(), *([finishing] if finishing else [])]:
            if task is not current:
                task.cancel()

    def _leave(self, group_id: int) -> dict[int, asyncio.Task[None]]:
        """Takes a group out of flight; returns its siblings still running."""
        tasks = self.siblings.pop(group_id, None)
        if tasks is None:
            return {}
        self.departed += 1
        return tasks

    def _abandoned(self, group_id: int, reason: str) -> None:
        if self._trace_headers.pop(group_id, None) is not None:
            self.core.observer.generation_abandoned(group_id, reason)

    async def stop(self) -> None:
        """Aborts every running sibling and finishing stage; staged siblings stay."""
        tasks = [t for sibs in self.siblings.values() for t in sibs.values()]
        await self.core.engine.abort(
            [request_id(gid, i) for gid, s in self.siblings.items() for i in s]
        )
        tasks += self._finishing.values()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def partials(self) -> tuple[PartialSibling, ...]:
        """The tokens of every generating sibling so far (constant time each: a reference and a
        length); inside the exclusive hold."""
        plain = tuple(
            PartialSibling(gid, index, chunks, len(chunks))
            for (gid, index), chunks in self.core.staging.items()
            if chunks
        )
        return plain + tuple(
            PartialSibling(gid, index, e.deltas, len(e.deltas), e.turn, e.records, len(e.records))
            for (gid, index), e in self.episodes.items()
            if e.records
        )

    @property
    def inflight_samples(self) -> int:
        return sum(len(s) for s in self.siblings.values())

    # --- weights ---------------------------------------------------------------------------

    async def update_weights(
        self,
        version: int,
        weights_path: str,
        *,
        timeline: WeightsTimeline | None = None,
        only: tuple[str, ...] | None = None,
    ) -> int:
        """Loads new weights (``only``: just these tensors changed), bumps the policy version,
        evicts groups now too stale.

        An engine that fails while loading may hold a mix of old and new weights: the controller
        then stops (not ready) rather than generate from them.
        """
        core = self.core
        if version <= core.policy_version:
            raise InvalidArgument(
                "version", f"must be greater than the current policy version {core.policy_version}"
            )
        if not weights_path:
            raise InvalidArgument("weights_path", "must not be empty")
        core.check_serving()
        try:
            self._updating = True
            core.clock_engine()
            await core.engine.update_weights(weights_path, version, timeline=timeline, only=only)
        except EngineDeadError as exc:
            core.die(exc)
            raise Unavailable(f"the service is not ready: {exc}") from exc
        except EngineError as exc:  # refused before anything was loaded (a wrong path)
            raise InvalidArgument("weights_path", str(exc)) from exc
        finally:
            self._updating = False
            core.clock_engine()
        core.policy_version, core.weights_path = version, weights_path
        core.gate.version_changed(version)
        return await self.evict_stale()

    def check_version(self, version: int) -> None:
        """Refuses a version a trainer asks for (``UpdateWeights``, ``PushWeights``) more than
        ``max_version_step`` ahead of the served one: one absurd version would refuse every
        later update (docs/operations.md, "Resetting a policy version or trainer step"). A
        catch-up from the weights store is not asked for, so it is not bounded."""
        core = self.core
        step = core.config.max_version_step
        if version > core.policy_version + step:
            raise InvalidArgument(
                "version",
                f"{version} is more than limits.max_version_step={step} ahead of the current "
                f"policy version {core.policy_version}",
            )

    async def evict_stale(self) -> int:
        """Evicts every group too stale to deliver that is not the trainer's (generating,
        finishing or committed); a leased or acked group is looked at again when it becomes
        deliverable again (``Delivery.evict_stale``)."""
        core = self.core
        async with core.barrier.mutation(MutationKind.EVICT):
            stale = [
                g
                for g in core.buffer.groups.values()
                # not g.meta: a restored group's stays undecoded
                if core.too_stale(g.policy_version)
                and g.state in (GroupState.GENERATING, GroupState.FINISHING, GroupState.COMMITTED)
            ]
            for g in stale:
                self._abandoned(g.group_id, "evicted: too stale")
                await self.cancel(g.group_id)
                core.evict(g.group_id)
        if stale:
            core.observer.groups_evicted(len(stale))
            await core.notify()
        return len(stale)
