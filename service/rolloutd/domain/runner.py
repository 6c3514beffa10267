"""The sibling runner: how one sibling of a group is produced (a port of the domain).

The controller decides *which* siblings to run and when; a runner decides *how* one is produced.
The default, :class:`EngineRunner`, is one streamed engine request. A runner that drives an
episode of model turns and environment steps, or several engine calls, plugs in through the same
port and gets the same durability (docs/design.md, "Where a new stage, runner or engine goes"):

* every token it generates goes to ``job.on_delta`` as the engine streams it (pass the sink to
  ``engine.generate``, or call it yourself), so a checkpoint captures the sibling's tokens so far;
* after a restart, ``job.request.prefix`` holds the tokens captured for the sibling (``None`` when
  none were): a runner continues from them instead of generating them again, and the engine
  continues a request that carries a prefix token for token;
* the returned :class:`Sample` is the whole sibling: its tokens after the prompt, in order, are
  exactly the deltas handed to ``on_delta`` after the prefix's.

Errors: :class:`EngineError` (recoverable) makes the controller retry the sibling from its prefix
(``sibling_retries`` times, then the group is dropped with the reason); :class:`EngineDeadError`
stops the service. ``asyncio.CancelledError`` means the sibling was aborted (its group evicted,
dropped, or the service stopping).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from rolloutd.domain.engine import DeltaSink, GenerationEngine, GenerationRequest
from rolloutd.domain.group import Sample
from rolloutd.domain.observer import NullObserver, Observer

if TYPE_CHECKING:
    from rolloutd.domain.episode_log import EpisodeLog


@dataclass(frozen=True)
class SiblingJob:
    """One sibling to produce."""

    engine: GenerationEngine
    request: GenerationRequest
    """Request id, prompt, seed, the group's sampling settings, trace headers, and the prefix a
    restore captured (``request.prefix``)."""
    on_delta: DeltaSink | None
    """Where generated tokens go as they are produced (``None``: nothing captures them)."""
    source: str = ""
    """The name of the prompt's source (an episode's environment may be the source's own)."""
    episode: EpisodeLog | None = None
    """The sibling's episode records (a restore's first): where an episode runner keeps what
    must be durable, and the tokens of its current turn (instead of ``on_delta``)."""
    observer: Observer = field(default_factory=NullObserver)
    """Where a runner reports what it did beyond the engine request (an episode's turns and
    environment calls)."""


class SiblingRunner(Protocol):
    """Produces one sibling (see the module docstring for the contract)."""

    async def run(self, job: SiblingJob) -> Sample: ...


class EngineRunner:
    """The default runner: one engine request, streamed, resumable token by token."""

    async def run(self, job: SiblingJob) -> Sample:
        return await job.engine.generate(job.request, job.on_delta)
