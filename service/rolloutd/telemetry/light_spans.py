"""Spans recorded without the SDK's span objects, for the two kinds made on every group and every
RPC: ``rolloutd.group.generate`` and the RPC server spans.

Starting and ending an SDK span checks every attribute, locks, and builds a second, readable copy
at its end; for a span of a dozen attributes that is most of what tracing costs the service. Here
the span's ids and sampling decision come from the SDK tracer's own id generator and sampler, as
``Tracer.start_span`` makes them, and what the span gathers goes to the tracer's span processors
as one ``ReadableSpan`` when it ends (``on_end``; processors do not see these spans start). Values
are taken as given: rolloutd's own attributes are strings, numbers and booleans. Link and event
counts keep the SDK's limits (``OTEL_SPAN_LINK_COUNT_LIMIT``, ``OTEL_SPAN_EVENT_COUNT_LIMIT``), the
excess counted as dropped.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    get_current_span,
)
from opentelemetry.util.types import Attributes, AttributeValue

from rolloutd.telemetry.sampling import UntilProcessed


class LightTracer:
    """Starts light spans on an SDK tracer's id generator, sampler and span processors."""

    def __init__(self, tracer: SdkTracer) -> None:
        self._tracer = tracer
        info = self.instrumentation_info = tracer.instrumentation_info
        self.resource = tracer.resource
        self.scope = (
            None if info is None else InstrumentationScope(info.name, info.version, info.schema_url)
        )
        self.limits = SpanLimits()
        self._processor = tracer.span_processor

    @property
    def records(self) -> bool:
        """False while the service's gate drops every span (no span processor yet): a span
        started now carries its context and records nothing."""
        gate = self._tracer.sampler
        return not isinstance(gate, UntilProcessed) or gate.processed

    def start(
        self,
        name: str,
        parent: Context | None,
        kind: SpanKind,
        attributes: dict[str, AttributeValue],
        start_ns: int | None = None,
        common: Mapping[str, AttributeValue] | None = None,
    ) -> Span:
        """A span under ``parent``'s current span (a root when it has none); a light recording
        span when the sampler records it, else a non-recording one that carries its context.

        The span's attributes are ``common``'s, then ``attributes``'s. ``common`` is a dict that
        many spans share and nobody changes (the attributes of a connection, or of a group's
        settings): an encoder writes it once for all of them (:attr:`LightSpan.common`).
        Without it the span keeps ``attributes`` itself (the caller's fresh dict), not a copy."""
        tracer = self._tracer
        if common is not None:
            merged = {**common, **attributes}
            if len(merged) != len(common) + len(attributes):
                common = None  # a key of its own replaces a common one: not common any more
            attributes = merged
        parent_context: SpanContext | None = get_current_span(parent).get_span_context()
        ids = tracer.id_generator
        if parent_context is None or not parent_context.is_valid:
            parent_context = None
            trace_id = ids.generate_trace_id()
            random = ids.is_trace_id_random()
        else:
            trace_id = parent_context.trace_id
            random = parent_context.trace_flags.random_trace_id
        gate = tracer.sampler
        if isinstance(gate, UntilProcessed) and gate.parent_based_always_on:
            # the default sampler's decision (a sampled span keeps the attributes it starts
            # with), without building its result
            sampled = parent_context is None or parent_context.trace_flags.sampled
            recording, state = sampled, parent_context.trace_state if parent_context else None
            sampled_attributes: dict[str, AttributeValue] = attributes
        else:
            sampling = gate.should_sample(parent, trace_id, name, kind, attributes)
            sampled, recording = sampling.decision.is_sampled(), sampling.decision.is_recording()
            state, sampled_attributes = sampling.trace_state, dict(sampling.attributes or {})
            common = None  # the sampler's attributes
        flags = TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT
        if random:
            flags |= TraceFlags.RANDOM_TRACE_ID
        context = SpanContext(
            trace_id,
            ids.generate_span_id(),
            is_remote=False,
            trace_flags=_FLAGS[flags],
            trace_state=state,
        )
        if not recording:
            return NonRecordingSpan(context)
        return LightSpan(
            self,
            name,
            context,
            parent_context,
            kind,
            sampled_attributes,
            time.time_ns() if start_ns is None else start_ns,
            common,
        )

    def end(self, span: ReadableSpan) -> None:
        self._processor.on_end(span)


