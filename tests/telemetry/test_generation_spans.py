"""``rolloutd.group.generate``: one span per group from admission to commit, whose context the
sibling requests carry, sampled by the tracer provider's sampler; and the same over OTLP from the
real CLI."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from opentelemetry.trace import (
    NonRecordingSpan,
    NoOpTracerProvider,
    SpanContext,
    StatusCode,
    TraceFlags,
    TraceState,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from rolloutd.domain.controller import Controller, ControllerConfig
from rolloutd.domain.engine import EngineCounters
from rolloutd.domain.group import Prompt
from rolloutd.domain.observer import GenerationStarted, GroupCommitted
from rolloutd.domain.sampler import Sampler, Source
from rolloutd.domain.spec import GenerationSpec, SamplingParams
from rolloutd.telemetry.generation import (
    GENERATE_SPAN,
    GenAIAttr,
    GenerationSpans,
    GroupAttr,
    TraceHeaders,
)
from rolloutd.telemetry.observer import TelemetryObserver
from rolloutd.telemetry.sources import CheckpointState, StatusSnapshot
from rolloutd.telemetry.tracer_provider import ServiceTracerProvider, records_spans
from tests.fakes import GatedEngine, settle
from tests.integration.proc import ServeProcess
from tests.integration.trainer_harness import Trainer
from tests.telemetry.otlp_receiver import OtlpReceiver, attributes
from tests.telemetry.test_metrics import collect

pytestmark = pytest.mark.usefixtures("clean_env")


def started(group_id: int, admitted_at: float) -> GenerationStarted:
    return GenerationStarted(
        group_id, f"p{group_id}", 4, admitted_at, 32, 0.7, 0.95, top_k=5, seed=123, source="math"
    )


def traceparent(headers) -> tuple[str, str, str]:
    version, trace_id, span_id, flags = headers["traceparent"].split("-")
    assert version == "00"
    return trace_id, span_id, flags


def test_a_group_is_one_span_from_admission_to_commit_with_genai_attributes(span_exporter):
    provider, exporter = span_exporter
    spans = GenerationSpans(provider.get_tracer("t"))
    spans.model, spans.engine = "tiny-llama", "vllm"
    admitted = time.time() - 2.0
    headers = spans.started(started(7, admitted))
    spans.committed(GroupCommitted(7, 90, True, 2.0, prompt_tokens=11, group_size=4))
    [span] = exporter.get_finished_spans()
    assert span.name == GENERATE_SPAN and span.parent is None
    assert span.start_time == int(admitted * 1e9)
    trace_id, span_id, flags = traceparent(headers)
    assert (trace_id, span_id) == (f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}")
    assert int(flags, 16) & 1  # sampled
    assert dict(span.attributes) == {
        GenAIAttr.OPERATION_NAME: "text_completion",
        GenAIAttr.REQUEST_MODEL: "tiny-llama",
        GenAIAttr.REQUEST_MAX_TOKENS: 32,
        GenAIAttr.REQUEST_TEMPERATURE: 0.7,
        GenAIAttr.REQUEST_TOP_P: 0.95,
        GenAIAttr.REQUEST_TOP_K: 5,
        GenAIAttr.REQUEST_SEED: 123,
        GenAIAttr.REQUEST_CHOICE_COUNT: 4,
        GenAIAttr.USAGE_INPUT_TOKENS: 11,
        GenAIAttr.USAGE_OUTPUT_TOKENS: 90,
        GroupAttr.ID: 7,
        GroupAttr.SIZE: 4,
        GroupAttr.PROMPT_ID: "p7",
        GroupAttr.ENGINE: "vllm",
        GroupAttr.SOURCE: "math",
    }
    assert len(spans) == 0


def test_groups_of_the_same_settings_share_their_settings_attributes():
    """The settings' attributes are one dict, built once, for all groups that share them; a
    temperature given as an integer is still a double, as the GenAI conventions say."""
    provider = ServiceTracerProvider(shutdown_on_exit=False)  # the service's: the default sampler
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    spans = GenerationSpans(provider.get_tracer("t"), records_spans(provider))
    spans.model, spans.engine = "tiny-llama", "vllm"
    now = time.time()
    events = [
        started(1, now),
        started(2, now),
        GenerationStarted(3, "p3", 4, now, 32, 1, 1, seed=9),
        GenerationStarted(4, "p4", 4, now, 32, 1.0, 1.0, seed=9),
    ]
    for event in events:
        spans.started(event)
    first, second, third, fourth = (spans.settings_attributes(e) for e in events)
    assert first is second and third is fourth
    assert first is not third
    for group_id in range(1, 5):
        spans.committed(GroupCommitted(group_id, 9, True, 1.0, prompt_tokens=3, group_size=4))
    finished = {s.attributes[GroupAttr.ID]: s.attributes for s in exporter.get_finished_spans()}
    assert finished[3][GenAIAttr.REQUEST_TEMPERATURE] == 1.0
    assert type(finished[3][GenAIAttr.REQUEST_TEMPERATURE]) is float
    assert (finished[1][GroupAttr.PROMPT_ID], finished[2][GroupAttr.PROMPT_ID]) == ("p1", "p2")
    assert GroupAttr.SOURCE not in finished[3] and GenAIAttr.REQUEST_TOP_K not in finished[3]


def test_an_abandoned_group_ends_its_span_with_an_error(span_exporter):
    provider, exporter = span_exporter
    spans = GenerationSpans(provider.get_tracer("t"))
    spans.started(started(3, time.time()))
    spans.abandoned(3, "evicted: too stale")
    [span] = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes[GroupAttr.ABANDONED] == "evicted: too stale"


def test_the_sampler_decides_and_the_siblings_carry_the_decision():
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(ALWAYS_OFF), shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    spans = GenerationSpans(provider.get_tracer("t"))
    headers = spans.started(started(1, time.time()))
    assert not int(traceparent(headers)[2], 16) & 1  # vLLM's parent-based sampler drops it too
    spans.committed(GroupCommitted(1, 5, True, 0.1, prompt_tokens=1, group_size=4))
    assert exporter.get_finished_spans() == ()


@pytest.mark.parametrize("state", [None, TraceState([("vendor", "a1"), ("other", "b2")])])
@pytest.mark.parametrize("sampled", [True, False])
def test_trace_headers_are_what_the_w3c_propagator_writes(state, sampled):
    """The headers a group's siblings carry, written when read, and the context a fetch links."""
    context = SpanContext(
        0x0AF7651916CD43DD8448EB211C80319C,
        0x00F067AA0BA902B7,
        is_remote=False,
        trace_flags=TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT),
        trace_state=state,
    )
    written: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(written, set_span_in_context(NonRecordingSpan(context)))
    headers = TraceHeaders(context)
    assert len(headers) == len(written)
    assert dict(headers) == written
    assert headers.get("traceparent") == written["traceparent"]
    assert headers.get("baggage") is None
    assert headers.context is context


