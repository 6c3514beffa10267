"""Finished spans encoded as an OTLP ``ExportTraceServiceRequest``, byte for byte what the OTLP
exporter's own encoder makes, at a fraction of its cost.

The stock encoder builds a protobuf object for every span, attribute, value, event and link
(about 30 per generation span) and then serializes them: 40-70 us a span here, the largest
share of what tracing cost the service at a hundred groups and as many RPCs a second. Here each
span is written straight to the wire format, and the encodings of repeated attributes (most of
them: operation, model, sampling settings, RPC service), resources and scopes are made once.
Attribute values of other types than ``bool``, ``str``, ``int`` and ``float`` (arrays, bytes; no
span of rolloutd's has them) send the batch through the stock encoder.
``tests/telemetry/test_otlp_spans.py`` checks the bytes against the stock encoder's.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind

_HAS_IS_REMOTE = 0x100
"""``SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK``"""
_IS_REMOTE = 0x200
"""``SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK``"""
_DOUBLE = struct.Struct("<d")
_FIXED64 = struct.Struct("<Q")
_FIXED32 = struct.Struct("<I")
_MAX_FIELDS = 4096


class Unencodable(Exception):
    """A value this encoder does not write; the stock encoder takes the batch."""


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _SMALL[n] if n >= 0 else _varint(n + (1 << 64))
    if n < 0x4000:
        return bytes((n & 0x7F | 0x80, n >> 7))
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = [bytes((i,)) for i in range(0x80)]


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field (``tag`` is the whole key byte: field number << 3 | 2)."""
    return _TAGS[tag] + _varint(len(payload)) + payload


_TAGS = [bytes((i,)) for i in range(0x80)]
_KINDS = [b"\x30" + _SMALL[value + 1] for value in range(len(SpanKind))]
"""``Span.kind`` by ``SpanKind`` value (the protocol's numbers are one higher)."""


