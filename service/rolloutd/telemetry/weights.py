"""A weight update as a span tree, recorded after the fact with its true times.

``rolloutd.weights.update`` has one child per phase that ran (``rolloutd.weights.update.transfer``
…). Recorded inside the RPC handler, the root is a child of the gRPC server span, which continues
the trainer's trace. Attribute keys live under ``rolloutd.weights.*``.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from opentelemetry.util.types import AttributeValue

from rolloutd.domain.weights import WeightsOutcome, WeightsReport

WEIGHTS_SPAN = "rolloutd.weights.update"


class WeightsAttr:
    """Attribute keys of ``rolloutd.weights.update`` and its phase spans."""

    VERSION = "rolloutd.weights.version"
    SOURCE = "rolloutd.weights.source"
    OUTCOME = "rolloutd.weights.outcome"
    FILES = "rolloutd.weights.files"
    BYTES = "rolloutd.weights.bytes"
    PAUSED_SECONDS = "rolloutd.weights.paused_seconds"
    PHASE = "rolloutd.weights.phase"
    KIND = "rolloutd.weights.kind"
    BASE_VERSION = "rolloutd.weights.base_version"
    DENSITY = "rolloutd.weights.density"


def record_weights_update(tracer: Tracer, report: WeightsReport) -> None:
    """Records the tree under the current span; ERROR (with the reason) unless the update loaded."""
    attributes: dict[str, AttributeValue] = {
        WeightsAttr.VERSION: report.version,
        WeightsAttr.SOURCE: report.source.value,
        WeightsAttr.OUTCOME: report.outcome.value,
        WeightsAttr.FILES: report.files,
        WeightsAttr.BYTES: report.bytes,
        WeightsAttr.PAUSED_SECONDS: report.paused_s,
        WeightsAttr.KIND: report.kind.value,
    }
    if report.base_version is not None:
        attributes[WeightsAttr.BASE_VERSION] = report.base_version
    if report.density is not None:
        attributes[WeightsAttr.DENSITY] = report.density
    root = tracer.start_span(
        WEIGHTS_SPAN, kind=SpanKind.INTERNAL, attributes=attributes, start_time=report.started_ns
    )
    parent = trace.set_span_in_context(root)
    for timing in report.phases:
        span = tracer.start_span(
            f"{WEIGHTS_SPAN}.{timing.phase.value}",
            context=parent,
            kind=SpanKind.INTERNAL,
            attributes={WeightsAttr.PHASE: timing.phase.value},
            start_time=timing.start_ns,
        )
        span.end(end_time=timing.end_ns)
    if report.outcome is not WeightsOutcome.LOADED and report.error is not None:
        root.set_status(Status(StatusCode.ERROR, f"{type(report.error).__name__}: {report.error}"))
        root.record_exception(report.error, timestamp=report.ended_ns, escaped=True)
    root.end(end_time=report.ended_ns)