def test_without_a_span_processor_the_siblings_carry_an_unsampled_context():
    """The service's provider before any processor (no trace exporter): no span, but a context
    whose decision vLLM's parent-based sampler follows; once a processor is added, spans again."""
    provider = ServiceTracerProvider(shutdown_on_exit=False)
    spans = GenerationSpans(provider.get_tracer("t"), records_spans(provider))
    headers = spans.started(started(1, time.time()))
    trace_id, span_id, flags = traceparent(headers)
    assert int(trace_id, 16) and int(span_id, 16) and not int(flags, 16) & 1
    assert len(spans) == 0
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    assert int(traceparent(spans.started(started(2, time.time())))[2], 16) & 1
    spans.committed(GroupCommitted(2, 5, True, 0.1, prompt_tokens=1, group_size=4))
    [span] = exporter.get_finished_spans()
    assert span.attributes[GroupAttr.ID] == 2


def test_with_telemetry_off_there_is_nothing_to_carry():
    observer = TelemetryObserver(NoOpTracerProvider(), NoOpMeterProvider())
    assert observer.generation_started(started(1, time.time())) == {}


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    yield r
    r.stop()


@pytest.mark.process
def test_the_cli_exports_a_generate_span_per_committed_group(receiver, tmp_path):
    service_name = "rolloutd-generate-spans"
    p = ServeProcess.synthetic(
        tmp_path / "ckpt",
        "--group-size",
        "3",
        "--max-tokens",
        "16",
        "--checkpoint-interval",
        "0",
        env={
            "OTEL_SDK_DISABLED": "false",
            "OTEL_SERVICE_NAME": service_name,
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint("grpc"),
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        },
        cwd=tmp_path,
    )
    try:
        trainer = Trainer()
        trainer.run(p.wait_listening(), seconds=1.5)
        assert p.terminate() == 0, p.output
    finally:
        if p.proc.poll() is None:
            p.kill()
    assert trainer.delivered > 0
    generate = [s for s in receiver.spans(service_name) if s.name == GENERATE_SPAN]
    assert len(generate) >= trainer.delivered
    for span in generate:
        attrs = attributes(span.attributes)
        assert attrs[GroupAttr.SIZE] == 3 and attrs[GenAIAttr.REQUEST_CHOICE_COUNT] == 3
        assert attrs[GenAIAttr.REQUEST_MODEL] == "synthetic"
        assert attrs[GenAIAttr.REQUEST_MAX_TOKENS] == 16
        assert attrs[GenAIAttr.USAGE_INPUT_TOKENS] > 0
        assert 3 <= attrs[GenAIAttr.USAGE_OUTPUT_TOKENS] <= 3 * 16
        assert span.parent_span_id == b"" and span.end_time_unix_nano > span.start_time_unix_nano
    assert len({attributes(s.attributes)[GroupAttr.ID] for s in generate}) == len(generate)


