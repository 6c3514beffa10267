"""Finished spans of every shape the SDK records (events, links, statuses, remote parents, trace
state, every attribute type), SDK spans and light spans alike, for the encoder tests."""

from __future__ import annotations

from collections.abc import Iterator

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace import Tracer as SdkTracer
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

from rolloutd.telemetry.light_spans import LightTracer
from rolloutd.telemetry.otel_sdk import GatedTracerProvider

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


def light_recorded(resource: Resource, limits: SpanLimits | None = None) -> Iterator[ReadableSpan]:
    """Light spans (``rolloutd.telemetry.light_spans``) of every shape, recorded by the
    service's tracer provider with ``resource``; ``limits`` bound their events and links."""
    exporter = InMemorySpanExporter()
    provider = GatedTracerProvider(resource=resource, span_limits=limits, shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    scoped, bare = (
        provider.get_tracer("rolloutd", "1.2.3", schema_url="https://example.com/s"),
        provider.get_tracer("other"),
    )
    assert isinstance(scoped, SdkTracer) and isinstance(bare, SdkTracer)
    light, light_bare = LightTracer(scoped), LightTracer(bare)
    if limits is not None:
        light.limits = light_bare.limits = limits
    root = light.start(
        "root",
        None,
        SpanKind.SERVER,
        {"s": "text", "empty": "", "t": True, "f": False, "i": 42, "neg": -7, "big": 2**62,
         "zero": 0, "x": 0.5, "nil": 0.0, "one": 1.0, "yes": True, "ünï": "ß", "": 3},
    )  # fmt: skip
    root.add_event("event", {"n": 1, "s": "e"}, timestamp=1_000)
    root.add_event("")
    root.add_link(REMOTE, {"rolloutd.group.id": 17})
    root.add_link(LOCAL)
    parent = set_span_in_context(root)
    child = light_bare.start("child", parent, SpanKind.CLIENT, {"wide": 300, "wider": 2**40})
    child.set_status(Status(StatusCode.ERROR, "it failed"))
    child.end()
    raising = light_bare.start("raises", parent, SpanKind.PRODUCER, {})
    raising.record_exception(ValueError("boom"))
    raising.set_status(Status(StatusCode.ERROR))
    raising.end()
    root.end()
    remote = set_span_in_context(NonRecordingSpan(REMOTE))
    light.start("under remote", remote, SpanKind.CONSUMER, {"rpc.system": "grpc"}).end()
    ok = light_bare.start("ok", None, SpanKind.INTERNAL, {})
    ok.set_status(Status(StatusCode.OK))
    ok.end()
    light_bare.start("", None, SpanKind.INTERNAL, {f"k{i}": i for i in range(8)}).end()
    common = {"rpc.system": "grpc", "rpc.method": "Fetch", "n": 300, "x": 0.25}
    for own in ({}, {"own": "o", "i": 2**40}, {"n": 5}):  # the last replaces a common value
        light.start("common", None, SpanKind.SERVER, own, None, common).end()
    changed = light.start("common, set anew", None, SpanKind.SERVER, {}, None, common)
    changed.set_attribute("rpc.method", "Ack")
    changed.end()
    provider.shutdown()
    yield from exporter.get_finished_spans()
