"""Checkpoint and restore reports as span trees, recorded after the fact with their true times.

``rolloutd.checkpoint`` has one child per phase (``rolloutd.checkpoint.barrier_wait`` …), and
``rolloutd.restore`` likewise. The root becomes a child of whatever span is current when the report
is recorded (the gRPC server span of a ``Checkpoint`` call), or of an explicit ``context``; a
periodic checkpoint outside any span starts its own trace. Attribute keys live under
``rolloutd.checkpoint.*`` and ``rolloutd.restore.*``.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.util.types import AttributeValue

from rolloutd.domain.report import (
    CheckpointPhase,
    CheckpointReport,
    Outcome,
    PhaseTiming,
    RestorePhase,
    RestoreReport,
)

CHECKPOINT_SPAN = "rolloutd.checkpoint"
RESTORE_SPAN = "rolloutd.restore"
SKIPPED_SNAPSHOT_EVENT = "rolloutd.restore.snapshot_skipped"


class CheckpointAttr:
    """Attribute keys of ``rolloutd.checkpoint`` and its phase spans."""

    TRIGGER = "rolloutd.checkpoint.trigger"
    SEQUENCE = "rolloutd.checkpoint.sequence"
    TAG = "rolloutd.checkpoint.tag"
    TRAINER_STEP = "rolloutd.checkpoint.trainer_step"
    OUTCOME = "rolloutd.checkpoint.outcome"
    REASON = "rolloutd.checkpoint.reason"
    ROWS = "rolloutd.checkpoint.rows"
    """Prefix: ``rolloutd.checkpoint.rows.<new|removed|live>``."""
    BYTES = "rolloutd.checkpoint.bytes"
    """Prefix: ``rolloutd.checkpoint.bytes.<segments|groups|sidecar|total>``."""
    PHASE = "rolloutd.checkpoint.phase"


class RestoreAttr:
    """Attribute keys of ``rolloutd.restore``, its phase spans and its events."""

    SEQUENCE = "rolloutd.restore.sequence"
    TAG = "rolloutd.restore.tag"
    OUTCOME = "rolloutd.restore.outcome"
    GROUPS = "rolloutd.restore.groups"
    """Prefix: ``rolloutd.restore.groups.<committed|leased|acked|unfinished>``."""
    SIBLINGS = "rolloutd.restore.siblings"
    """Prefix: ``rolloutd.restore.siblings.<reused|rerun>``."""
    TOKENS = "rolloutd.restore.tokens"
    """Prefix: ``rolloutd.restore.tokens.<reused|regenerated>`` (partial tokens)."""
    REDISPATCH_SECONDS = "rolloutd.restore.redispatch_seconds"
    SKIPPED_COUNT = "rolloutd.restore.skipped.count"
    SKIPPED_SEQUENCE = "rolloutd.restore.skipped.sequence"
    SKIPPED_REASON = "rolloutd.restore.skipped.reason"
    PHASE = "rolloutd.restore.phase"


def checkpoint_attributes(report: CheckpointReport) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {
        CheckpointAttr.TRIGGER: report.trigger.value,
        CheckpointAttr.OUTCOME: report.outcome.value,
        CheckpointAttr.REASON: report.reason.value,
    }
    if report.sequence is not None:
        attributes[CheckpointAttr.SEQUENCE] = report.sequence
    if report.tag:
        attributes[CheckpointAttr.TAG] = report.tag
    if report.trainer_step is not None:
        attributes[CheckpointAttr.TRAINER_STEP] = report.trainer_step
    for kind, rows in report.rows.items():
        attributes[f"{CheckpointAttr.ROWS}.{kind.value}"] = rows
    for part, size in report.size_bytes.items():
        attributes[f"{CheckpointAttr.BYTES}.{part.value}"] = size
    return attributes


def restore_outcome(report: RestoreReport) -> Outcome:
    failed = report.error is not None or any(p.error is not None for p in report.phases)
    return Outcome.FAILED if failed else Outcome.COMPLETED


def restore_attributes(report: RestoreReport) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {
        RestoreAttr.OUTCOME: restore_outcome(report).value,
        RestoreAttr.REDISPATCH_SECONDS: report.redispatch_s,
        RestoreAttr.SKIPPED_COUNT: len(report.skipped),
    }
    if report.sequence is not None:
        attributes[RestoreAttr.SEQUENCE] = report.sequence
    if report.tag:
        attributes[RestoreAttr.TAG] = report.tag
    for state, groups in report.groups.items():
        attributes[f"{RestoreAttr.GROUPS}.{state.value}"] = groups
    attributes.update(redispatch_attributes(report))
    return attributes


def redispatch_attributes(report: RestoreReport) -> dict[str, AttributeValue]:
    """What redispatch did with unfinished groups: on the restore span and its redispatch span."""
    attributes: dict[str, AttributeValue] = {}
    for disposition, siblings in report.siblings.items():
        attributes[f"{RestoreAttr.SIBLINGS}.{disposition.value}"] = siblings
    for token_disposition, tokens in report.tokens.items():
        attributes[f"{RestoreAttr.TOKENS}.{token_disposition.value}"] = tokens
    return attributes


def record_checkpoint(
    tracer: Tracer, report: CheckpointReport, context: Context | None = None
) -> None:
    """Records ``rolloutd.checkpoint`` and its phases; ERROR on a failed attempt or phase."""
    root = tracer.start_span(
        CHECKPOINT_SPAN,
        context=context,
        kind=SpanKind.INTERNAL,
        attributes=checkpoint_attributes(report),
        start_time=report.started_ns,
    )
    _record_phases(tracer, root, report.phases, CHECKPOINT_SPAN, CheckpointAttr.PHASE, context)
    if report.outcome is Outcome.FAILED:
        root.set_status(Status(StatusCode.ERROR, report.reason.value))
        if report.error is not None:
            root.record_exception(report.error, timestamp=report.ended_ns, escaped=True)
    root.end(end_time=report.ended_ns)


def record_restore(tracer: Tracer, report: RestoreReport, context: Context | None = None) -> None:
    """Records ``rolloutd.restore`` and its phases; each skipped snapshot is an event with its
    reason. ERROR when the restore or one of its phases failed."""
    root = tracer.start_span(
        RESTORE_SPAN,
        context=context,
        kind=SpanKind.INTERNAL,
        attributes=restore_attributes(report),
        start_time=report.started_ns,
    )
    skip_time = report.phases[0].end_ns if report.phases else report.started_ns
    for skipped in report.skipped:
        root.add_event(
            SKIPPED_SNAPSHOT_EVENT,
            {
                RestoreAttr.SKIPPED_SEQUENCE: skipped.sequence,
                RestoreAttr.SKIPPED_REASON: skipped.reason,
            },
            timestamp=skip_time,
        )
    _record_phases(
        tracer,
        root,
        report.phases,
        RESTORE_SPAN,
        RestoreAttr.PHASE,
        context,
        {RestorePhase.REDISPATCH: redispatch_attributes(report)},
    )
    if restore_outcome(report) is Outcome.FAILED:
        error = report.error or next(p.error for p in report.phases if p.error is not None)
        root.set_status(Status(StatusCode.ERROR, _describe(error)))
        if report.error is not None:
            root.record_exception(report.error, timestamp=report.ended_ns, escaped=True)
    root.end(end_time=report.ended_ns)


def _record_phases(
    tracer: Tracer,
    root: Span,
    phases: list[PhaseTiming],
    prefix: str,
    phase_attr: str,
    context: Context | None,
    extra: Mapping[CheckpointPhase | RestorePhase, Mapping[str, AttributeValue]] | None = None,
) -> None:
    parent = trace.set_span_in_context(root, context)
    for timing in phases:
        attributes: Mapping[str, AttributeValue] = {
            phase_attr: timing.phase.value,
            **(extra or {}).get(timing.phase, {}),
        }
        span = tracer.start_span(
            f"{prefix}.{timing.phase.value}",
            context=parent,
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            start_time=timing.start_ns,
        )
        if timing.error is not None:
            span.set_status(Status(StatusCode.ERROR, _describe(timing.error)))
            span.record_exception(timing.error, timestamp=timing.end_ns, escaped=True)
        span.end(end_time=timing.end_ns)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
