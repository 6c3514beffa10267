"""Restore: rebuild the controller from a snapshot plus the journal, in six phases.

1. ``resolve_snapshot`` pick the snapshot (latest, a sequence or a tag); newer ones that do not
                        verify are skipped with a reason; a changed semantic configuration refuses.
                        Its small files verify here; its sample segments (nearly all the bytes)
                        start being read and checksummed on the verify threads.
2. ``dataloader``       the sampler's cursor, submitted and re-admitted prompts, and the groups
                        (a table over the typed columns of the group segments: no object per
                        group), and the buffer built from them, all while those verify; the
                        cursor must be ahead of every group's position.
3. ``buffer``           the live rows of the sample segments indexed batch by batch as the
                        checksum reads them (front to back), then the wait for the checksums;
                        the buffer's groups get their rows. A snapshot whose rows do
                        not verify is skipped with its reason and the next older one is resolved
                        (phases 1-3 again): nothing decoded from unverified bytes reaches the
                        controller.
4. ``replay_metadata``  the buffer, leases, acks and counters go into the controller; leased-unacked
                        groups become available again.
5. ``recovery_ledger``  what was journaled after the snapshot is applied: acks (no acked group is
                        delivered again, no acked position admitted again), live lease grants,
                        accepted submissions and reserved group ids.
6. ``redispatch``       unfinished groups: staged siblings reused, missing ones continued from the
                        partial tokens the snapshot held (granularity ``token``) or generated
                        from their first token (``sibling``), or the whole group generated
                        again (``group``).

This module resolves, verifies, reads and times phases 1-3, then hands the controller what it
read in one value (``Controller.recover``), which runs and times phases 4-6 itself. A store is
never empty while it has a journal: without a snapshot, the journal is replayed into the fresh
controller. The restored snapshot is handed to the checkpointer (``adopt``) so that the next
checkpoint continues incrementally from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import sys
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from typing import Any, Protocol

from rolloutd.checkpoint import ledger, sidecar, submissions
from rolloutd.checkpoint.backends import CorruptSnapshot
from rolloutd.checkpoint.manifest import Manifest, fingerprint_diff
from rolloutd.checkpoint.partials import ResumedRow
from rolloutd.checkpoint.segments import Snapshot
from rolloutd.checkpoint.store import SnapshotReader
from rolloutd.domain.controller import Controller
from rolloutd.domain.errors import RestoreRefused
from rolloutd.domain.observer import NullObserver, Observer
from rolloutd.domain.partial import PartialSibling
from rolloutd.domain.recovery import Granularity, Recovered
from rolloutd.domain.report import (
    PhaseClock,
    RestorePhase,
    RestoreReport,
    SkippedSnapshot,
)
from rolloutd.domain.snapshot import ControllerState

__all__ = ["Granularity", "RestoreRefused", "restore"]

log = logging.getLogger(__name__)


_SWITCH_INTERVAL_S = 0.0005
"""How long a thread may hold the GIL while another waits for it, during a restore: the verify
threads checksum each few MB of a segment as it arrives and need the GIL between two, while
decoding the state holds it for ~10 ms; at Python's default (5 ms) they waited for it longer than
they checksummed and the 64 MB quick snapshot took ~5 ms longer to read. Nothing else runs then."""


class Continuation(Protocol):
    """What continues from the restored snapshot: the checkpointer's next snapshot is
    incremental over it."""

    def adopt(
        self, manifest: Manifest, state: ControllerState, resumed: Mapping[int, ResumedRow]
    ) -> None: ...


def differing_keys(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """What a refusal names: each differing key with both values."""
    return [
        f"{k}: snapshot {saved.get(k)!r} != now {current.get(k)!r}"
        for k in fingerprint_diff(saved, current)
    ]


async def restore(
    controller: Controller,
    store: SnapshotReader,
    continuation: Continuation,
    spec: str,
    fingerprint: Mapping[str, Any],
    granularity: Granularity,
    *,
    observer: Observer | None = None,
) -> RestoreReport:
    """Restores into a fresh controller (before ``controller.start()``); raises RestoreRefused.
    ``observer`` hears the report (also of a failed restore)."""
    observer = observer or NullObserver()
    clock = PhaseClock()
    report = RestoreReport(started_ns=time.time_ns(), ended_ns=0, phases=clock.phases)
    # A restore only builds objects that live on (a group's metadata, its view of the kept
    # rows): collections during it would scan them again and again and free nothing.
    collecting = gc.isenabled()
    gc.disable()
    switching = sys.getswitchinterval()
    sys.setswitchinterval(_SWITCH_INTERVAL_S)
    try:
        manifest = await _run(
            controller, store, continuation, spec, fingerprint, granularity, clock, report
        )
    except BaseException as exc:
        report.error = exc
        report.ended_ns = time.time_ns()
        observer.restored(report)
        raise
    finally:
        sys.setswitchinterval(switching)
        if collecting:
            gc.enable()
    report.ended_ns = time.time_ns()
    # What a restore built lives as long as the service: moved out of the collector's view, so
    # full collections scan only what changes afterwards and stay short with a full buffer.
    gc.freeze()
    if manifest is not None:
        log.info(
            "restored snapshot %d in %.2fs: groups %s, siblings %s, tokens %s, skipped %s",
            manifest.sequence,
            report.seconds,
            {k.value: v for k, v in report.groups.items()},
            {k.value: v for k, v in report.siblings.items()},
            {k.value: v for k, v in report.tokens.items()},
            [(s.sequence, s.reason) for s in report.skipped],
        )
    observer.restored(report)
    return report


async def _run(
    controller: Controller,
    store: SnapshotReader,
    continuation: Continuation,
    spec: str,
    fingerprint: Mapping[str, Any],
    granularity: Granularity,
    clock: PhaseClock,
    report: RestoreReport,
) -> Manifest | None:
    snapshot = await _resolve(store, spec, fingerprint, clock, report)
    if snapshot is None:
        if report.skipped:
            log.error("no snapshot verifies; starting fresh")
            return None
        journal = functools.partial(store.journal.events_after, 0)
        counts = await controller.recover(Recovered(None, None, journal, granularity), clock)
        report.replayed = counts.events
        # the ready line says so; the journal replayed without a snapshot is worth a line
        log.log(
            logging.INFO if counts.events else logging.DEBUG,
            "no snapshot to restore (%s); replayed %d journal records",
            spec,
            counts.events,
        )
        return None

    while True:
        # The sample segments are still being read and checksummed on the verify threads:
        # the state is decoded and the rows indexed meanwhile, and used only once they verify.
        manifest = snapshot.manifest
        with clock.phase(RestorePhase.DATALOADER):
            # cursor, submitted and re-admitted prompts; groups from the group segments
            state = sidecar.decode(snapshot.sidecar, snapshot.group_table())
            state = submissions.attach(state, snapshot.submitted)
            state = ledger.attach(state, snapshot.finalized_leases)
            # the buffer is built from the verified group segments while the rows still verify
            prepared = controller.prepare_restore(state)

        with clock.phase(RestorePhase.BUFFER):
            siblings, resumed = await _partials(store, manifest)
            try:
                # on threads: the rows are indexed as their bytes arrive, and a snapshot of many
                # GB takes a while; the loop meanwhile answers status and health, and logs progress
                async with _progress(snapshot):
                    kept = await asyncio.to_thread(
                        snapshot.kept_rows,
                        dict(resumed),
                    )
                    await asyncio.to_thread(snapshot.verify)
                prepared.keep_rows(kept.groups())
            except CorruptSnapshot as exc:
                problem = SkippedSnapshot(manifest.sequence, "; ".join(exc.problems))
                log.warning("snapshot %d skipped: %s", problem.sequence, problem.reason)
                report.skipped.append(problem)
                verified = None
            else:
                verified = state
        if verified is None:
            snapshot = await _resolve(
                store, spec, fingerprint, clock, report, before=manifest.sequence
            )
            if snapshot is None:
                log.error("no snapshot verifies; starting fresh")
                return None
            continue
        state = replace(state, partials=siblings)
        log.info(
            "restoring snapshot %d: %d rows of %d groups kept in the verified buffers",
            manifest.sequence,
            len(kept),
            len(state.buffer.groups),
        )
        break

    journal = functools.partial(store.journal.events_after, manifest.acks_through)
    counts = await controller.recover(Recovered(state, prepared, journal, granularity), clock)
    report.groups, report.siblings, report.tokens = counts.groups, counts.siblings, counts.tokens
    report.redispatch_s, report.replayed = counts.redispatch_s, counts.events
    continuation.adopt(manifest, state, resumed)
    return manifest


PROGRESS_S = 2.0
"""Seconds between two progress lines while a snapshot's rows are read and verified."""


