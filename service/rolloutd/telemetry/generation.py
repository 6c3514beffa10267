"""A group's generation as one span, ``rolloutd.group.generate``, from admission to commit.

The span is started when the domain reports :class:`GenerationStarted` (with the true admission
time) and ended when the group commits, or with an error status when it is evicted or dropped.
Its W3C trace context goes back to the domain as plain headers, which every sibling's engine
request carries: with ``engine.vllm.otlp_traces_endpoint`` set, vLLM's own request spans are its
children. The span is a root (admission answers no request), so ``OTEL_TRACES_SAMPLER`` decides
whether it is sampled, and vLLM's parent-based sampler follows that decision.

Attributes use the OpenTelemetry GenAI names where they fit (``gen_ai.request.*``,
``gen_ai.usage.*``) and ``rolloutd.group.*`` elsewhere. A group that is still generating when
the service stops has no span: it was never finished.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.trace import (
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    Tracer,
)
from opentelemetry.util.types import AttributeValue

from rolloutd.domain.observer import GenerationStarted, GroupCommitted

GENERATE_SPAN = "rolloutd.group.generate"
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
_ROOT = Context()
OPERATION = "text_completion"


class GenAIAttr:
    """OpenTelemetry GenAI semantic-convention keys."""

    OPERATION_NAME = "gen_ai.operation.name"
    PROVIDER_NAME = "gen_ai.provider.name"
    """The engine (``vllm``, ``synthetic``) on the engine's metrics."""
    TOKEN_TYPE = "gen_ai.token.type"
    """``input`` or ``output`` on ``gen_ai.client.token.usage``."""
    REQUEST_MODEL = "gen_ai.request.model"
    REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    REQUEST_TOP_P = "gen_ai.request.top_p"
    REQUEST_TOP_K = "gen_ai.request.top_k"
    REQUEST_SEED = "gen_ai.request.seed"
    REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count"
    USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
    """The prompt's tokens (one prompt, whatever the group size)."""
    USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
    """Completion tokens of all siblings."""


class GroupAttr:
    """rolloutd's own keys on ``rolloutd.group.generate``."""

    ID = "rolloutd.group.id"
    SIZE = "rolloutd.group.size"
    PROMPT_ID = "rolloutd.prompt.id"
    ENGINE = "rolloutd.engine"
    SOURCE = "rolloutd.source"
    """The name of the group's dataset source (``submitted``: a submitted prompt)."""
    ABANDONED = "rolloutd.group.abandoned"
    """Why a group never committed (evicted, dropped)."""


class TraceHeaders(Mapping[str, str]):
    """The W3C headers of a span's context, as the W3C propagator writes them: ``traceparent``,
    and ``tracestate`` when the context has one. They are written on first read: an engine that
    traces nothing never reads them, and a fetch links to :attr:`context` itself."""

    __slots__ = ("_written", "context")

    def __init__(self, context: SpanContext) -> None:
        self.context = context
        self._written: dict[str, str] | None = None

    def _headers(self) -> dict[str, str]:
        if self._written is None:
            context = self.context
            headers = {
                TRACEPARENT: f"00-{context.trace_id:032x}-{context.span_id:016x}-"
                f"{context.trace_flags:02x}"
            }
            if context.trace_state:
                headers[TRACESTATE] = context.trace_state.to_header()
            self._written = headers
        return self._written

    def __getitem__(self, key: str) -> str:
        return self._headers()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._headers())

    def __len__(self) -> int:
        return 2 if self.context.trace_state else 1

    def __repr__(self) -> str:
        return f"TraceHeaders({self._headers()!r})"