class LightSpan(Span, ReadableSpan):
    """A recording span that is, once ended, the finished span its processors receive: it sets
    the fields :class:`ReadableSpan` reads itself, as the SDK's own span does
    (:mod:`rolloutd.telemetry.otel_sdk` names them, and a test checks them against the SDK), so
    that ending it builds no second object."""

    def __init__(
        self,
        tracer: LightTracer,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        attributes: dict[str, AttributeValue],
        start_ns: int,
        common: Mapping[str, AttributeValue] | None = None,
    ) -> None:
        self._tracer = tracer
        self._name = name
        self._context = context
        self._parent = parent
        self._kind = kind
        self._attributes = self._values = attributes
        """The same dict twice: ``ReadableSpan`` reads the first, typed read-only."""
        self._start_time = start_ns
        self._end_time: int | None = None
        self._events: Sequence[Event] = _NONE
        self._links: Sequence[Link] = _NONE
        self._status = UNSET
        self._resource = tracer.resource
        self._instrumentation_info = tracer.instrumentation_info
        self._instrumentation_scope = tracer.scope
        self.common = common
        """The shared dict whose items are the first of the span's attributes, in its order and
        with its values (None once a key of it is set anew): see :meth:`LightTracer.start`."""

    def get_span_context(self) -> SpanContext:
        return self._context  # type: ignore[return-value]  # set above, never None

    # What ``ReadableSpan`` works out with ``isinstance`` checks against abstract classes, known
    # here: the attributes are never bounded, events and links are once there are any.

    @property
    def dropped_attributes(self) -> int:
        return 0

    @property
    def dropped_events(self) -> int:
        return 0 if self._events is _NONE else self._events.dropped  # type: ignore[attr-defined]

    @property
    def dropped_links(self) -> int:
        return 0 if self._links is _NONE else self._links.dropped  # type: ignore[attr-defined]

    @property
    def events(self) -> Sequence[Event]:
        return _NONE if self._events is _NONE else tuple(self._events)

    @property
    def links(self) -> Sequence[Link]:
        return _NONE if self._links is _NONE else tuple(self._links)

    def is_recording(self) -> bool:
        return self._end_time is None

    def set_attribute(self, key: str, value: Any) -> None:
        if self.common is not None and key in self.common:
            self.common = None
        self._values[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if self.common is not None and not self.common.keys().isdisjoint(attributes):
            self.common = None
        self._values.update(attributes)

    def add_event(
        self, name: str, attributes: Attributes = None, timestamp: int | None = None
    ) -> None:
        if self._events is _NONE:
            self._events = BoundedList(self._tracer.limits.max_events)
        self._events.append(  # type: ignore[attr-defined]
            Event(name, attributes or {}, time.time_ns() if timestamp is None else timestamp)
        )

    def add_link(self, context: SpanContext, attributes: Attributes = None) -> None:
        if not context.is_valid:
            return
        if self._links is _NONE:
            self._links = BoundedList(self._tracer.limits.max_links)
        self._links.append(Link(context, attributes or {}))  # type: ignore[attr-defined]

    def update_name(self, name: str) -> None:
        self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if self._status.status_code is StatusCode.OK:
            return  # final, as in the SDK
        if isinstance(status, Status):
            self._status = status
        else:
            self._status = Status(status, description)

    def record_exception(
        self,
        exception: BaseException,
        attributes: Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        """The SDK's ``exception`` event: type, message, stack trace, escaped."""
        event: dict[str, AttributeValue] = {
            "exception.type": type(exception).__qualname__,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(
                traceback.format_exception(type(exception), exception, exception.__traceback__)
            ),
            "exception.escaped": str(escaped),
        }
        if attributes:
            event.update(attributes)
        self.add_event("exception", event, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self._end_time is not None:
            return
        self._end_time = time.time_ns() if end_time is None else end_time
        self._tracer.end(self)


_NONE: Sequence[Any] = ()
_FLAGS = tuple(TraceFlags(flags) for flags in range(4))
"""Trace flags by value: sampled, random trace id."""
UNSET = Status(StatusCode.UNSET)
"""The status a span starts with (one object, so that an encoder can tell it by identity)."""
