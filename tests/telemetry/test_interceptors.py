"""A call made inside a client span arrives as one trace: client span, server span, and the phase
tree the handler records below the server span."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from rolloutd.telemetry.interceptors import (
    client_interceptors,
    instrument_channel,
    server_interceptors,
)
from rolloutd.telemetry.logs import JsonFormatter
from rolloutd.telemetry.observer import TelemetryObserver
from tests.telemetry.reports import checkpoint_report

SERVICE = "rolloutd.test.Probe"
CHECKPOINT = f"/{SERVICE}/Checkpoint"
MISSING = f"/{SERVICE}/Missing"


@pytest.fixture
async def probe(span_exporter) -> AsyncIterator[int]:
    """A grpc.aio server whose Checkpoint handler records a checkpoint report."""
    provider, _ = span_exporter
    observer = TelemetryObserver(provider, MeterProvider())

    async def checkpoint(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        observer.checkpoint_attempted(checkpoint_report())
        return b"done"

    async def missing(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await context.abort(grpc.StatusCode.NOT_FOUND, "unknown lease")
        raise AssertionError("abort returns only by raising")

    server = grpc.aio.server(interceptors=server_interceptors(provider))
    handlers = {
        "Checkpoint": grpc.unary_unary_rpc_method_handler(checkpoint),
        "Missing": grpc.unary_unary_rpc_method_handler(missing),
    }
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield port
    await server.stop(None)


async def test_a_checkpoint_call_inside_a_client_span_is_one_trace(probe, span_exporter):
    provider, exporter = span_exporter
    channel = instrument_channel(grpc.insecure_channel(f"127.0.0.1:{probe}"), provider)
    try:
        tracer = provider.get_tracer("trainer")
        with tracer.start_as_current_span("trainer.save_checkpoint") as step:
            call = channel.unary_unary(CHECKPOINT)
            reply = await asyncio.to_thread(call, b"step 40", timeout=10)
        assert reply == b"done"
    finally:
        channel.close()

    spans = exporter.get_finished_spans()
    assert {s.context.trace_id for s in spans} == {step.get_span_context().trace_id}
    [client] = [s for s in spans if s.kind is SpanKind.CLIENT]
    [rpc] = [s for s in spans if s.kind is SpanKind.SERVER]
    [root] = [s for s in spans if s.name == "rolloutd.checkpoint"]
    assert client.parent is not None and client.parent.span_id == step.get_span_context().span_id
    assert rpc.parent is not None and rpc.parent.span_id == client.context.span_id
    assert rpc.name == client.name == f"{SERVICE}/Checkpoint"  # no leading slash (RPC conventions)
    assert root.parent is not None and root.parent.span_id == rpc.context.span_id
    phases = [s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id]
    assert len(phases) == 5


async def test_client_spans_through_grpc_intercept_channel_record_failures_and_futures(
    probe, span_exporter
):
    provider, exporter = span_exporter
    channel = grpc.intercept_channel(
        grpc.insecure_channel(f"127.0.0.1:{probe}"), *client_interceptors(provider)
    )
    try:
        with pytest.raises(grpc.RpcError) as failed:
            await asyncio.to_thread(channel.unary_unary(MISSING), b"x", timeout=10)
        assert failed.value.code() is grpc.StatusCode.NOT_FOUND
        future = channel.unary_unary(CHECKPOINT).future(b"x", timeout=10)
        assert await asyncio.to_thread(future.result) == b"done"
    finally:
        channel.close()

    clients = {s.name: s for s in exporter.get_finished_spans() if s.kind is SpanKind.CLIENT}
    assert clients[MISSING[1:]].status.status_code is StatusCode.ERROR
    assert dict(clients[MISSING[1:]].attributes or {})["rpc.grpc.status_code"] == 5
    assert clients[CHECKPOINT[1:]].status.status_code is StatusCode.UNSET
    servers = {s.name: s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER}
    assert {s.context.trace_id for s in servers.values()} == {
        s.context.trace_id for s in clients.values()
    }
    # the instrumentation's attributes and statuses: a NOT_FOUND is the caller's doing
    missing = dict(servers[MISSING[1:]].attributes or {})
    assert missing["rpc.grpc.status_code"] == 5
    assert servers[MISSING[1:]].status.status_code is StatusCode.UNSET
    # the abort, once (the instrumentation recorded it twice)
    assert [e.name for e in servers[MISSING[1:]].events] == ["exception"]
    assert dict(servers[CHECKPOINT[1:]].attributes or {}) == {
        "rpc.system": "grpc",
        "rpc.grpc.status_code": 0,
        "rpc.service": SERVICE,
        "rpc.method": "Checkpoint",
        "rpc.user_agent": missing["rpc.user_agent"],
        "net.peer.ip": "127.0.0.1",
        "net.peer.port": missing["net.peer.port"],
        "net.peer.name": "localhost",
    }
    assert str(missing["rpc.user_agent"]).startswith("grpc-python")


async def test_while_no_span_would_be_recorded_a_handler_logs_in_the_callers_trace(span_exporter):
    """No server span is built then, but the caller's trace id still reaches the handler's log
    lines; once spans are recorded the server span is back."""
    trainer_provider, trainer_spans = span_exporter
    server_provider, server_spans = TracerProvider(shutdown_on_exit=False), InMemorySpanExporter()
    server_provider.add_span_processor(SimpleSpanProcessor(server_spans))
    recording = False
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("rolloutd.test.rpc")
    logger.handlers[:] = [handler]
    logger.propagate = False

    async def step(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        logger.warning("handling %s", request.decode())
        return b"done"

    server = grpc.aio.server(interceptors=server_interceptors(server_provider, lambda: recording))
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                SERVICE, {"Step": grpc.unary_unary_rpc_method_handler(step)}
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = instrument_channel(grpc.insecure_channel(f"127.0.0.1:{port}"), trainer_provider)
    tracer = trainer_provider.get_tracer("trainer")
    try:
        for call in ("unrecorded", "again", "recorded"):
            recording = call == "recorded"
            with tracer.start_as_current_span(f"trainer.{call}") as span:
                reply = await asyncio.to_thread(
                    channel.unary_unary(f"/{SERVICE}/Step"), call.encode(), timeout=10
                )
            assert reply == b"done"
            line = json.loads(stream.getvalue().splitlines()[-1])
            assert line["message"] == f"handling {call}"
            assert line["trace_id"] == format(span.get_span_context().trace_id, "032x")
            servers = server_spans.get_finished_spans()
            assert len(servers) == (call == "recorded"), call
    finally:
        channel.close()
        await server.stop(None)
        server_provider.shutdown()
    [server_span] = server_spans.get_finished_spans()
    [client_span] = [s for s in trainer_spans.get_finished_spans() if s.kind is SpanKind.CLIENT][
        -1:
    ]
    assert server_span.parent is not None
    assert server_span.parent.span_id == client_span.context.span_id


async def test_a_response_streaming_call_gets_the_conventional_span_name(span_exporter):
    provider, exporter = span_exporter

    async def count(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        for i in range(3):
            yield str(i).encode()

    server = grpc.aio.server(interceptors=server_interceptors(provider))
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                SERVICE, {"Count": grpc.unary_stream_rpc_method_handler(count)}
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            replies = [r async for r in channel.unary_stream(f"/{SERVICE}/Count")(b"x")]
    finally:
        await server.stop(None)
    assert replies == [b"0", b"1", b"2"]
    [server_span] = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
    assert server_span.name == f"{SERVICE}/Count"


async def test_a_health_watch_is_served_with_tracing_on(span_exporter):
    """Health/Watch writes its responses with ``context.write`` (a coroutine, not an async
    generator); the instrumentation's stream wrapper would fail it with UNKNOWN."""
    provider, exporter = span_exporter
    servicer = health.aio.HealthServicer()
    await servicer.set("rolloutd.test.Probe", health_pb2.HealthCheckResponse.SERVING)
    server = grpc.aio.server(interceptors=server_interceptors(provider))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            watch = stub.Watch(health_pb2.HealthCheckRequest(service="rolloutd.test.Probe"))
            first = await asyncio.wait_for(watch.read(), 10)
            await servicer.set("rolloutd.test.Probe", health_pb2.HealthCheckResponse.NOT_SERVING)
            second = await asyncio.wait_for(watch.read(), 10)
            watch.cancel()
            check = await stub.Check(health_pb2.HealthCheckRequest(service="rolloutd.test.Probe"))
    finally:
        await server.stop(None)
    assert first.status == health_pb2.HealthCheckResponse.SERVING
    assert second.status == check.status == health_pb2.HealthCheckResponse.NOT_SERVING
    [check_span] = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
    assert check_span.name == "grpc.health.v1.Health/Check"
