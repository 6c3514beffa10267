"""The checkpointer: incremental snapshots of the buffer and controller state, in five phases.

1. ``barrier_wait``   ask for the barrier exclusively; in-flight mutations drain, new ones wait.
2. ``exclusive_hold`` capture a consistent cut: the rows staged and removed since the last
                      snapshot, changed group metadata, sampler cursor, leases, acks, counters.
                      No I/O and no serialization: pointer work proportional to the delta only.
3. ``buffer_save``    write the new rows as one immutable Arrow IPC segment, and the partial
                      tokens of siblings still generating as a file of this snapshot's own.
4. ``sidecar_write``  write the metadata of changed groups as a group segment, the prompts
                      submitted since the parent snapshot as a submissions piece
                      (submissions.py), the leases finalized since as a ledger piece
                      (ledger.py), and controller state as a small JSON sidecar.
5. ``commit``         fsync and publish atomically; then retention.

A crash at any instant leaves the previous snapshot restorable. A failed attempt hands its capture
back to the controller (``capture_failed``), so the next attempt still writes everything since
the last success. An attempt that timed out publishes nothing, ever (:class:`_Handoff`): its
worker thread may still be waiting on the disk, and is refused at its next step. When attempts
run (periodic, on demand, at shutdown) is the scheduler's choice.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from rolloutd.checkpoint import partials, sidecar
from rolloutd.checkpoint.faults import FaultPoint, fault_point
from rolloutd.checkpoint.journal import Journal
from rolloutd.checkpoint.manifest import LedgerEntry, Manifest, next_manifest
from rolloutd.checkpoint.retention import keep_tagged, plan_compaction
from rolloutd.checkpoint.rows import SegmentKind
from rolloutd.checkpoint.store import SnapshotWriter
from rolloutd.domain.controller import Controller
from rolloutd.domain.errors import InvariantError
from rolloutd.domain.group import GroupMeta
from rolloutd.domain.ledger import remember_finalized
from rolloutd.domain.lifecycle import Lifecycle, ServingState
from rolloutd.domain.observer import NullObserver, Observer
from rolloutd.domain.report import (
    CheckpointPhase,
    CheckpointReport,
    Outcome,
    PhaseClock,
    Reason,
    RowKind,
    SizePart,
    Trigger,
)
from rolloutd.domain.snapshot import ControllerState

log = logging.getLogger(__name__)

SLOW_S = 1.0
"""An attempt that takes this long also logs how long each of its phases took."""


@dataclass(frozen=True)
class CheckpointerConfig:
    """The checkpointer's settings; ``config/components.py`` exposes them as ``checkpoint.*`` keys with
    these defaults and meanings."""

    interval_s: float = 60.0
    """Seconds from the start of one periodic checkpoint to the start of the next (the next
    follows at once when one takes longer); 0 disables them."""
    keep_latest: int = 3
    """Newest snapshots kept, tagged or not."""
    keep_tagged: int = 10
    """Newest tagged snapshots kept besides keep_latest, whatever their trainer step: rollback
    points for --restore TAG (0: tags protect nothing). Snapshots whose trainer step a Rewind may
    still need (within limits.rewind_window) are kept as well; all others are retired."""
    max_consecutive_failures: int = 3
    """Failed attempts in a row after which the service reports not-ready."""
    timeout_s: float = 120.0
    """An attempt taking longer fails with reason ``timeout``."""
    compact_segments: int = 8
    """A snapshot listing more segments than this has its smallest ones (by live bytes) merged
    into one, leaving half as many; large, mostly live segments are not rewritten."""


class AttemptAbandoned(Exception):
    """Raised in an attempt's worker thread once the event loop gave up on the attempt."""


class _Handoff:
    """An attempt's worker thread and the event loop agree here on whether it may publish.

    A timeout cancels the coroutine but not the thread: left alone, a thread stalled on the disk
    would publish a snapshot the checkpointer had reported failed, whose capture it had handed
    back, racing the next attempt (and its retention, which may retire the parent the next
    attempt builds on). So the thread asks before each phase and before publishing; once the
    loop abandons the attempt every answer is no. Publishing is the commit point: an attempt
    whose thread began publishing before the timeout is waited for and counts as completed.
    """

    def __init__(self, sequence: int) -> None:
        self.sequence = sequence
        self._lock = threading.Lock()
        self._abandoned = False
        self._publishing = False

    def check(self) -> None:
        """In the thread, between phases: stop writing files nobody will publish."""
        if self._abandoned:
            raise AttemptAbandoned(f"snapshot {self.sequence}: the attempt timed out")

    def publishing(self) -> None:
        """In the thread, right before publishing: from here on the attempt completes."""
        with self._lock:
            self.check()
            self._publishing = True

    def abandon(self) -> bool:
        """On the loop, when the attempt timed out: True if it will publish nothing, False if
        its thread is publishing already (then it must be waited for)."""
        with self._lock:
            self._abandoned = not self._publishing
            return self._abandoned


