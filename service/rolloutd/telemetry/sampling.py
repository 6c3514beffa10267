"""The tracers' sampler until spans have somewhere to go."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.trace.sampling import DEFAULT_ON, Decision, Sampler, SamplingResult


class UntilProcessed(Sampler):
    """The configured sampler once spans have somewhere to go; until then every span is
    dropped (a non-recording span that still carries the trace context). With no trace exporter
    configured each RPC would otherwise build and end a span that no processor receives."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.processed = False

    @property
    def parent_based_always_on(self) -> bool:
        """Spans are processed and the sampler is the SDK's default, ``ParentBased(ALWAYS_ON)``:
        a span records and is sampled exactly when it is a root or its parent is sampled, and
        carries its parent's trace state (:mod:`rolloutd.telemetry.light_spans` decides so
        without calling the sampler)."""
        return self.processed and self.sampler is DEFAULT_ON

    def should_sample(self, *args: Any, **kwargs: Any) -> SamplingResult:
        if self.processed:
            return self.sampler.should_sample(*args, **kwargs)
        return SamplingResult(Decision.DROP)

    def get_description(self) -> str:
        return f"UntilProcessed{{{self.sampler.get_description()}}}"
