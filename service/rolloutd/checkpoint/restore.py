"""Restore: rebuild the controller from a snapshot plus the ack journal, in six phases.

1. ``resolve_snapshot`` pick the snapshot (latest, a sequence or a tag); newer ones that do not
                        verify are skipped with a reason; a changed semantic configuration refuses.
2. ``dataloader``       the sampler's cursor, submitted and re-admitted prompts.
3. ``buffer``           the live rows of the snapshot's segments.
4. ``replay_metadata``  groups, leases, acks and counters from the sidecar; leased-unacked groups
                        become available again; the cursor must be ahead of every group's position.
5. ``recovery_ledger``  acks journaled after the snapshot are applied, so no acked group is
                        delivered again and no acked position is admitted again.
6. ``redispatch``       unfinished groups: staged siblings reused, missing ones generated
                        (granularity ``sibling``), or the whole group generated again (``group``).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rolloutd.checkpoint import state as sidecar_state
from rolloutd.checkpoint.checkpointer import Checkpointer
from rolloutd.checkpoint.format import Manifest, fingerprint_diff
from rolloutd.checkpoint.store import SnapshotReader
from rolloutd.domain.buffer import GroupMeta
from rolloutd.domain.controller import Controller
from rolloutd.domain.group import GroupState
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.report import (
    Disposition,
    PhaseClock,
    RecoveryState,
    RestorePhase,
    RestoreReport,
)

log = logging.getLogger(__name__)


class Granularity(enum.Enum):
    SIBLING = "sibling"
    GROUP = "group"


class RestoreRefused(RuntimeError):
    """The snapshot cannot be used as asked; the message says why and what differs."""


@dataclass(frozen=True)
class RestoreResult:
    report: RestoreReport
    manifest: Manifest | None
    groups: dict[int, GroupMeta]


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
        if snapshot is None:
            if report.skipped:
                log.error("no snapshot verifies; starting fresh")
            else:
                log.info("no snapshot to restore (%s); starting fresh", spec)
            return None
        manifest = snapshot.manifest
        report.sequence, report.tag = manifest.sequence, manifest.tag
        diff = differing_keys(manifest.fingerprint, fingerprint)
        if diff:
            raise RestoreRefused(
                f"snapshot {manifest.sequence} was taken under a different configuration: "
                + "; ".join(diff)
                + " (start with --restore none to begin afresh, or restore with the old configuration)"
            )
        sidecar = snapshot.sidecar

    with clock.phase(RestorePhase.DATALOADER):
        controller.sampler.load_state(sidecar["sampler"])

    with clock.phase(RestorePhase.BUFFER):
        rows = await asyncio.to_thread(snapshot.rows)

    with clock.phase(RestorePhase.REPLAY_METADATA):
        groups = _replay_metadata(controller, sidecar, rows)
        if controller.weights_path and controller.policy_version > controller.engine.policy_version:
            await controller.engine.update_weights(
                controller.weights_path, controller.policy_version
            )
        counts = {state: 0 for state in RecoveryState}
        for g in controller.buffer.groups.values():
            if g.state is GroupState.GENERATING:
                counts[RecoveryState.UNFINISHED] += 1
            else:
                counts[RecoveryState(g.state.value)] += 1
        report.groups = counts
        # Leases did not survive the restart: their groups become available again.
        async with controller.barrier.mutation(MutationKind.RESTORE):
            for lease_id in list(controller.buffer.leases):
                controller.buffer.requeue(lease_id)

    with clock.phase(RestorePhase.RECOVERY_LEDGER):
        entries = await asyncio.to_thread(store.read_acks, manifest.acks_through)
        _replay_acks(controller, entries)

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

    checkpointer.adopt(manifest, groups)
    return manifest


def _replay_metadata(
    controller: Controller, sidecar: dict[str, Any], rows: list[Any]
) -> dict[int, GroupMeta]:
    metas = {m.group_id: m for m in (sidecar_state.meta_from_json(d) for d in sidecar["groups"])}
    cursor = controller.sampler.cursor
    ahead = sorted(
        str(m.position) for m in metas.values() if m.position is not None and m.position >= cursor
    )
    if ahead:
        raise RestoreRefused(
            f"sampler cursor {cursor} is not ahead of restored group positions {', '.join(ahead[:10])}"
            + (" ..." if len(ahead) > 10 else "")
        )
    c = sidecar["controller"]
    controller.buffer.load(
        metas.values(),
        rows,
        {d["lease_id"]: sidecar_state.lease_from_json(d) for d in sidecar["leases"]},
        {d["lease_id"]: sidecar_state.ack_from_json(d) for d in sidecar["acks"]},
        dict(sidecar["finalized_leases"]),
        int(c["next_row_id"]),
    )
    controller.next_group_id = int(c["next_group_id"])
    controller.policy_version = int(c["policy_version"])
    controller.weights_path = c["weights_path"]
    controller.max_acked_step = int(c["max_acked_step"])
    controller.finalized_through = int(c["finalized_through"])
    controller.counters = sidecar_state.counters_from_json(c["counters"])
    controller.lost_acks = [
        (int(d["trainer_step"]), [sidecar_state.admission_from_json(a) for a in d["admissions"]])
        for d in sidecar["lost_acks"]
    ]
    return metas


def _replay_acks(controller: Controller, entries: list[Any]) -> None:
    """Acks after the snapshot: applied to groups it holds; for groups it lacks (admitted after
    it), their prompts are never admitted again, but kept so a Rewind can re-admit them."""
    for entry in entries:
        record = sidecar_state.ack_from_json(entry.record)
        if (
            record.lease_id in controller.buffer.acks
            or record.lease_id in controller.buffer.finalized_leases
        ):
            continue
        lost_ids = set(controller.buffer.apply_journaled_ack(record))
        controller.counters.acked_groups += len(record.group_ids)
        controller.max_acked_step = max(controller.max_acked_step, record.trainer_step)
        lost = [
            sidecar_state.admission_from_json(g)
            for g in entry.record["groups"]
            if g["group_id"] in lost_ids
        ]
        for admission in lost:
            controller.sampler.skip(admission)
        if lost:
            controller.lost_acks.append((record.trainer_step, lost))