async def test_a_groups_span_carries_its_rows_settings_and_its_sources_name(
    span_exporter, metric_reader
):
    (tracer_provider, exporter), (meter_provider, reader) = span_exporter, metric_reader
    rows = [
        Prompt("hot", "q1", generation=GenerationSpec(temperature=2.0, max_tokens=12, seed=9)),
        Prompt("cool", "q2", generation=GenerationSpec(top_p=0.5, top_k=7, group_size=3)),
    ]
    observer = TelemetryObserver(tracer_provider, meter_provider)
    observer.register_sources(
        engine_counters=EngineCounters,
        engine_name="gated",
        status=StatusSnapshot,
        checkpoint_state=CheckpointState,
        dataset_sources=["math"],
    )
    c = Controller(
        ControllerConfig(group_size=2, sampling=SamplingParams(max_tokens=20, temperature=0.7)),
        GatedEngine(auto=True),
        Sampler(
            [Source("math", rows, generation=GenerationSpec(temperature=0.3))], seed=0, epochs=1
        ),
        observer=observer,
    )
    c.start()
    try:
        await settle(lambda: c.rooms.accounting.counters.committed_groups == 2, 10)
    finally:
        await c.stop()
    spans = {
        s.attributes[GroupAttr.PROMPT_ID]: dict(s.attributes)
        for s in exporter.get_finished_spans()
        if s.name == GENERATE_SPAN
    }
    hot, cool = spans["hot"], spans["cool"]
    assert (hot[GenAIAttr.REQUEST_TEMPERATURE], hot[GenAIAttr.REQUEST_MAX_TOKENS]) == (2.0, 12)
    assert (hot[GenAIAttr.REQUEST_SEED], hot[GenAIAttr.REQUEST_CHOICE_COUNT]) == (9, 2)
    assert GenAIAttr.REQUEST_TOP_K not in hot  # 0: not set
    assert (cool[GenAIAttr.REQUEST_TEMPERATURE], cool[GenAIAttr.REQUEST_TOP_P]) == (0.3, 0.5)
    assert (cool[GenAIAttr.REQUEST_TOP_K], cool[GenAIAttr.REQUEST_CHOICE_COUNT]) == (7, 3)
    assert cool[GenAIAttr.REQUEST_MAX_TOKENS] == 20  # the service's
    assert hot[GroupAttr.SOURCE] == cool[GroupAttr.SOURCE] == "math"
    metrics = collect(reader)
    committed = {
        dict(p.attributes)["source"]: p.value
        for p in metrics["rolloutd.source.committed.groups"].data.data_points
    }
    assert committed == {"math": 2, "submitted": 0}
