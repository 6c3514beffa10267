"""Finished spans of every shape the SDK records (events, links, statuses, remote parents, trace
state, every attribute type), for the encoder tests."""

from __future__ import annotations

from collections.abc import Iterator

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
    set_span_in_context,
)

REMOTE = SpanContext(
    0x0AF7651916CD43DD8448EB211C80319C,
    0xB7AD6B7169203331,
    is_remote=True,
    trace_flags=TraceFlags(1),
    trace_state=TraceState([("vendor", "x1"), ("other", "y")]),
)
LOCAL = SpanContext(0x1234, 0x5678, is_remote=False, trace_flags=TraceFlags(0))


def recorded(resource: Resource, limits: SpanLimits | None = None) -> Iterator[ReadableSpan]:
    """Spans of every shape, recorded by an SDK provider with ``resource``."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=resource, span_limits=limits, shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    scoped = provider.get_tracer("rolloutd", "1.2.3", schema_url="https://example.com/s")
    bare = provider.get_tracer("other")
    with scoped.start_as_current_span(
        "root",
        kind=SpanKind.SERVER,
        attributes={"s": "text", "empty": "", "t": True, "f": False, "i": 42, "neg": -7,
                    "big": 2**62, "zero": 0, "x": 0.5, "nil": 0.0, "ünï": "ß"},
    ) as root:  # fmt: skip
        root.add_event("event", {"n": 1, "s": "e"}, timestamp=1_000)
        root.add_event("")
        root.add_link(REMOTE, {"rolloutd.group.id": 17})
        root.add_link(LOCAL)
        with bare.start_as_current_span("child", kind=SpanKind.CLIENT) as child:
            child.set_status(Status(StatusCode.ERROR, "it failed"))
        try:
            with bare.start_as_current_span("raises", kind=SpanKind.PRODUCER):
                raise ValueError("boom")
        except ValueError:
            pass
    scoped.start_span("under remote", context=set_span_in_context(NonRecordingSpan(REMOTE)),
                      kind=SpanKind.CONSUMER).end()  # fmt: skip
    bare.start_span("ok", kind=SpanKind.INTERNAL).set_status(Status(StatusCode.OK))
    span = bare.start_span("many", attributes={f"k{i}": i for i in range(8)})
    span.end()
    provider.shutdown()
    yield from exporter.get_finished_spans()
