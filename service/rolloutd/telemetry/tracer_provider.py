"""The service's tracer provider: the SDK's, which also says whether a span started now would
reach a span processor.

With no trace exporter configured the provider has no processor, and every span started would
be built, ended and dropped: a server span per RPC, a generation span per group. The gRPC server
interceptor and the generation spans ask :func:`records_spans` first and build none while it
says no (a group's siblings still carry a context, unsampled, so vLLM's parent-based sampler
drops its own spans too). The SDK's provider does not say which processors it has, so this one
notes that it was given one, through its public ``add_span_processor``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider


class ServiceTracerProvider(SdkTracerProvider):
    """The SDK's tracer provider (sampler, id generator, limits, processors all its own), which
    knows whether it has a span processor."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.has_span_processor = False
        """Set by the first :meth:`add_span_processor`; never unset (the SDK removes none)."""

    def add_span_processor(self, span_processor: SpanProcessor) -> None:
        super().add_span_processor(span_processor)
        self.has_span_processor = True


def records_spans(provider: trace.TracerProvider) -> Callable[[], bool]:
    """Whether a span started now on ``provider``'s tracers could reach a processor: on the
    service's provider from its first processor on, never on the API's no-op provider, always on
    any other (an SDK provider a test or an embedding host built)."""
    if isinstance(provider, ServiceTracerProvider):
        return lambda: provider.has_span_processor
    if isinstance(provider, trace.NoOpTracerProvider):
        return lambda: False
    return lambda: True
