"""gRPC tracing: server spans that continue the caller's W3C ``traceparent`` (rolloutd's own for
unary and client-streaming calls, opentelemetry-instrumentation-grpc's for response-streaming
ones), and the instrumentation's client spans that send it.

The server passes its own tracer provider; the client library (in a trainer's process) defaults to
the global one, which is the trainer's. Context crosses the wire with the global propagator
(``OTEL_PROPAGATORS``, default W3C tracecontext and baggage).

While no server span would be recorded (no span processor yet, or the SDK disabled) the server
builds none: a handler runs in the caller's context alone, so what it logs still carries the
caller's trace id, at a fraction of a span's cost per call.
"""

from __future__ import annotations

import collections
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any, NamedTuple, Protocol
from urllib.parse import unquote

import grpc
from opentelemetry import trace
from opentelemetry.context import attach, detach
from opentelemetry.instrumentation.grpc import aio_server_interceptor, client_interceptor
from opentelemetry.propagate import extract
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer, TracerProvider
from opentelemetry.util.types import AttributeValue

from rolloutd import __version__

TRACER_NAME = "rolloutd"


def span_name(full_method: str) -> str:
    """The RPC semantic conventions' span name, ``rolloutd.v1.RolloutService/Checkpoint``: gRPC's
    method path without its leading slash."""
    return full_method.lstrip("/")


Handler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


class _HandlerCache:
    """Each method's wrapped handler, built once: an interceptor that built a new handler and
    closure on every call would spend that on every RPC. Keyed by method path and checked
    against the handler it wrapped, so a changed handler is wrapped anew."""

    def __init__(self, wrap: Callable[[str, grpc.RpcMethodHandler], grpc.RpcMethodHandler]):
        self._wrap = wrap
        self._handlers: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def __call__(self, path: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        known = self._handlers.get(path)
        if known is not None and known[0] is handler:
            return known[1]
        wrapped = self._wrap(path, handler)
        self._handlers[path] = (handler, wrapped)
        return wrapped


def _in_caller_context(behavior: Handler) -> Handler:
    """``behavior`` run with the caller's propagated context (its trace id) as the current one."""

    async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
        metadata = context.invocation_metadata()
        if not metadata:
            return await behavior(request, context)
        token = attach(extract({m.key: m.value for m in metadata}))
        try:
            return await behavior(request, context)
        finally:
            detach(token)

    return run


def _without_span(path: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` in the caller's context; response-streaming handlers (health watches,
    reflection) as they are."""
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            _in_caller_context(handler.unary_unary),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(
            _in_caller_context(handler.stream_unary),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    return handler


def _renamed(path: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` giving the server span, current while it runs, its conventional name."""
    name = span_name(path)
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            _naming_span(name, handler.unary_unary),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(
            _naming_span(name, handler.stream_unary),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            _naming_span_of_stream(name, handler.unary_stream),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    return grpc.stream_stream_rpc_method_handler(
        _naming_span_of_stream(name, handler.stream_stream),
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _naming_span(name: str, behavior: Handler) -> Handler:
    async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
        trace.get_current_span().update_name(name)
        return await behavior(request, context)

    return run


def _naming_span_of_stream(
    name: str, behavior: Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]
) -> Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]:
    async def run(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        trace.get_current_span().update_name(name)
        async for response in behavior(request, context):
            yield response

    return run


class _ServerInterceptor(grpc.aio.ServerInterceptor):
    """One server span per RPC, current while the handler runs, continuing the caller's W3C
    context: made here for unary and client-streaming handlers (every RPC of the rollout
    service), by the instrumentation's aio server interceptor (built by its public
    ``aio_server_interceptor``) for response-streaming ones. None while ``records()`` says no
    span would be recorded, nor for a streaming handler that writes its responses itself.

    The spans are the instrumentation's, at half its cost per call: the same name (the method
    path without its leading slash, as the RPC conventions name spans; the instrumentation keeps
    the slash, so the handler renames its span), attributes, status and exception events; the
    status code is read from the call once the handler is done instead of through a proxy of
    its context."""

    def __init__(self, tracer_provider: TracerProvider | None, records: Callable[[], bool]):
        self._traced = aio_server_interceptor(tracer_provider=tracer_provider)
        self._tracer = trace.get_tracer(TRACER_NAME, __version__, tracer_provider)
        self._records = records
        self._unrecorded = _HandlerCache(_without_span)
        self._spanned = _HandlerCache(self._with_span)
        self._named = _HandlerCache(_renamed)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        path: str = handler_call_details.method  # type: ignore[attr-defined]
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if not self._records() or _writes_its_responses(handler):
            return self._unrecorded(path, handler)
        if handler.unary_unary is not None or handler.stream_unary is not None:
            return self._spanned(path, handler)
        named = self._named(path, handler)

        async def resolved(details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
            return named

        return await self._traced.intercept_service(resolved, handler_call_details)

    def _with_span(self, path: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _in_server_span(self._tracer, path, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return grpc.stream_unary_rpc_method_handler(
            _in_server_span(self._tracer, path, handler.stream_unary),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class RpcAttr:
    """The RPC semantic conventions' keys, as the gRPC instrumentation sets them."""

    SYSTEM = "rpc.system"
    SERVICE = "rpc.service"
    METHOD = "rpc.method"
    STATUS_CODE = "rpc.grpc.status_code"
    USER_AGENT = "rpc.user_agent"
    PEER_IP = "net.peer.ip"
    PEER_PORT = "net.peer.port"
    PEER_NAME = "net.peer.name"