@contextlib.asynccontextmanager
async def _progress(snapshot: Snapshot) -> AsyncIterator[None]:
    """Logs how much of the snapshot's rows has been read and checksummed, every
    :data:`PROGRESS_S` while the body runs (a restore of many GB takes minutes)."""

    async def report() -> None:
        started = time.monotonic()
        while True:
            await asyncio.sleep(PROGRESS_S)
            done, total = snapshot.progress()
            elapsed = time.monotonic() - started
            log.info(
                "restoring snapshot %d: %.0f of %.0f MB of rows read and verified (%.0f%%), "
                "%.0f MB/s",
                snapshot.manifest.sequence,
                done / 1e6,
                total / 1e6,
                100 * done / max(total, 1),
                done / 1e6 / elapsed,
            )

    task = asyncio.create_task(report())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _resolve(
    store: SnapshotReader,
    spec: str,
    fingerprint: Mapping[str, Any],
    clock: PhaseClock,
    report: RestoreReport,
    before: int | None = None,
) -> Snapshot | None:
    """The ``resolve_snapshot`` phase: the newest snapshot ``spec`` selects (older than
    ``before``) whose small files verify, its sample segments left verifying; None when none
    does. Refuses a snapshot taken under another semantic configuration."""
    with clock.phase(RestorePhase.RESOLVE_SNAPSHOT):
        resolution = await asyncio.to_thread(store.resolve, spec, verify=False, before=before)
        for s in resolution.skipped:
            log.warning("snapshot %d skipped: %s", s.sequence, s.reason)
        report.skipped.extend(resolution.skipped)
        snapshot = resolution.snapshot
        if snapshot is None:
            return None
        manifest = snapshot.manifest
        report.sequence, report.tag = manifest.sequence, manifest.tag
        log.info(
            "restoring snapshot %d: %d files, %.1f MB verifying since %.2fs",
            manifest.sequence,
            len(manifest.files()),
            manifest.total_bytes / 1e6,
            (time.time_ns() - report.started_ns) / 1e9,
        )
        diff = differing_keys(manifest.fingerprint, fingerprint)
        if diff:
            raise RestoreRefused(
                f"snapshot {manifest.sequence} was taken under a different configuration: "
                + "; ".join(diff)
                + _advice(fingerprint_diff(manifest.fingerprint, fingerprint))
            )
    return snapshot


def _advice(keys: list[str]) -> str:
    if "fleet.replicas" in keys or "fleet.replica" in keys:
        return (
            " (each replica owns a share of the dataset that depends on the fleet's size, so a "
            "store cannot change fleets mid-run: start each replica with the --replica/--replicas "
            "it was started with, or begin a new run on empty stores, or with --restore none; "
            "see docs/operations.md, scaling)"
        )
    return " (start with --restore none to begin afresh, or restore with the old configuration)"


async def _partials(
    store: SnapshotReader, manifest: Manifest
) -> tuple[tuple[PartialSibling, ...], dict[int, ResumedRow]]:
    """The snapshot's partial siblings and resumed rows. A partials file that is missing, cut
    short or does not verify costs only what it held: its siblings start again from their first
    token, resumed rows are delivered without saying where they were resumed, and the restore
    goes on."""
    try:
        siblings = await asyncio.to_thread(store.read_partials, manifest)
        resumed = await asyncio.to_thread(store.read_resumed, manifest)
    except CorruptSnapshot as exc:
        log.error("partial siblings of snapshot %d are lost: %s", manifest.sequence, exc)
        return (), {}
    return tuple(siblings), resumed
