"""gRPC tracing from opentelemetry-instrumentation-grpc: server spans that continue the caller's
W3C ``traceparent``, and client spans that send it.

The server passes its own tracer provider; the client library (in a trainer's process) defaults to
the global one, which is the trainer's. Context crosses the wire with the global propagator
(``OTEL_PROPAGATORS``, default W3C tracecontext and baggage).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

import grpc
from opentelemetry.instrumentation.grpc import (
    aio_server_interceptor,
    client_interceptor,
)
from opentelemetry.trace import TracerProvider


def server_interceptors(
    tracer_provider: TracerProvider | None = None,
) -> list[grpc.aio.ServerInterceptor]:
    """For ``grpc.aio.server(interceptors=...)``: one server span per RPC, current while the
    handler runs, so spans the handler records (a checkpoint's phase tree) nest below it."""
    return [aio_server_interceptor(tracer_provider=tracer_provider)]


class _ClientInfo(NamedTuple):
    """What the OpenTelemetry interceptor reads about a call."""

    full_method: str
    timeout: float | None
    is_client_stream: bool = False
    is_server_stream: bool = False


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    """The call's details with the trace context added to its metadata."""


class _OtelClientInterceptor(Protocol):
    """What ``client_interceptor()`` returns: the instrumentation's unary and stream interfaces."""

    def intercept_unary(
        self, request: Any, metadata: Any, client_info: Any, invoker: Any
    ) -> Any: ...

    def intercept_stream(
        self, request_or_iterator: Any, metadata: Any, client_info: Any, invoker: Any
    ) -> Any: ...


class _TracingInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.StreamUnaryClientInterceptor):
    """The OpenTelemetry client interceptor behind grpc's standard interface (unary calls, and
    client-streaming ones such as ``PushWeights``).

    The instrumentation's own interceptor speaks its ``grpcext`` interface, which
    ``grpc.intercept_channel`` does not take; this adapter lets it sit in an ordinary interceptor
    list. The call's outcome is a ``grpc.Future``, so the span ends (with the status code) when
    the call completes, also for ``future()`` calls.
    """

    def __init__(self, interceptor: _OtelClientInterceptor):
        self._interceptor = interceptor

    def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.ClientCallDetails, Any], Any],
        client_call_details: grpc.ClientCallDetails,
        request: Any,
    ) -> Any:
        details = client_call_details

        def invoker(request: Any, metadata: Any) -> Any:
            traced = _CallDetails(
                details.method,
                details.timeout,
                metadata,
                details.credentials,
                details.wait_for_ready,
                details.compression,
            )
            return continuation(traced, request)

        info = _ClientInfo(details.method, details.timeout)
        return self._interceptor.intercept_unary(request, details.metadata, info, invoker)

    def intercept_stream_unary(
        self,
        continuation: Callable[[grpc.ClientCallDetails, Any], Any],
        client_call_details: grpc.ClientCallDetails,
        request_iterator: Iterator[Any],
    ) -> Any:
        details = client_call_details

        def invoker(requests: Iterator[Any], metadata: Any) -> Any:
            traced = _CallDetails(
                details.method,
                details.timeout,
                metadata,
                details.credentials,
                details.wait_for_ready,
                details.compression,
            )
            return continuation(traced, requests)

        info = _ClientInfo(details.method, details.timeout, is_client_stream=True)
        return self._interceptor.intercept_stream(request_iterator, details.metadata, info, invoker)


def client_interceptors(
    tracer_provider: TracerProvider | None = None,
) -> list[grpc.UnaryUnaryClientInterceptor]:
    """For ``grpc.intercept_channel(channel, *client_interceptors())``: each unary or
    client-streaming call is a client span and carries the current trace context in its
    metadata."""
    otel: _OtelClientInterceptor = client_interceptor(tracer_provider=tracer_provider)
    return [_TracingInterceptor(otel)]


def instrument_channel(
    channel: grpc.Channel, tracer_provider: TracerProvider | None = None
) -> grpc.Channel:
    """``channel`` with :func:`client_interceptors` applied."""
    return grpc.intercept_channel(channel, *client_interceptors(tracer_provider))