def _abandoned(sequence: int, work: asyncio.Future[Any]) -> None:
    """What became of an abandoned attempt's thread, once it ends (and its error retrieved)."""
    if work.cancelled():
        return
    exc = work.exception()
    if isinstance(exc, AttemptAbandoned) or exc is None:
        log.info("snapshot %d: the attempt that timed out stopped, unpublished", sequence)
    else:
        log.warning("snapshot %d: the attempt that timed out stopped: %s", sequence, exc)


@dataclass(frozen=True)
class _Base:
    """What an attempt's writing builds on, read on the event loop before it is handed off."""

    parent: Manifest | None
    carried: Mapping[int, GroupMeta]
    carried_ledger: Mapping[str, int]
    resumed: Mapping[int, partials.ResumedRow]
    oldest_step: int
    """Tagged snapshots for older trainer steps may be retired (see ``_retire``)."""


class Checkpointer:
    def __init__(
        self,
        controller: Controller,
        store: SnapshotWriter,
        journal: Journal,
        config: CheckpointerConfig,
        fingerprint: Mapping[str, Any],
        *,
        observer: Observer | None = None,
        lifecycle: Lifecycle | None = None,
    ) -> None:
        """``lifecycle``: the service's serving state; an attempt while it is RESTORING is
        skipped (``restoring``). None: never restoring (a checkpointer without a service)."""
        self.controller = controller
        self.lifecycle = lifecycle
        self.store = store
        self.journal = journal
        self.config = config
        self.fingerprint = dict(fingerprint)
        self.observer: Observer = observer or NullObserver()
        self._lock = asyncio.Lock()
        self._resumed: dict[int, partials.ResumedRow] = {}
        """Live rows whose samples were resumed, as of the last completed snapshot: written whole
        with each snapshot's partials, since segments do not hold where a sample was resumed."""
        self._carried: dict[int, GroupMeta] = {}
        """Groups restored from a format-1 snapshot (whose sidecar held them): written into the
        next snapshot's group segment, since no group segment holds them yet."""
        self._carried_ledger: Mapping[str, int] = {}
        """The finalized-lease ledger restored from a snapshot whose sidecar held it (earlier
        versions): written into the next snapshot's ledger piece, since no piece holds it yet.
        Otherwise captures hand over only what was finalized since the parent, and that is all
        a snapshot writes of the ledger."""
        self._parent: Manifest | None = None
        self._next_sequence: int | None = None
        """Sequence of the next attempt; read once from the store (its newest manifest)."""
        self.shutting_down = False
        self.consecutive_failures = 0
        self.last_attempt: CheckpointReport | None = None
        self.last_success: CheckpointReport | None = None
        self.last_success_at = time.time()
        """Wall-clock time of the last completed snapshot (start-up until there is one)."""
        self._current_at = time.time()
        """When the store was last known to hold everything: a completed attempt, or a periodic
        one skipped because nothing changed since (an idle service is not stale)."""

    def adopt(
        self,
        manifest: Manifest,
        state: ControllerState,
        resumed: Mapping[int, partials.ResumedRow],
    ) -> None:
        """Continue incrementally from a restored snapshot (``state`` is its whole state,
        ``resumed`` the resume records of its live rows)."""
        self._parent = manifest
        if manifest.format_version < 2:
            self._carried = {g: m for g, m in state.buffer.groups.items() if m is not None}
        self._carried_ledger = {} if manifest.ledger else state.ledger.finalized_leases
        self._resumed = dict(resumed)

    @property
    def sequence(self) -> int:
        return 0 if self._parent is None else self._parent.sequence

    def since_success_s(self) -> float:
        """Seconds since the snapshot was last known current (see ``_current_at``)."""
        return time.time() - self._current_at

    async def checkpoint(
        self, trigger: Trigger, tag: str = "", trainer_step: int | None = None
    ) -> CheckpointReport:
        """One attempt; never raises for I/O trouble or timeouts (they are its outcome).

        A periodic attempt that finds another one running is skipped; any other waits for it and
        then runs, so ``trainer_step`` is always finalized. An invariant violation is raised,
        and a ``trainer_step`` the controller refuses (``InvalidArgument``) before anything."""
        if trainer_step is not None:
            self.controller.check_step(trainer_step)
        started = time.time_ns()
        skip = self._skip_reason(trigger)
        if skip is not None:
            return self._report(
                CheckpointReport(
                    trigger,
                    Outcome.SKIPPED,
                    skip,
                    started,
                    time.time_ns(),
                    tag=tag,
                    trainer_step=trainer_step,
                )
            )
        async with self._lock:
            if trainer_step is not None:
                await self.controller.finalize(trainer_step)
            clock = PhaseClock()
            report = CheckpointReport(
                trigger,
                Outcome.FAILED,
                Reason.IO_ERROR,
                started,
                started,
                tag=tag,
                trainer_step=trainer_step,
                phases=clock.phases,
            )
            try:
                async with asyncio.timeout(self.config.timeout_s):
                    await self._attempt(
                        clock, report, force=trigger is not Trigger.PERIODIC or bool(tag)
                    )
            except TimeoutError as exc:
                late = TimeoutError(
                    f"the attempt took longer than checkpoint.timeout_s={self.config.timeout_s:g}s"
                )
                late.__cause__ = exc
                report.outcome, report.reason, report.error = Outcome.FAILED, Reason.TIMEOUT, late
            except OSError as exc:
                report.outcome, report.reason, report.error = Outcome.FAILED, Reason.IO_ERROR, exc
            except InvariantError as exc:
                report.outcome, report.reason, report.error = (
                    Outcome.FAILED,
                    Reason.INVARIANT_ERROR,
                    exc,
                )
                report.ended_ns = time.time_ns()
                self._report(report)
                raise
            report.ended_ns = time.time_ns()
            if tag and report.outcome is Outcome.COMPLETED:
                report.retagged = await asyncio.to_thread(self._tagged_before, report)
            return self._report(report)

    def _tagged_before(self, report: CheckpointReport) -> int | None:
        """The newest snapshot older than ``report``'s with its tag (a trainer restarted from an
        earlier step reuses its tags): the tag now names the new one, by newest-first lookup."""
        older = [
            m.sequence
            for m in self.store.list()
            if m.tag == report.tag and report.sequence is not None and m.sequence < report.sequence
        ]
        return max(older, default=None)

    def _skip_reason(self, trigger: Trigger) -> Reason | None:
        if self.lifecycle is not None and self.lifecycle.state is ServingState.RESTORING:
            return Reason.RESTORING
        if self.shutting_down and trigger is not Trigger.SHUTDOWN:
            return Reason.SHUTTING_DOWN
        if self._lock.locked() and trigger is Trigger.PERIODIC:
            return Reason.IN_PROGRESS  # an on-demand or final attempt waits for it instead
        return None

    async def _attempt(self, clock: PhaseClock, report: CheckpointReport, *, force: bool) -> None:
        barrier = self.controller.barrier
        with clock.phase(CheckpointPhase.BARRIER_WAIT):
            hold = barrier.exclusive()
            await hold.__aenter__()
            fault_point(FaultPoint.BARRIER_WAIT)
        try:
            with clock.phase(CheckpointPhase.EXCLUSIVE_HOLD):
                capture = self.controller.capture()
                acks_through = self.journal.position
                fault_point(FaultPoint.EXCLUSIVE_HOLD)
        finally:
            await hold.__aexit__(None, None, None)
        if (
            capture.buffer.empty
            and not capture.partials
            and not force
            and acks_through == (self._parent.acks_through if self._parent else 0)
        ):
            report.outcome, report.reason = Outcome.SKIPPED, Reason.NO_CHANGES
            return
        try:
            manifest, resumed = await self._write(clock, capture, acks_through, report)
        except BaseException:
            self.controller.capture_failed(capture)
            raise
        self._parent, self._carried, self._carried_ledger = manifest, {}, {}
        self._resumed = resumed
        report.outcome, report.reason, report.sequence = (
            Outcome.COMPLETED,
            Reason.COMPLETED,
            manifest.sequence,
        )
        report.rows = {
            RowKind.NEW: manifest.new_rows,
            RowKind.REMOVED: manifest.removed_rows,
            RowKind.LIVE: manifest.live_rows,
        }
        written_submissions = manifest.written_submission_bytes
        report.size_bytes = {
            SizePart.SEGMENTS: manifest.written_segment_bytes,
            SizePart.GROUPS: manifest.written_group_bytes,
            SizePart.SIDECAR: manifest.sidecar.size,
            SizePart.SUBMISSIONS: written_submissions,
            SizePart.LEDGER: manifest.written_ledger_bytes,
            SizePart.PARTIALS: manifest.partials_bytes,
            SizePart.TOTAL: manifest.written_bytes,
        }

    async def _write(
        self,
        clock: PhaseClock,
        capture: ControllerState,
        acks_through: int,
        report: CheckpointReport,
    ) -> tuple[Manifest, dict[int, partials.ResumedRow]]:
        if self._next_sequence is None:
            published = await asyncio.to_thread(self.store.sequences)
            self._next_sequence = (published[0] if published else 0) + 1
        # Never reused: an attempt that timed out may still be writing files in its thread.
        sequence, self._next_sequence = self._next_sequence, self._next_sequence + 1
        base = _Base(
            self._parent,
            self._carried,
            self._carried_ledger,
            self._resumed,
            self.controller.retained_from_step(capture),
        )
        handoff = _Handoff(sequence)
        work = asyncio.ensure_future(
            asyncio.to_thread(
                self._write_snapshot, handoff, clock, sequence, base, capture, acks_through, report
            )
        )
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            if handoff.abandon():
                work.add_done_callback(partial(_abandoned, sequence))
                raise
            log.warning("snapshot %d: publishing when the attempt timed out; waiting", sequence)
            return await work

    def _write_snapshot(
        self,
        handoff: _Handoff,
        clock: PhaseClock,
        sequence: int,
        base: _Base,
        capture: ControllerState,
        acks_through: int,
        report: CheckpointReport,
    ) -> tuple[Manifest, dict[int, partials.ResumedRow]]:
        """Phases 3 to 5 in one worker thread, in one hand-off from the event loop.

        Under 64 trainers the event loop is what limits throughput: each hand-off wakes it
        twice, and every piece of Python work here (filtering thousands of rows, sorting changed
        groups, encoding) would be loop time not spent serving RPCs. The capture belongs to this
        attempt alone, and ``base`` was read on the loop before the hand-off: an attempt that
        timed out may still be running here while the next one completes and moves the parent,
        which is why it asks ``handoff`` before each phase and before it publishes."""
        delta = capture.buffer
        removed = set(delta.removed_rows)
        new_rows = [row for row in delta.new_rows if row[0] not in removed]
        sealed_ids = (
            [i for i in delta.new_sealed_ids if i not in removed]
            if removed
            else delta.new_sealed_ids
        )
        handoff.check()
        with clock.phase(CheckpointPhase.BUFFER_SAVE):
            segment = (
                self.store.write_segment(sequence, new_rows, delta.new_sealed, sealed_ids)
                if new_rows or sealed_ids
                else None
            )
            resumed = {k: v for k, v in base.resumed.items() if k not in removed}
            resumed.update(partials.resumed_rows(new_rows))
            partials_entry = (
                self.store.write_partials(sequence, capture.partials, resumed)
                if capture.partials or resumed
                else None
            )
        handoff.check()
        with clock.phase(CheckpointPhase.SIDECAR_WRITE):
            changed = {**base.carried, **delta.groups}
            metas = [meta for _, meta in sorted(changed.items()) if meta is not None]
            groups = self.store.write_groups(sequence, metas) if metas else None
            held = base.parent.submissions if base.parent is not None else ()
            since = capture.sampler.submitted[
                sum(p.count for p in held) : capture.sampler.submitted_len
            ]
            pieces = self.store.write_submissions(sequence, held, since)
            ledger = self._write_ledger(sequence, base, capture.ledger.finalized_leases)
            entry = self.store.write_sidecar_json(sequence, sidecar.encode(capture))
        handoff.check()
        with clock.phase(CheckpointPhase.COMMIT):
            manifest = next_manifest(
                base.parent,
                sequence=sequence,
                created_at=time.time(),
                sidecar=entry,
                new_segment=segment,
                removed=list(removed),
                new_groups=groups,
                changed_groups=list(changed),
                acks_through=acks_through,
                tag=report.tag,
                trainer_step=report.trainer_step,
                fingerprint=self.fingerprint,
                submissions=pieces,
                ledger=ledger,
            )
            manifest = replace(manifest, partials=partials_entry)
            for kind in SegmentKind:
                chosen = plan_compaction(manifest, self.config.compact_segments, kind)
                if chosen:
                    manifest = self.store.compact(manifest, chosen, kind)
            handoff.publishing()
            self.store.publish(manifest)
            self._retire(base.oldest_step)
        return manifest, resumed

    def _write_ledger(
        self, sequence: int, base: _Base, finalized: Mapping[str, int]
    ) -> tuple[LedgerEntry, ...]:
        if base.carried_ledger:
            finalized = remember_finalized(OrderedDict(base.carried_ledger), finalized)
        held = base.parent.ledger if base.parent is not None else ()
        return self.store.write_ledger(sequence, held, finalized)

    def _retire(self, oldest_step: int | None) -> None:
        """Retention (in a worker thread): the newest ``keep_latest``, the newest
        ``keep_tagged`` tagged ones, and the tagged ones a Rewind to ``oldest_step`` or later may
        need."""
        rollback_points = {m.sequence for m in self.store.list() if m.tag}
        newest_tagged = set(sorted(rollback_points, reverse=True)[: self.config.keep_tagged])
        needed = keep_tagged(oldest_step)
        self.store.retire(
            self.config.keep_latest, lambda m: m.sequence in newest_tagged or needed(m)
        )

    def _report(self, report: CheckpointReport) -> CheckpointReport:
        self.last_attempt = report
        if report.outcome is Outcome.COMPLETED:
            self.consecutive_failures = 0
            self.last_success, self.last_success_at = report, report.ended_ns / 1e9
            self._current_at = self.last_success_at
        elif report.reason is Reason.NO_CHANGES:
            self._current_at = report.ended_ns / 1e9
        elif report.outcome is Outcome.FAILED:
            self.consecutive_failures += 1
            log.error(
                "checkpoint failed (%s, %d in a row): %s",
                report.reason.value,
                self.consecutive_failures,
                report.error,
            )
        if report.outcome is not Outcome.SKIPPED or report.reason is not Reason.NO_CHANGES:
            log.info("%s", describe(report))
            if report.seconds >= SLOW_S:
                log.warning(
                    "checkpoint seq=%s took %.1f s: %s",
                    report.sequence,
                    report.seconds,
                    ", ".join(f"{p.phase.value} {p.seconds * 1e3:.0f} ms" for p in report.phases),
                )
        self.observer.checkpoint_attempted(report)
        return report

    @property
    def failing(self) -> bool:
        return self.consecutive_failures >= self.config.max_consecutive_failures