_ERROR_CODES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)
"""Codes that make a server span's status ERROR (the others are the caller's doing)."""


def _in_server_span(tracer: Tracer, path: str, behavior: Handler) -> Handler:
    """``behavior`` in a server span of its own (see :class:`_ServerInterceptor`)."""
    name = span_name(path)
    service, _, method = name.partition("/")
    base: dict[str, AttributeValue] = {
        RpcAttr.SYSTEM: "grpc",
        RpcAttr.STATUS_CODE: grpc.StatusCode.OK.value[0],
        RpcAttr.METHOD: method,
        RpcAttr.SERVICE: service,
    }

    starting: dict[tuple[str, str | None], dict[str, AttributeValue]] = {}
    """The attributes a span starts with, by peer and user agent (both repeat on a
    connection): built once, never changed; each span copies them."""

    def attributes_of(peer: str, agent: str | None) -> dict[str, AttributeValue]:
        known = starting.get((peer, agent))
        if known is None:
            if len(starting) >= 1024:
                starting.clear()
            known = {**base, **_peer_attributes(peer)}
            if agent is not None:
                known[RpcAttr.USER_AGENT] = agent
            starting[(peer, agent)] = known
        return known

    async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
        metadata = context.invocation_metadata()
        carrier = {m.key: m.value for m in metadata} if metadata else {}
        parent = extract(carrier) if carrier else None
        starts_with = attributes_of(context.peer(), carrier.get("user-agent"))
        span = tracer.start_span(name, parent, SpanKind.SERVER, starts_with)
        token = attach(trace.set_span_in_context(span, parent))
        try:
            return await behavior(request, context)
        except Exception as error:
            if type(error) is not Exception:  # a bare one is how gRPC ends an aborted call
                span.record_exception(error)
            raise
        finally:
            code = context.code()
            if isinstance(code, grpc.StatusCode) and code is not grpc.StatusCode.OK:
                span.set_attribute(RpcAttr.STATUS_CODE, code.value[0])
                if code in _ERROR_CODES:
                    span.set_status(Status(StatusCode.ERROR, f"{code}:{context.details()}"))
            detach(token)
            span.end()

    return run


