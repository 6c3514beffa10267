"""Restore: rebuild the controller from a snapshot plus the journal, in six phases.

1. ``resolve_snapshot`` pick the snapshot (latest, a sequence or a tag); newer ones that do not
                        verify are skipped with a reason; a changed semantic configuration refuses.
2. ``dataloader``       the sampler's cursor, submitted and re-admitted prompts.
3. ``buffer``           the live rows of the snapshot's segments.
4. ``replay_metadata``  groups, leases, acks and counters from the sidecar; leased-unacked groups
                        become available again; the cursor must be ahead of every group's position.
5. ``recovery_ledger``  what was journaled after the snapshot is applied: acks (no acked group is
                        delivered again, no acked position admitted again), live lease grants,
                        accepted submissions and reserved group ids.
6. ``redispatch``       unfinished groups: staged siblings reused, missing ones generated
                        (granularity ``sibling``), or the whole group generated again (``group``).

This module only orchestrates and times the phases: the sidecar decodes the state, the
controller restores it (``Controller.restore``) and replays the journal (``Controller.replay``).
A store is never empty while it has a journal: without a snapshot, the journal is replayed into
the fresh controller.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from rolloutd.checkpoint import sidecar, submissions
from rolloutd.checkpoint.checkpointer import Checkpointer
from rolloutd.checkpoint.format import Manifest, fingerprint_diff
from rolloutd.checkpoint.store import SnapshotReader
from rolloutd.domain.controller import Controller
from rolloutd.domain.errors import RestoreRefused
from rolloutd.domain.group import GroupState
from rolloutd.domain.report import (
    Disposition,
    PhaseClock,
    RecoveryState,
    RestorePhase,
    RestoreReport,
)
from rolloutd.domain.state import ControllerState

log = logging.getLogger(__name__)


class Granularity(enum.Enum):
    SIBLING = "sibling"
    GROUP = "group"


def differing_keys(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """What a refusal names: each differing key with both values."""
    return [
        f"{k}: snapshot {saved.get(k)!r} != now {current.get(k)!r}"
        for k in fingerprint_diff(saved, current)
    ]


async def restore(
    controller: Controller,
    store: SnapshotReader,
    checkpointer: Checkpointer,
    spec: str,
    fingerprint: Mapping[str, Any],
    granularity: Granularity,
) -> RestoreReport:
    """Restores into a fresh controller (before ``controller.start()``); raises RestoreRefused."""
    clock = PhaseClock()
    report = RestoreReport(started_ns=time.time_ns(), ended_ns=0, phases=clock.phases)
    try:
        manifest = await _run(
            controller, store, checkpointer, spec, fingerprint, granularity, clock, report
        )
    except BaseException as exc:
        report.error = exc
        report.ended_ns = time.time_ns()
        checkpointer.observer.restored(report)
        raise
    report.ended_ns = time.time_ns()
    if manifest is not None:
        log.info(
            "restored snapshot %d in %.2fs: groups %s, siblings %s, skipped %s",
            manifest.sequence,
            report.seconds,
            {k.value: v for k, v in report.groups.items()},
            {k.value: v for k, v in report.siblings.items()},
            [(s.sequence, s.reason) for s in report.skipped],
        )
    checkpointer.observer.restored(report)
    return report


async def _run(
    controller: Controller,
    store: SnapshotReader,
    checkpointer: Checkpointer,
    spec: str,
    fingerprint: Mapping[str, Any],
    granularity: Granularity,
    clock: PhaseClock,
    report: RestoreReport,
) -> Manifest | None:
    with clock.phase(RestorePhase.RESOLVE_SNAPSHOT):
        resolution = await asyncio.to_thread(store.resolve, spec)
        report.skipped = list(resolution.skipped)
        for s in report.skipped:
            log.warning("snapshot %d skipped: %s", s.sequence, s.reason)
        snapshot = resolution.snapshot
        if snapshot is None and report.skipped:
            log.error("no snapshot verifies; starting fresh")
            return None
        if snapshot is not None:
            manifest = snapshot.manifest
            report.sequence, report.tag = manifest.sequence, manifest.tag
            diff = differing_keys(manifest.fingerprint, fingerprint)
            if diff:
                raise RestoreRefused(
                    f"snapshot {manifest.sequence} was taken under a different configuration: "
                    + "; ".join(diff)
                    + _advice(fingerprint_diff(manifest.fingerprint, fingerprint))
                )
    if snapshot is None:
        with clock.phase(RestorePhase.RECOVERY_LEDGER):
            events = await asyncio.to_thread(store.acks_after, 0)
            await controller.replay(events)
        log.info("no snapshot to restore (%s); replayed %d journal records", spec, len(events))
        return None

    with clock.phase(RestorePhase.DATALOADER):
        state = sidecar.decode(snapshot.sidecar)  # cursor, submitted and re-admitted prompts
        state = submissions.attach(state, snapshot.submitted)

    with clock.phase(RestorePhase.BUFFER):
        rows = await asyncio.to_thread(snapshot.rows)
        state = replace(state, buffer=replace(state.buffer, new_rows=rows))

    with clock.phase(RestorePhase.REPLAY_METADATA):
        report.groups = _recovery_counts(state)
        await controller.restore(state)

    with clock.phase(RestorePhase.RECOVERY_LEDGER):
        events = await asyncio.to_thread(store.acks_after, manifest.acks_through)
        await controller.replay(events)

    with clock.phase(RestorePhase.REDISPATCH):
        started = time.perf_counter()
        reused = rerun = 0
        for g in controller.generating_groups():
            staged = len(g.samples)
            missing = await controller.resume_group(g, rerun_all=granularity is Granularity.GROUP)
            rerun += len(missing)
            reused += staged if granularity is Granularity.SIBLING else 0
        report.siblings = {Disposition.REUSED: reused, Disposition.RERUN: rerun}
        report.redispatch_s = time.perf_counter() - started

    checkpointer.adopt(manifest, state)
    return manifest


def _advice(keys: list[str]) -> str:
    if "fleet.replicas" in keys or "fleet.replica" in keys:
        return (
            " (each replica owns a share of the dataset that depends on the fleet's size, so a "
            "store cannot change fleets mid-run: start each replica with the --replica/--replicas "
            "it was started with, or begin a new run on empty stores, or with --restore none; "
            "see docs/operations.md, scaling)"
        )
    return " (start with --restore none to begin afresh, or restore with the old configuration)"


def _recovery_counts(state: ControllerState) -> dict[RecoveryState, int]:
    """Groups by the state the snapshot found them in (leases are requeued after)."""
    counts = {s: 0 for s in RecoveryState}
    for meta in state.buffer.groups.values():
        assert meta is not None  # a decoded state is whole
        if meta.state is GroupState.GENERATING:
            counts[RecoveryState.UNFINISHED] += 1
        else:
            counts[RecoveryState(meta.state.value)] += 1
    return counts
