"""Port of the domain to whatever generates tokens: the engine protocol, its requests, its
errors and its counters. ``engines/`` implements it; the controller and telemetry use it."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rolloutd.domain.group import Prompt, Sample
from rolloutd.domain.partial import PartialSibling, TokenDelta
from rolloutd.domain.spec import SamplingParams
from rolloutd.domain.weights import WeightsTimeline

__all__ = [
    "ChatRenderer",
    "DeltaSink",
    "EngineCounters",
    "EngineDeadError",
    "EngineError",
    "EngineStartError",
    "FinishedRequest",
    "GenerationEngine",
    "GenerationRequest",
    "PromptMeter",
    "ReportsRequests",
    "RequestObserver",
    "RequestRefused",
    "SamplingParams",
]


@dataclass(frozen=True)
class GenerationRequest:
    """One sibling of one group: its own engine request with its own seed."""

    request_id: str
    group_id: int
    index: int
    prompt: Prompt
    seed: int
    params: SamplingParams
    trace_headers: Mapping[str, str] = field(default_factory=dict)
    prefix: PartialSibling | None = None
    """Tokens of this sibling generated before a restart. The engine continues from the prompt's
    token ids followed by these, for the remaining ``max_tokens``, and returns the whole sample:
    these tokens and logprobs first, exactly, then the continuation's."""
    context: array[int] | None = None
    """Token ids to condition on in place of the rendered ``prompt`` (an episode's conversation
    so far, rendered by its runner through :class:`ChatRenderer`); ``prefix`` follows them. The
    sample's ``prompt_token_ids`` are these; they are never returned as generated tokens."""


DeltaSink = Callable[[TokenDelta], None]
"""Receives each delta of a request as it is generated (see ``GenerationEngine.generate``)."""


@dataclass(frozen=True)
class EngineCounters:
    """Cumulative since engine start (tokens, preemptions) or recent (requests, KV-cache usage,
    prefix-cache hit ratio)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_running: int = 0
    requests_waiting: int = 0
    kv_cache_usage: float = 0.0
    """Fraction of the KV cache in use."""
    preemptions: int = 0
    """Requests the scheduler preempted (their KV cache freed, to be computed again when they
    resume): the sign that more sequences run than the KV cache holds."""
    prefix_cache_hit_ratio: float = 0.0
    """Share of the prompt tokens of the most recent requests (about the last thousand) found in
    the prefix cache (0 before any request)."""


@dataclass(frozen=True)
class FinishedRequest:
    """One engine request that finished (not aborted), as the engine measured it: what the
    OpenTelemetry GenAI server metrics record."""

    input_tokens: int
    """Prompt tokens (with a resumed sibling's prefix)."""
    output_tokens: int
    duration_s: float
    """From the request's arrival to its last token."""
    time_per_output_token_s: float | None
    """Decode time over the output tokens after the first (None: fewer than two)."""


class RequestObserver(Protocol):
    """Receives what an engine measured of its requests (telemetry implements it); called on
    the event loop, must not block or raise."""

    def first_token(self, seconds: float) -> None:
        """A request produced its first token ``seconds`` after it arrived."""

    def request_finished(self, request: FinishedRequest) -> None: ...


@runtime_checkable
class ReportsRequests(Protocol):
    """What an engine that measures its requests offers beside :class:`GenerationEngine`."""

    def report_requests(self, observer: RequestObserver) -> None:
        """From now on, tells ``observer`` about every request's first token and end."""
        ...


class EngineError(RuntimeError):
    """A request failed but the engine lives on; the sibling may be retried."""


class RequestRefused(EngineError):
    """The engine can never serve this request as asked (its prompt and ``max_tokens`` do not
    fit the context, say): the group is dropped at once, not retried."""


class EngineDeadError(RuntimeError):
    """The engine cannot serve any more requests; the service must stop."""


class EngineStartError(EngineDeadError):
    """The engine could not start. The message is one line: the cause, and the setting to change.
    Whatever the engine had started is gone by the time this is raised."""


@runtime_checkable
class GenerationEngine(Protocol):
    """What the controller needs from an engine.

    ``generate`` returns a finished :class:`Sample` stamped with the policy version of the
    weights that produced it; it raises ``asyncio.CancelledError`` when aborted. With
    ``on_delta`` it also hands over the completion's tokens while they are generated: the deltas
    of one call, in order, are exactly the tokens and logprobs of the returned sample after the
    request's prefix, all handed over before ``generate`` returns. Without it the engine need not
    stream at all.
    ``update_weights`` must not interleave with token generation: new samples started after it
    returns carry ``version``. It records its ``pause``, ``load`` and ``resume`` phases in
    ``timeline`` when one is given. With ``only``, the tensors that differ from the served ones
    (after a delta); ``path`` still holds every tensor, and the engine may load just those.
    """

    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def generate(
        self, request: GenerationRequest, on_delta: DeltaSink | None = None
    ) -> Sample: ...

    async def abort(self, request_ids: list[str]) -> None: ...

    async def update_weights(
        self,
        path: str,
        version: int,
        *,
        timeline: WeightsTimeline | None = None,
        only: tuple[str, ...] | None = None,
    ) -> None: ...

    def counters(self) -> EngineCounters: ...

    def check_alive(self) -> None:
        """Raises :class:`EngineDeadError` once the engine can serve no more requests (its
        process died, say), also while nothing asks it for anything. Cheap and without waiting:
        the service calls it about once a second."""
        ...

    @property
    def policy_version(self) -> int: ...


@runtime_checkable
class ChatRenderer(Protocol):
    """What an engine offers beside :class:`GenerationEngine` for episodes: the model's chat
    template and tokenizer, so that a conversation's tokens are exact (docs/design.md,
    "Episodes"). The model's own sampled tokens are never passed through :meth:`encode`."""

    async def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
    ) -> str:
        """``messages`` through the chat template, as text (special tokens spelled out)."""
        ...

    async def encode(self, text: str) -> array[int]:
        """Token ids of rendered text, adding no special tokens of their own (the template's
        are in the text)."""
        ...

    def decode(self, token_ids: array[int]) -> str:
        """The text of generated tokens, as a sample's ``text`` holds it."""
        ...


@runtime_checkable
class PromptMeter(Protocol):
    """What an engine with a bounded context offers beside :class:`GenerationEngine`, so that a
    submitted prompt whose ``max_tokens`` cannot fit is refused before it is accepted."""

    max_model_len: int

    async def prompt_tokens(self, prompt: Prompt) -> int:
        """Tokens of ``prompt`` as the engine renders it."""
        ...