def _peer_attributes(peer: str) -> Mapping[str, AttributeValue]:
    """``net.peer.*`` of a gRPC peer (``ipv4:127.0.0.1:57284``, ``ipv6:[::1]:57284``), as the
    instrumentation derives them; none for a Unix socket."""
    if peer.startswith("unix:"):
        return {}
    try:
        ip, port = peer.split(",")[0].split(":", 1)[1].rsplit(":", 1)
    except (IndexError, ValueError):
        return {}
    ip = unquote(ip)
    attributes: dict[str, AttributeValue] = {RpcAttr.PEER_IP: ip, RpcAttr.PEER_PORT: port}
    if ip in ("[::1]", "127.0.0.1"):
        attributes[RpcAttr.PEER_NAME] = "localhost"
    return attributes


def _writes_its_responses(handler: grpc.RpcMethodHandler) -> bool:
    """A response-streaming handler written as a coroutine that sends with ``context.write``
    (``grpc.health.v1.Health/Watch``), not as an async generator: the instrumentation iterates
    the handler's result, which would fail such a call with UNKNOWN, so it gets no server span."""
    behavior = handler.unary_stream or handler.stream_stream
    return behavior is not None and not inspect.isasyncgenfunction(behavior)


def server_interceptors(
    tracer_provider: TracerProvider | None = None,
    records: Callable[[], bool] = lambda: True,
) -> list[grpc.aio.ServerInterceptor]:
    """For ``grpc.aio.server(interceptors=...)``: one server span per RPC, current while the
    handler runs, so spans the handler records (a checkpoint's phase tree) nest below it.

    ``records``: whether a span started now could be recorded; while it says no, handlers run
    in the caller's context without a server span of their own (see the module docstring)."""
    return [_ServerInterceptor(tracer_provider, records)]


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


def _with_metadata(details: grpc.ClientCallDetails, metadata: Any) -> _CallDetails:
    """The call's details with ``metadata`` (the caller's, plus the trace context)."""
    return _CallDetails(
        details.method,
        details.timeout,
        metadata,
        details.credentials,
        details.wait_for_ready,
        details.compression,
    )


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
            return continuation(_with_metadata(details, metadata), request)

        info = _ClientInfo(span_name(details.method), details.timeout)
        return self._interceptor.intercept_unary(request, details.metadata, info, invoker)

    def intercept_stream_unary(
        self,
        continuation: Callable[[grpc.ClientCallDetails, Any], Any],
        client_call_details: grpc.ClientCallDetails,
        request_iterator: Iterator[Any],
    ) -> Any:
        details = client_call_details

        def invoker(requests: Iterator[Any], metadata: Any) -> Any:
            return continuation(_with_metadata(details, metadata), requests)

        info = _ClientInfo(span_name(details.method), details.timeout, is_client_stream=True)
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


RpcRecorder = Callable[[str, int, float], None]
"""(method, gRPC status code number, seconds) of one finished RPC."""


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Times every unary RPC of ``service`` and hands method, status code and duration to
    ``record`` (``rpc.server.duration``); other services (health, reflection) pass untouched.

    The status code is the one the handler set (``context.abort`` sets it before raising); an
    exception without one is UNKNOWN, as gRPC reports it to the client.
    """

    def __init__(self, service: str, record: RpcRecorder) -> None:
        self._prefix = f"/{service}/"
        self._record = record
        self._timed = _HandlerCache(self._wrap)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        path: str = handler_call_details.method  # type: ignore[attr-defined]
        if handler is None or handler.unary_unary is None or not path.startswith(self._prefix):
            return handler
        return self._timed(path, handler)

    def _wrap(self, path: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        method = path.removeprefix(self._prefix)
        behavior = handler.unary_unary
        record = self._record

        async def timed(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started = time.perf_counter()
            failed = False
            try:
                return await behavior(request, context)
            except BaseException:
                failed = True
                raise
            finally:
                code = context.code()
                if code is None:
                    code = grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK
                number = code.value[0] if isinstance(code, grpc.StatusCode) else int(code)
                record(method, number, time.perf_counter() - started)

        return grpc.unary_unary_rpc_method_handler(
            timed,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
