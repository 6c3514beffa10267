"""rolloutd's OTLP span encoder writes, byte for byte, the request the exporter's stock encoder
makes, for every kind of span the SDK records."""

from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits
from opentelemetry.trace import StatusCode

from rolloutd.telemetry.light_spans import LightSpan
from rolloutd.telemetry.otlp_spans import SpanEncoder
from tests.telemetry.span_shapes import LOCAL, light_recorded, recorded

pytestmark = pytest.mark.usefixtures("clean_env")  # the SDK on


def same_request(spans: list[ReadableSpan]) -> None:
    assert len(spans) >= 5
    ours = ExportTraceServiceRequest.FromString(SpanEncoder().encode(spans))
    stock = encode_spans(spans)
    assert ours == stock
    assert ours.SerializeToString(deterministic=True) == stock.SerializeToString(deterministic=True)


def test_every_kind_of_span_encodes_as_the_stock_encoder_does():
    resource = Resource({"service.name": "rolloutd", "n": 3}, schema_url="https://example.com/r")
    same_request(list(recorded(resource)))


def test_light_spans_of_every_shape_encode_as_the_stock_encoder_does():
    """Light spans are read from their fields, not through ReadableSpan's properties."""
    resource = Resource({"service.name": "rolloutd"}, schema_url="https://example.com/r")
    spans = list(light_recorded(resource))
    assert all(type(s) is LightSpan for s in spans)
    assert {s.status.status_code for s in spans} == set(StatusCode)
    assert any(s.parent is not None and s.parent.is_remote for s in spans)
    assert any(s.context.trace_state for s in spans)
    assert any(s.common for s in spans) and any(s.name.startswith("common") and not s.common
                                                for s in spans)  # fmt: skip
    same_request(spans)


def test_light_and_sdk_spans_of_one_batch_over_their_limits():
    limits = SpanLimits(max_events=1, max_links=1)
    light = list(light_recorded(Resource({"service.name": "a"}), limits))
    assert any(s.dropped_events for s in light) and any(s.dropped_links for s in light)
    sdk = list(recorded(Resource({"service.name": "a"}), limits))
    mixed = [s for pair in zip(light, sdk, strict=False) for s in pair]
    same_request(mixed)


def test_spans_of_several_resources_and_dropped_attributes_and_events():
    limits = SpanLimits(max_span_attributes=3, max_events=1, max_links=1)
    first = list(recorded(Resource({"service.name": "a"})))
    second = list(recorded(Resource({"service.name": "b"}), limits))
    assert any(s.dropped_attributes for s in second)
    assert any(s.dropped_events for s in second)
    assert any(s.dropped_links for s in second)
    mixed = [s for pair in zip(first, second, strict=True) for s in pair]
    same_request(mixed)


def test_a_span_it_does_not_write_sends_the_batch_through_the_stock_encoder():
    span = ReadableSpan(
        "arrays",
        context=LOCAL,
        resource=Resource({}),
        attributes={"list": ("a", "b"), "n": 1},
        start_time=1,
        end_time=2,
    )
    same_request([span, *recorded(Resource({}))])


@pytest.mark.parametrize("repeat", [1, 3])
def test_an_encoder_reused_across_batches_writes_each_alike(repeat):
    spans = [
        *recorded(Resource({"service.name": "rolloutd"})),
        *light_recorded(Resource({"service.name": "rolloutd"})),
    ]
    encoder = SpanEncoder()
    for _ in range(repeat):
        assert ExportTraceServiceRequest.FromString(encoder.encode(spans)) == encode_spans(spans)


def test_equal_resources_held_by_different_objects_are_one_resource_as_in_the_stock_encoder():
    """Spans are grouped by resource equality, not identity: a run of spans sharing one
    resource object is looked up once, and equal objects still merge."""
    first, second = Resource({"service.name": "a"}), Resource({"service.name": "a"})
    assert first is not second
    spans = [*recorded(first), *recorded(second), *recorded(Resource({"service.name": "b"}))]
    spans += list(recorded(first))
    same_request(spans)
    assert (
        len(ExportTraceServiceRequest.FromString(SpanEncoder().encode(spans)).resource_spans) == 2
    )


@pytest.mark.parametrize(
    "value", [0, 127, 128, 16_383, 16_384, 2**31, 2**63 - 1, -1, -(2**63)], ids=str
)
def test_integer_attributes_of_every_varint_width(value):
    span = ReadableSpan(
        "ints",
        context=LOCAL,
        resource=Resource({}),
        attributes={"n": value, "": value, "same": value},
        start_time=1,
        end_time=2,
    )
    [light] = [s for s in light_recorded(Resource({})) if s.name == "ok"]
    light._attributes.update({"n": value, "": value, "same": value})
    same_request([span, light, *recorded(Resource({})), *light_recorded(Resource({}))])