class GenerationSpans:
    """The open ``rolloutd.group.generate`` spans, by group id (event-loop only), a hundred of
    them a second on a busy node: SDK spans, whose attributes that follow from a group's settings
    are built once for all groups of the same settings. With a tracer that is not the SDK's
    (telemetry off) nothing is traced; while ``records()`` says no span would reach a processor,
    a group gets a context and no span."""

    def __init__(self, tracer: Tracer, records: Callable[[], bool] = lambda: True) -> None:
        self._tracer = tracer if isinstance(tracer, SdkTracer) else None
        self._records = records
        self._spans: dict[int, Span] = {}
        self._settings: dict[tuple[object, ...], dict[str, AttributeValue]] = {}
        self.model: str | None = None
        self.engine: str | None = None

    def __len__(self) -> int:
        return len(self._spans)

    def started(self, event: GenerationStarted) -> Mapping[str, str]:
        tracer = self._tracer
        if tracer is None:
            return {}  # telemetry off: nothing to propagate, nothing to end
        if not self._records():  # no span processor: the context alone, unsampled
            ids = tracer.id_generator
            context = SpanContext(ids.generate_trace_id(), ids.generate_span_id(), is_remote=False)
            return TraceHeaders(context)
        attributes: dict[str, AttributeValue] = {
            **self.settings_attributes(event),
            GroupAttr.ID: event.group_id,
            GroupAttr.PROMPT_ID: event.prompt_id,
            GenAIAttr.REQUEST_SEED: event.seed,
        }
        span = tracer.start_span(  # a root, whatever span is current
            GENERATE_SPAN,
            context=_ROOT,
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            start_time=int(event.admitted_at * 1e9),
        )
        if span.is_recording():
            self._spans[event.group_id] = span
        return TraceHeaders(span.get_span_context())

    def settings_attributes(self, event: GenerationStarted) -> Mapping[str, AttributeValue]:
        """The attributes of the group's sampling settings, model and engine: one dict, built
        once, for all groups of the same ones (never changed; each span copies it)."""
        key = (
            event.max_tokens,
            float(event.temperature),
            float(event.top_p),
            event.top_k,
            event.group_size,
            event.source,
            self.model,
            self.engine,
        )
        settings = self._settings.get(key)
        if settings is None:
            if len(self._settings) >= 1024:
                self._settings.clear()
            settings = {
                GenAIAttr.OPERATION_NAME: OPERATION,
                GenAIAttr.REQUEST_MAX_TOKENS: event.max_tokens,
                GenAIAttr.REQUEST_TEMPERATURE: key[1],
                GenAIAttr.REQUEST_TOP_P: key[2],
                GenAIAttr.REQUEST_CHOICE_COUNT: event.group_size,
                GroupAttr.SIZE: event.group_size,
            }
            if event.top_k:
                settings[GenAIAttr.REQUEST_TOP_K] = event.top_k
            if event.source:
                settings[GroupAttr.SOURCE] = event.source
            if self.model is not None:
                settings[GenAIAttr.REQUEST_MODEL] = self.model
            if self.engine is not None:
                settings[GroupAttr.ENGINE] = self.engine
            self._settings[key] = settings
        return settings

    def get(self, group_id: int) -> Span | None:
        """The group's open span (None once it ended, or when it is not recorded)."""
        return self._spans.get(group_id)

    def committed(self, event: GroupCommitted) -> None:
        span = self._spans.pop(event.group_id, None)
        if span is None:
            return  # committed at restore without generating, or not recorded
        span.set_attribute(GenAIAttr.USAGE_INPUT_TOKENS, event.prompt_tokens)
        span.set_attribute(GenAIAttr.USAGE_OUTPUT_TOKENS, event.tokens)
        span.end()

    def abandoned(self, group_id: int, reason: str) -> None:
        span = self._spans.pop(group_id, None)
        if span is None:
            return
        span.set_attribute(GroupAttr.ABANDONED, reason)
        span.set_status(Status(StatusCode.ERROR, reason))
        span.end()


def link_generations(traces: Callable[[], Iterable[tuple[int, Mapping[str, str]]]]) -> None:
    """Links the current span (a ``FetchGroups`` server span) to the generation span of each
    group ``traces()`` gives (group id, W3C headers of its ``rolloutd.group.generate``), so a
    trainer's trace leads to how its samples were generated. ``traces`` is called only while
    the current span records. A span holds at most ``OTEL_SPAN_LINK_COUNT_LIMIT`` links (128);
    the SDK counts those beyond as dropped."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    for group_id, headers in traces():
        if isinstance(headers, TraceHeaders):
            context: SpanContext | None = headers.context
        else:
            context = _span_context(headers.get(TRACEPARENT, ""))
        if context is not None:
            span.add_link(context, {GroupAttr.ID: group_id})


def _span_context(traceparent: str) -> SpanContext | None:
    """The span context of a version-00 ``traceparent`` this service wrote (None if it is not
    one: an engine's own header, say)."""
    if len(traceparent) != 55 or not traceparent.startswith("00-"):
        return None
    try:
        trace_id = int(traceparent[3:35], 16)
        span_id = int(traceparent[36:52], 16)
        flags = int(traceparent[53:55], 16)
    except ValueError:
        return None
    context = SpanContext(trace_id, span_id, is_remote=False, trace_flags=TraceFlags(flags))
    return context if context.is_valid else None
