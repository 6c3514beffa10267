from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import StatusCode

from rolloutd.domain.report import CheckpointPhase, Reason, RestorePhase
from rolloutd.telemetry.spans import (
    CHECKPOINT_SPAN,
    RESTORE_SPAN,
    SKIPPED_SNAPSHOT_EVENT,
    CheckpointAttr,
    RestoreAttr,
    record_checkpoint,
    record_restore,
)
from tests.telemetry.reports import checkpoint_report, restore_report


def by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    named = {s.name: s for s in spans}
    assert len(named) == len(spans), [s.name for s in spans]
    return named


def test_checkpoint_is_a_root_with_one_child_per_phase_at_the_reported_times(span_exporter):
    provider, exporter = span_exporter
    report = checkpoint_report()
    record_checkpoint(provider.get_tracer("test"), report)

    spans = by_name(exporter.get_finished_spans())
    root = spans.pop(CHECKPOINT_SPAN)
    assert sorted(spans) == sorted(f"rolloutd.checkpoint.{p.value}" for p in CheckpointPhase)
    assert root.parent is None
    assert (root.start_time, root.end_time) == (report.started_ns, report.ended_ns)
    for timing in report.phases:
        child = spans[f"rolloutd.checkpoint.{timing.phase.value}"]
        assert child.parent is not None and child.parent.span_id == root.context.span_id
        assert child.context.trace_id == root.context.trace_id
        assert (child.start_time, child.end_time) == (timing.start_ns, timing.end_ns)
        assert child.attributes == {CheckpointAttr.PHASE: timing.phase.value}
        assert child.status.status_code is StatusCode.UNSET
    assert root.status.status_code is StatusCode.UNSET
    assert dict(root.attributes or {}) == {
        "rolloutd.checkpoint.trigger": "on_demand",
        "rolloutd.checkpoint.outcome": "completed",
        "rolloutd.checkpoint.reason": "completed",
        "rolloutd.checkpoint.sequence": 7,
        "rolloutd.checkpoint.tag": "step-40",
        "rolloutd.checkpoint.trainer_step": 40,
        "rolloutd.checkpoint.rows.new": 120,
        "rolloutd.checkpoint.rows.removed": 8,
        "rolloutd.checkpoint.rows.live": 512,
        "rolloutd.checkpoint.bytes.segments": 4096,
        "rolloutd.checkpoint.bytes.sidecar": 512,
        "rolloutd.checkpoint.bytes.total": 4608,
    }


def test_a_failed_phase_and_its_checkpoint_are_errors_with_the_exception(span_exporter):
    provider, exporter = span_exporter
    report = checkpoint_report(failing=CheckpointPhase.BUFFER_SAVE)
    record_checkpoint(provider.get_tracer("test"), report)

    spans = by_name(exporter.get_finished_spans())
    root = spans.pop(CHECKPOINT_SPAN)
    assert sorted(spans) == [
        "rolloutd.checkpoint.barrier_wait",
        "rolloutd.checkpoint.buffer_save",
        "rolloutd.checkpoint.exclusive_hold",
    ]
    failed = spans["rolloutd.checkpoint.buffer_save"]
    assert failed.status.status_code is StatusCode.ERROR
    assert "No space left on device" in (failed.status.description or "")
    [event] = failed.events
    assert event.name == "exception"
    assert event.attributes is not None
    assert event.attributes["exception.type"] == "OSError"
    assert spans["rolloutd.checkpoint.barrier_wait"].status.status_code is StatusCode.UNSET

    assert root.status.status_code is StatusCode.ERROR
    assert root.status.description == Reason.IO_ERROR.value
    assert root.attributes is not None
    assert root.attributes[CheckpointAttr.OUTCOME] == "failed"
    assert CheckpointAttr.SEQUENCE not in root.attributes
    assert [e.name for e in root.events] == ["exception"]


def test_a_skipped_attempt_is_a_span_without_phases(span_exporter):
    provider, exporter = span_exporter
    record_checkpoint(provider.get_tracer("test"), checkpoint_report(skipped=Reason.NO_CHANGES))
    [root] = exporter.get_finished_spans()
    assert root.name == CHECKPOINT_SPAN
    assert root.attributes is not None
    assert root.attributes[CheckpointAttr.OUTCOME] == "skipped"
    assert root.attributes[CheckpointAttr.REASON] == "no_changes"
    assert root.status.status_code is StatusCode.UNSET