def describe(report: CheckpointReport) -> str:
    """One line per attempt, e.g. ``checkpoint 7 completed in 12.3 ms (trigger trainer, trainer
    step 10, tag step-10): 0 rows new, 96 removed, 1,024 live; 41.2 kB written``.

    Rows are counted against the previous snapshot: a trainer's checkpoint that only finalized
    acks writes no new rows and removes the finalized ones, which is not an empty snapshot."""
    what = [f"trigger {report.trigger.value}"]
    if report.trainer_step is not None:
        what.append(f"trainer step {report.trainer_step}")
    if report.tag:
        what.append(f"tag {report.tag}")
    head = f"checkpoint {report.sequence}" if report.sequence else "checkpoint"
    outcome = report.outcome.value
    if report.reason.value != outcome:
        outcome = f"{outcome} ({report.reason.value})"
    line = f"{head} {outcome} in {report.seconds * 1e3:.1f} ms ({', '.join(what)})"
    if report.outcome is not Outcome.COMPLETED:
        return line
    rows = report.rows
    line = (
        f"{line}: {rows.get(RowKind.NEW, 0):,} rows new, {rows.get(RowKind.REMOVED, 0):,} "
        f"removed, {rows.get(RowKind.LIVE, 0):,} live; "
        f"{_size(report.size_bytes.get(SizePart.TOTAL, 0))} written"
    )
    return f"{line}; {report.message()}" if report.retagged is not None else line


def _size(n: int) -> str:
    return f"{n / 1e6:,.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"
