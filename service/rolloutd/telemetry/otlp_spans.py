"""Finished spans encoded as an OTLP ``ExportTraceServiceRequest``, byte for byte what the OTLP
exporter's own encoder makes, at a fraction of its cost.

The stock encoder builds a protobuf object for every span, attribute, value, event and link
(about 30 per generation span) and then serializes them: 40-70 us a span here, the largest
share of what tracing cost the service at a hundred groups and as many RPCs a second. Here each
span is written straight to the wire format, and the encodings of repeated attributes (most of
them: operation, model, sampling settings, RPC service), names, resources and scopes are made
once. Light spans (:mod:`rolloutd.telemetry.light_spans`; every RPC's and every group's) are read
from their own fields rather than through ``ReadableSpan``'s properties, a call each.
Attribute values of other types than ``bool``, ``str``, ``int`` and ``float`` (arrays, bytes; no
span of rolloutd's has them) send the batch through the stock encoder.
``tests/telemetry/test_otlp_spans.py`` checks the bytes against the stock encoder's.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from itertools import islice
from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status
from opentelemetry.trace.span import DEFAULT_TRACE_STATE

from rolloutd.telemetry.light_spans import UNSET, LightSpan

_HAS_IS_REMOTE = 0x100
"""``SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK``"""
_IS_REMOTE = 0x200
"""``SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK``"""
_DOUBLE = struct.Struct("<d")
_IDS = struct.Struct(">HQQHQ")
"""``trace_id`` and ``span_id`` with their keys (big-endian ids, as the protocol's bytes)."""
_PARENT = struct.Struct(">HQ")
_TIMES = struct.Struct("<BQBQ")
"""``start_time_unix_nano`` and ``end_time_unix_nano`` with their keys."""
_LOW64 = (1 << 64) - 1
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
_NO_STATUS = b"\x7a\x00"
_LOCAL_FLAGS = b"\x85\x01" + _FIXED32.pack(_HAS_IS_REMOTE)
_REMOTE_FLAGS = b"\x85\x01" + _FIXED32.pack(_HAS_IS_REMOTE | _IS_REMOTE)


class SpanEncoder:
    """Encodes batches of finished spans; keeps the encodings of repeated attributes, names,
    resources and instrumentation scopes (each cache bounded: cleared when full). One per
    exporter; its caches are only read and set, so a flush racing the export thread is
    harmless."""

    def __init__(self) -> None:
        self._fields: dict[int, dict[Any, Any]] = {}
        """By field tag: each attribute's whole field by (key, value) for strings and by (key,
        type, value) for other values; for integers, by key, the field's beginnings by the
        value's varint length (integers are mostly counters and ids that do not repeat)."""
        self._names: dict[str, bytes] = {}
        self._commons: dict[int, tuple[Mapping[str, Any], bytes]] = {}
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
            if type(span) is LightSpan:
                resource, scope = span._resource, span._instrumentation_scope
                encoded_span = self._light(span)
            else:
                resource, scope = span.resource, span.instrumentation_scope or None
                encoded_span = self._span(span)
            encoded = known.get((id(resource), id(scope)))
            if encoded is None:
                encoded = known[(id(resource), id(scope))] = grouped.setdefault(
                    resource, {}
                ).setdefault(scope, [])
            encoded.append(encoded_span)
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

    def _light(self, span: LightSpan) -> bytes:
        """A light span (:mod:`rolloutd.telemetry.light_spans`, most of the spans sent), read
        from its fields: what the general path reads through ``ReadableSpan``'s properties,
        without them."""
        trace_id, span_id, _, _, state, _ = span._context  # type: ignore[misc]  # never None
        parts = [_IDS.pack(0x0A10, trace_id >> 64, trace_id & _LOW64, 0x1208, span_id)]
        if state is not DEFAULT_TRACE_STATE and state:
            parts.append(_field(0x1A, state.to_header().encode()))
        parent = span._parent
        if parent is not None:
            parts.append(_PARENT.pack(0x2208, parent[1]))
        name = self._names.get(span._name)
        if name is None:
            if len(self._names) >= 256:
                self._names.clear()
            name = self._names[span._name] = (
                _field(0x2A, span._name.encode()) if span._name else b""
            )
        parts.append(name + _KINDS[span._kind._value_])
        if span._start_time and span._end_time:
            parts.append(_TIMES.pack(0x39, span._start_time, 0x41, span._end_time))
        elif span._start_time:
            parts.append(b"\x39" + _FIXED64.pack(span._start_time))
        attributes = span._values
        if span.common is not None:
            common = len(span.common)
            parts.append(self._common(span.common))
            if len(attributes) > common:
                parts.append(self._items(0x4A, islice(attributes.items(), common, None)))
        elif attributes:
            parts.append(self._items(0x4A, attributes.items()))
        if span._events or span._links:  # none dropped without some kept
            parts.append(self._events_and_links(span, span._events, span._links))
        parts.append(_NO_STATUS if span._status is UNSET else _status(span._status))
        parts.append(_REMOTE_FLAGS if parent is not None and parent[2] else _LOCAL_FLAGS)
        return b"".join(parts)

    def _span(self, span: ReadableSpan) -> bytes:
        context = span.get_span_context()
        assert context is not None
        parts = [
            b"\x0a\x10" + context.trace_id.to_bytes(16, "big"),
            b"\x12\x08" + context.span_id.to_bytes(8, "big"),
        ]
        if context.trace_state:
            parts.append(_field(0x1A, context.trace_state.to_header().encode()))
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
        parts.append(self._events_and_links(span, span.events, span.links))
        parts.append(_status(span.status))
        parts.append(_REMOTE_FLAGS if parent is not None and parent.is_remote else _LOCAL_FLAGS)
        return b"".join(parts)

    def _events_and_links(
        self, span: ReadableSpan, events: Sequence[Event], links: Sequence[Link]
    ) -> bytes:
        """A span's events and links, each followed by how many were dropped."""
        parts = []
        if events:
            parts.append(self._events(events))
        if span.dropped_events:
            parts.append(b"\x60" + _varint(span.dropped_events))
        if links:
            parts.append(self._links(links))
        if span.dropped_links:
            parts.append(b"\x70" + _varint(span.dropped_links))
        return b"".join(parts)

    def _events(self, events: Iterable[Event]) -> bytes:
        out = []
        for event in events:
            body = [b"\x09" + _FIXED64.pack(event.timestamp)] if event.timestamp else []
            if event.name:
                body.append(_field(0x12, event.name.encode()))
            if event.attributes:
                body.append(self._attributes(0x1A, event.attributes))
            if event.dropped_attributes:
                body.append(b"\x20" + _varint(event.dropped_attributes))
            out.append(_field(0x5A, b"".join(body)))
        return b"".join(out)

    def _links(self, links: Iterable[Link]) -> bytes:
        out = []
        for link in links:
            body = [
                b"\x0a\x10" + link.context.trace_id.to_bytes(16, "big"),
                b"\x12\x08" + link.context.span_id.to_bytes(8, "big"),
            ]
            if link.attributes:
                body.append(self._attributes(0x22, link.attributes))
            if link.dropped_attributes:
                body.append(b"\x28" + _varint(link.dropped_attributes))
            body.append(b"\x35" + _FIXED32.pack(_flags(link.context)))
            out.append(_field(0x6A, b"".join(body)))
        return b"".join(out)

    def _common(self, common: Mapping[str, Any]) -> bytes:
        """A light span's common attributes (a dict many spans share, never changed), written
        once: kept by identity, with the dict itself so that its id is not reused."""
        known = self._commons.get(id(common))
        if known is None or known[0] is not common:
            if len(self._commons) >= 1024:
                self._commons.clear()
            known = self._commons[id(common)] = (common, self._items(0x4A, common.items()))
        return known[1]

    def _attributes(self, tag: int, attributes: Mapping[str, Any]) -> bytes:
        return self._items(tag, attributes.items())

    def _items(self, tag: int, attributes: Iterable[tuple[str, Any]]) -> bytes:
        """Each attribute as a repeated ``KeyValue`` field of number ``tag >> 3``. Most
        attributes repeat from span to span, so whole fields are kept; an integer's field is
        written after a beginning kept for its key and length."""
        fields = self._fields.get(tag)
        if fields is None or len(fields) >= _MAX_FIELDS:
            fields = self._fields[tag] = {}
        out = []
        for key, value in attributes:
            kind = type(value)
            if kind is int:
                starts = fields.get(key)
                if starts is None:
                    starts = fields[key] = _int_starts(tag, key)
                if 0 <= value < 0x80:
                    out.append(starts[1] + _SMALL[value])
                else:
                    encoded = _varint(value)
                    out.append(starts[len(encoded)] + encoded)
                continue
            known = (key, value) if kind is str else (key, kind, value)
            field = fields.get(known)
            if field is None:
                kv = (_field(0x0A, key.encode()) if key else b"") + _field(0x12, _any_value(value))
                field = fields[known] = _field(tag, kv)
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


def _int_starts(tag: int, key: str) -> list[bytes]:
    """An integer attribute's field up to its value's varint, by that varint's length (1-10)."""
    name = _field(0x0A, key.encode()) if key else b""
    starts = [b""]
    for length in range(1, 11):
        kv_length = len(name) + 3 + length  # the name, then AnyValue's key, length, int key
        starts.append(
            _TAGS[tag] + _varint(kv_length) + name + b"\x12" + _SMALL[1 + length] + b"\x18"
        )
    return starts


def _status(status: Status) -> bytes:
    encoded = b""
    if code := status.status_code._value_:
        encoded = b"\x18" + _SMALL[code]
    if status.description:
        encoded = _field(0x12, status.description.encode()) + encoded
    return _field(0x7A, encoded)


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
