"""Light spans (``rolloutd.telemetry.light_spans``) reach the span processors as the SDK's spans
would: same context, parent, sampling, attributes, events, links, status, resource and scope."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased
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
from tests.telemetry.span_shapes import LOCAL, REMOTE

pytestmark = pytest.mark.usefixtures("clean_env")


def provider(sampler=ALWAYS_ON) -> tuple[SdkTracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tp = TracerProvider(
        resource=Resource({"service.name": "rolloutd"}), sampler=sampler, shutdown_on_exit=False
    )
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = tp.get_tracer("rolloutd", "9.9", schema_url="https://example.com/s")
    assert isinstance(tracer, SdkTracer)
    return tracer, exporter


def exercise(span, error: ValueError) -> None:
    span.set_attribute("late", 3)
    span.set_attributes({"more": "yes"})
    span.add_event("event", {"n": 1}, timestamp=5)
    span.add_link(REMOTE, {"rolloutd.group.id": 9})
    span.add_link(LOCAL)
    span.record_exception(error, timestamp=6)
    span.set_status(Status(StatusCode.ERROR, "failed"))
    span.update_name("renamed")
    span.end(end_time=7)


def comparable(span: ReadableSpan) -> dict:
    return {
        "name": span.name,
        "kind": span.kind,
        "parent": span.parent,
        "trace_id": span.context.trace_id,
        "flags": span.context.trace_flags,
        "attributes": dict(span.attributes),
        "events": [(e.name, dict(e.attributes), e.timestamp) for e in span.events],
        "links": [(link.context, dict(link.attributes)) for link in span.links],
        "status": (span.status.status_code, span.status.description),
        "resource": span.resource,
        "scope": span.instrumentation_scope,
        "start_time": span.start_time,
        "end_time": span.end_time,
        "dropped": (span.dropped_attributes, span.dropped_events, span.dropped_links),
    }


def test_a_light_span_reaches_the_processors_as_the_sdk_span_would():
    tracer, exporter = provider()
    parent = set_span_in_context(NonRecordingSpan(REMOTE))
    attributes = {"rpc.system": "grpc", "n": 1, "x": 0.5, "ok": True}
    error = ValueError("boom")
    try:
        raise error
    except ValueError:
        pass
    exercise(
        tracer.start_span("rpc", parent, SpanKind.SERVER, dict(attributes), start_time=4), error
    )
    exercise(LightTracer(tracer).start("rpc", parent, SpanKind.SERVER, dict(attributes), 4), error)
    sdk, light = exporter.get_finished_spans()
    assert comparable(light) == comparable(sdk)
    assert light.parent == REMOTE and light.context.span_id != sdk.context.span_id


def test_the_sampler_decides_and_an_unrecorded_span_still_carries_its_context():
    tracer, exporter = provider(ParentBased(ALWAYS_OFF))
    light = LightTracer(tracer)
    root = light.start("root", None, SpanKind.INTERNAL, {})
    assert not root.is_recording() and root.get_span_context().is_valid
    assert not root.get_span_context().trace_flags.sampled
    root.end()
    sampled_parent = set_span_in_context(NonRecordingSpan(REMOTE))  # a sampled remote parent
    child = light.start("child", sampled_parent, SpanKind.SERVER, {})
    assert child.is_recording()
    assert child.get_span_context().trace_id == REMOTE.trace_id
    child.end()
    [span] = exporter.get_finished_spans()
    assert span.name == "child"


def test_links_and_events_keep_the_sdks_limits(monkeypatch):
    monkeypatch.setenv("OTEL_SPAN_LINK_COUNT_LIMIT", "2")
    monkeypatch.setenv("OTEL_SPAN_EVENT_COUNT_LIMIT", "1")
    tracer, exporter = provider()
    span = LightTracer(tracer).start("fetch", None, SpanKind.SERVER, {})
    for i in range(1, 5):
        span.add_link(SpanContext(1, i, is_remote=False, trace_flags=TraceFlags(1)))
        span.add_event(f"e{i}")
    span.end()
    [finished] = exporter.get_finished_spans()
    assert len(finished.links) == 2 and finished.dropped_links == 2
    assert len(finished.events) == 1 and finished.dropped_events == 3


@pytest.mark.parametrize(
    "parent",
    [
        None,
        SpanContext(
            1, 2, is_remote=True, trace_flags=TraceFlags(1), trace_state=TraceState([("k", "v")])
        ),
        SpanContext(
            1, 2, is_remote=True, trace_flags=TraceFlags(0), trace_state=TraceState([("k", "v")])
        ),
        SpanContext(1, 2, is_remote=False, trace_flags=TraceFlags(0)),
    ],
    ids=["root", "sampled remote parent", "unsampled remote parent", "unsampled local parent"],
)
def test_the_default_samplers_decision_without_calling_it_is_the_samplers(parent):
    """The service's provider with the SDK's default sampler, ParentBased(ALWAYS_ON): a light span
    decides as the sampler would (recorded, sampled, trace state, starting attributes)."""
    exporter = InMemorySpanExporter()
    tp = GatedTracerProvider(
        resource=Resource({"service.name": "rolloutd"}), shutdown_on_exit=False
    )
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = tp.get_tracer("rolloutd")
    assert isinstance(tracer, SdkTracer) and tp.gate.parent_based_always_on
    context = None if parent is None else set_span_in_context(NonRecordingSpan(parent))
    sdk = tracer.start_span("s", context, SpanKind.SERVER, {"n": 1}, start_time=4)
    light = LightTracer(tracer).start("s", context, SpanKind.SERVER, {"n": 1}, 4)
    for span in (sdk, light):
        assert span.get_span_context().is_valid
    recorded = sdk.is_recording()
    assert light.is_recording() == recorded
    assert light.get_span_context().trace_flags == sdk.get_span_context().trace_flags
    assert light.get_span_context().trace_state == sdk.get_span_context().trace_state
    sdk.end(end_time=7)
    light.end(end_time=7)
    finished = [comparable(span) for span in exporter.get_finished_spans()]
    for span in finished:
        span.pop("trace_id")  # a root's is random; a child's is its parent's (flags compared above)
    assert finished == ([finished[0]] * 2 if recorded else [])


def test_common_attributes_come_first_and_stop_being_common_once_a_key_of_theirs_is_set():
    exporter = InMemorySpanExporter()
    tp = GatedTracerProvider(shutdown_on_exit=False)  # the service's: the default sampler
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = tp.get_tracer("rolloutd")
    assert isinstance(tracer, SdkTracer)
    light = LightTracer(tracer)
    common = {"rpc.system": "grpc", "rpc.method": "Ack"}
    kept = light.start("kept", None, SpanKind.SERVER, {"own": 1}, None, common)
    overlapping = light.start("overlap", None, SpanKind.SERVER, {"rpc.method": "X"}, None, common)
    set_one = light.start("set one", None, SpanKind.SERVER, {}, None, common)
    set_many = light.start("set many", None, SpanKind.SERVER, {}, None, common)
    assert kept.common is common and set_one.common is common
    assert overlapping.common is None  # its own value replaces a common one
    kept.set_attribute("late", 2)
    kept.set_attributes({"later": 3})
    assert kept.common is common
    set_one.set_attribute("rpc.method", "Fetch")
    set_many.set_attributes({"x": 1, "rpc.system": "other"})
    assert set_one.common is None and set_many.common is None
    for span in (kept, overlapping, set_one, set_many):
        span.end()
    assert common == {"rpc.system": "grpc", "rpc.method": "Ack"}  # the shared dict unchanged
    by_name = {s.name: list(s.attributes.items()) for s in exporter.get_finished_spans()}
    assert by_name == {
        "kept": [("rpc.system", "grpc"), ("rpc.method", "Ack"), ("own", 1), ("late", 2),
                 ("later", 3)],
        "overlap": [("rpc.system", "grpc"), ("rpc.method", "X")],
        "set one": [("rpc.system", "grpc"), ("rpc.method", "Fetch")],
        "set many": [("rpc.system", "other"), ("rpc.method", "Ack"), ("x", 1)],
    }  # fmt: skip


def test_a_sampler_that_is_not_the_default_makes_the_attributes_its_own():
    tracer, exporter = provider(ParentBased(ALWAYS_ON))
    common = {"rpc.system": "grpc"}
    span = LightTracer(tracer).start("s", None, SpanKind.SERVER, {"n": 1}, None, common)
    assert span.common is None
    span.end()
    [finished] = exporter.get_finished_spans()
    assert dict(finished.attributes) == {"rpc.system": "grpc", "n": 1}