def test_the_checkpoint_nests_under_the_current_span(span_exporter):
    provider, exporter = span_exporter
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("rolloutd.v1.RolloutService/Checkpoint") as rpc:
        record_checkpoint(tracer, checkpoint_report())
    spans = by_name(exporter.get_finished_spans())
    root = spans[CHECKPOINT_SPAN]
    assert root.parent is not None
    assert root.parent.span_id == rpc.get_span_context().span_id
    assert {s.context.trace_id for s in spans.values()} == {rpc.get_span_context().trace_id}


def test_the_checkpoint_nests_under_an_explicit_context(span_exporter):
    provider, exporter = span_exporter
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("request") as request:
        context = trace.set_span_in_context(request)
    record_checkpoint(tracer, checkpoint_report(), context)
    root = by_name(exporter.get_finished_spans())[CHECKPOINT_SPAN]
    assert root.parent is not None
    assert root.parent.span_id == request.get_span_context().span_id


def test_restore_has_phase_children_recovery_counts_and_skipped_snapshot_events(span_exporter):
    provider, exporter = span_exporter
    report = restore_report()
    record_restore(provider.get_tracer("test"), report)

    spans = by_name(exporter.get_finished_spans())
    root = spans.pop(RESTORE_SPAN)
    assert sorted(spans) == sorted(f"rolloutd.restore.{p.value}" for p in RestorePhase)
    for timing in report.phases:
        child = spans[f"rolloutd.restore.{timing.phase.value}"]
        assert child.parent is not None and child.parent.span_id == root.context.span_id
        assert (child.start_time, child.end_time) == (timing.start_ns, timing.end_ns)
    assert (root.start_time, root.end_time) == (report.started_ns, report.ended_ns)
    assert root.status.status_code is StatusCode.UNSET
    assert dict(root.attributes or {}) == {
        "rolloutd.restore.outcome": "completed",
        "rolloutd.restore.sequence": 6,
        "rolloutd.restore.tag": "step-30",
        "rolloutd.restore.groups.committed": 5,
        "rolloutd.restore.groups.leased": 2,
        "rolloutd.restore.groups.acked": 1,
        "rolloutd.restore.groups.unfinished": 3,
        "rolloutd.restore.siblings.reused": 7,
        "rolloutd.restore.siblings.rerun": 5,
        "rolloutd.restore.tokens.reused": 300,
        "rolloutd.restore.tokens.regenerated": 20,
        "rolloutd.restore.redispatch_seconds": 0.004,
        "rolloutd.restore.skipped.count": 1,
    }
    assert dict(spans["rolloutd.restore.redispatch"].attributes or {}) == {
        RestoreAttr.PHASE: "redispatch",
        "rolloutd.restore.siblings.reused": 7,
        "rolloutd.restore.siblings.rerun": 5,
        "rolloutd.restore.tokens.reused": 300,
        "rolloutd.restore.tokens.regenerated": 20,
    }
    assert dict(spans["rolloutd.restore.buffer"].attributes or {}) == {RestoreAttr.PHASE: "buffer"}
    [event] = root.events
    assert event.name == SKIPPED_SNAPSHOT_EVENT
    assert dict(event.attributes or {}) == {
        RestoreAttr.SKIPPED_SEQUENCE: 8,
        RestoreAttr.SKIPPED_REASON: "checksum mismatch in segment-0008.arrow",
    }


def test_a_failed_restore_phase_marks_the_phase_and_the_restore(span_exporter):
    provider, exporter = span_exporter
    record_restore(provider.get_tracer("test"), restore_report(failing=RestorePhase.BUFFER))
    spans = by_name(exporter.get_finished_spans())
    assert spans[RESTORE_SPAN].status.status_code is StatusCode.ERROR
    assert spans["rolloutd.restore.buffer"].status.status_code is StatusCode.ERROR
    assert spans["rolloutd.restore.dataloader"].status.status_code is StatusCode.UNSET
    assert "rolloutd.restore.redispatch" not in spans
    assert dict(spans[RESTORE_SPAN].attributes or {})[RestoreAttr.OUTCOME] == "failed"