class SpanEncoder:
    """Encodes batches of finished spans; keeps the encodings of repeated attributes, resources
    and instrumentation scopes (each cache bounded: cleared when full). One per exporter; its
    caches are only read and set, so a flush racing the export thread is harmless."""

    def __init__(self) -> None:
        self._fields: dict[tuple[int, str, type, Any], bytes] = {}
        self._keys: dict[str, bytes] = {}
        self._resources: dict[Resource, bytes] = {}
        self._scopes: dict[InstrumentationScope | None, bytes] = {}

    def encode(self, spans: Sequence[ReadableSpan]) -> bytes:
        """The serialized ``ExportTraceServiceRequest`` of ``spans``."""
        try:
            return self._request(spans)
        except Unencodable:
            return encode_spans(spans).SerializeToString()

    def _request(self, spans: Sequence[ReadableSpan]) -> bytes:
        # Grouped by resource, then scope, in first-seen order, as the stock encoder does. Both
        # compare by value (a resource hashes its attributes as JSON), so each pair of objects
        # is looked up once, by identity: the spans hold them for the whole call.
        grouped: dict[Resource, dict[InstrumentationScope | None, list[bytes]]] = {}
        known: dict[tuple[int, int], list[bytes]] = {}
        for span in spans:
            resource, scope = span.resource, span.instrumentation_scope or None
            encoded = known.get((id(resource), id(scope)))
            if encoded is None:
                encoded = known[(id(resource), id(scope))] = grouped.setdefault(
                    resource, {}
                ).setdefault(scope, [])
            encoded.append(self._span(span))
        out = []
        for resource, scopes in grouped.items():
            body = [self._resource(resource)]
            for scope, encoded in scopes.items():
                scope_spans = [self._scope(scope), *(_field(0x12, s) for s in encoded)]
                if scope is not None and scope.schema_url:
                    scope_spans.append(_field(0x1A, scope.schema_url.encode()))
                body.append(_field(0x12, b"".join(scope_spans)))
            if resource.schema_url:
                body.append(_field(0x1A, resource.schema_url.encode()))
            out.append(_field(0x0A, b"".join(body)))
        return b"".join(out)

    def _span(self, span: ReadableSpan) -> bytes:
        context = span.get_span_context()
        assert context is not None
        parts = [
            b"\x0a\x10" + context.trace_id.to_bytes(16, "big"),
            b"\x12\x08" + context.span_id.to_bytes(8, "big"),
        ]
        if context.trace_state:
            state = ",".join(f"{k}={v}" for k, v in context.trace_state.items())
            parts.append(_field(0x1A, state.encode()))
        parent = span.parent
        if parent:
            parts.append(b"\x22\x08" + parent.span_id.to_bytes(8, "big"))
        if span.name:
            parts.append(_field(0x2A, span.name.encode()))
        parts.append(_KINDS[span.kind._value_])  # the enum's value, without its descriptor
        if span.start_time:
            parts.append(b"\x39" + _FIXED64.pack(span.start_time))
        if span.end_time:
            parts.append(b"\x41" + _FIXED64.pack(span.end_time))
        if span.attributes:
            parts.append(self._attributes(0x4A, span.attributes))
        if span.dropped_attributes:
            parts.append(b"\x50" + _varint(span.dropped_attributes))
        for event in span.events:
            body = [b"\x09" + _FIXED64.pack(event.timestamp)] if event.timestamp else []
            if event.name:
                body.append(_field(0x12, event.name.encode()))
            if event.attributes:
                body.append(self._attributes(0x1A, event.attributes))
            if event.dropped_attributes:
                body.append(b"\x20" + _varint(event.dropped_attributes))
            parts.append(_field(0x5A, b"".join(body)))
        if span.dropped_events:
            parts.append(b"\x60" + _varint(span.dropped_events))
        for link in span.links:
            body = [
                b"\x0a\x10" + link.context.trace_id.to_bytes(16, "big"),
                b"\x12\x08" + link.context.span_id.to_bytes(8, "big"),
            ]
            if link.attributes:
                body.append(self._attributes(0x22, link.attributes))
            if link.dropped_attributes:
                body.append(b"\x28" + _varint(link.dropped_attributes))
            body.append(b"\x35" + _FIXED32.pack(_flags(link.context)))
            parts.append(_field(0x6A, b"".join(body)))
        if span.dropped_links:
            parts.append(b"\x70" + _varint(span.dropped_links))
        status = b""
        if code := span.status.status_code._value_:
            status = b"\x18" + _SMALL[code]
        if span.status.description:
            status = _field(0x12, span.status.description.encode()) + status
        parts.append(_field(0x7A, status))
        parts.append(b"\x85\x01" + _FIXED32.pack(_flags(parent)))
        return b"".join(parts)

    def _attributes(self, tag: int, attributes: Mapping[str, Any]) -> bytes:
        """Each attribute as a repeated ``KeyValue`` field of number ``tag >> 3``. Most
        attributes repeat from span to span, so whole fields are kept by (tag, key, type,
        value); integers are mostly counters and ids that do not repeat, so only their key's
        encoding is kept."""
        fields = self._fields
        out = []
        for key, value in attributes.items():
            if type(value) is int:
                name = self._keys.get(key)
                if name is None:
                    if len(self._keys) >= _MAX_FIELDS:
                        self._keys.clear()
                    name = self._keys[key] = _field(0x0A, key.encode()) if key else b""
                any_value = b"\x18" + _varint(value)
                kv = name + b"\x12" + _SMALL[len(any_value)] + any_value
                out.append(_TAGS[tag] + _varint(len(kv)) + kv)
                continue
            field = fields.get((tag, key, type(value), value))
            if field is None:
                if len(fields) >= _MAX_FIELDS:
                    fields.clear()
                any_value = _any_value(value)
                kv = (_field(0x0A, key.encode()) if key else b"") + _field(0x12, any_value)
                field = fields[(tag, key, type(value), value)] = _field(tag, kv)
            out.append(field)
        return b"".join(out)

    def _resource(self, resource: Resource) -> bytes:
        encoded = self._resources.get(resource)
        if encoded is None:
            if len(self._resources) >= 16:
                self._resources.clear()
            attributes = self._attributes(0x0A, resource.attributes) if resource.attributes else b""
            encoded = self._resources[resource] = _field(0x0A, attributes)
        return encoded

    def _scope(self, scope: InstrumentationScope | None) -> bytes:
        encoded = self._scopes.get(scope)
        if encoded is None:
            if len(self._scopes) >= 64:
                self._scopes.clear()
            body = b""
            if scope is not None:
                parts = []
                if scope.name:
                    parts.append(_field(0x0A, scope.name.encode()))
                if scope.version:
                    parts.append(_field(0x12, scope.version.encode()))
                if scope.attributes:
                    parts.append(self._attributes(0x1A, scope.attributes))
                body = b"".join(parts)
            encoded = self._scopes[scope] = _field(0x0A, body)
        return encoded


def _flags(parent: SpanContext | None) -> int:
    if parent is not None and parent.is_remote:
        return _HAS_IS_REMOTE | _IS_REMOTE
    return _HAS_IS_REMOTE


def _any_value(value: Any) -> bytes:
    """An ``AnyValue`` (a oneof: written even when it holds its type's default)."""
    kind = type(value)
    if kind is str:
        encoded = value.encode()
        return b"\x0a" + _varint(len(encoded)) + encoded
    if kind is bool:
        return b"\x10\x01" if value else b"\x10\x00"
    if kind is int:
        return b"\x18" + _varint(value)
    if kind is float:
        return b"\x21" + _DOUBLE.pack(value)
    raise Unencodable(kind.__name__)
