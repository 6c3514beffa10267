"""How the domain reports what happened, as plain data. Telemetry implements this interface.

Implementations must not raise into the caller and must not block: they run inside mutations.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from rolloutd.domain.episode import EpisodeEnd
from rolloutd.domain.finishing import Verdict
from rolloutd.domain.mutation import MutationKind
from rolloutd.domain.report import CheckpointReport, Disposition, RestoreReport


@dataclass(frozen=True)
class GenerationStarted:
    """A group's siblings are about to be dispatched: after admission, or after a restore for a
    group the snapshot held unfinished (``admitted_at`` is then the original admission)."""

    group_id: int
    prompt_id: str
    group_size: int
    admitted_at: float
    """Wall-clock seconds."""
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int = 0
    seed: int = 0
    """The group's seed (each sibling's derives from it)."""
    source: str = ""
    """The name of the group's source."""


@dataclass(frozen=True)
class GroupCommitted:
    group_id: int
    tokens: int
    """Generated tokens of all siblings."""
    exact: bool
    """True when tokens were counted from captured token ids, False when estimated."""
    completion_s: float
    """Admission to commit."""
    prompt_tokens: int
    """Tokens of the prompt, as the engine saw it (once, not once per sibling)."""
    group_size: int
    source: str = ""
    """The name of the group's source."""


@dataclass(frozen=True)
class GroupFinished:
    """The finishing stage decided about a group (before it is committed or dropped)."""

    group_id: int
    started_ns: int
    ended_ns: int
    """Wall-clock nanoseconds: when the stage was asked, and when it answered."""
    verdict: Verdict
    tokens: int
    """Generated tokens of all siblings (what a drop wastes)."""


@dataclass(frozen=True)
class GroupDropped:
    """A group was dropped: by the finishing stage's verdict, a stage that failed, or an engine
    error that outlasted its sibling's retries (which never reaches the stage)."""

    group_id: int
    reason: str
    """``Verdict.drop_reason``, ``engine_error``, ``stage_failed``, ``undeliverable`` or
    ``lease_expiries`` (as ``GetStatus`` counts)."""
    tokens: int
    """Generated tokens of the group's staged siblings: the generation the drop wasted."""


# --- episodes (docs/design.md, "Episodes") -------------------------------------------------------
# An episode reports as it goes, so that a trace shows a long episode's turns while it runs and
# its counters move turn by turn: started, then a turn or an environment call at a time (each
# with its true start and end, wall-clock nanoseconds), then ended, exactly once, whatever ends
# it (an exception too: the sibling's retry starts a new run of the same episode).


class EnvironmentCall(enum.Enum):
    """What an episode asked its environment."""

    RESET = "reset"
    STEP = "step"
    RESTORE = "restore"
    """``restore(start, state)`` after a restart, from the state saved with the last record."""


@dataclass(frozen=True)
class EpisodeStarted:
    group_id: int
    sibling: int
    episode_id: str
    """Stable across restarts: the conversation's id in traces."""
    source: str
    """The name of the prompt's source."""
    environment: str
    """The environment's name (its spec or URL)."""
    started_ns: int
    restored: bool
    """The episode goes on from records a restore found."""


@dataclass(frozen=True)
class EpisodeTurn:
    """A model turn of an episode is durable (generated, or found durable after a restore)."""

    episode_id: str
    turn: int
    started_ns: int
    ended_ns: int
    """The engine's generation (equal for a reused turn: nothing was generated)."""
    input_tokens: int
    """The context the model saw: the prompt and the conversation before the turn."""
    output_tokens: int
    finish_reason: str
    recovered: Disposition | None = None
    """None: generated live. REUSED: durable before a restore and taken from it, not
    generated again. RERUN: the first turn a restored episode generates (it may have been under
    way at the crash: continued from its captured tokens, or generated again)."""
    resumed_tokens: int = 0
    """Tokens a rerun turn continued from (captured by the snapshot), of ``output_tokens``."""


@dataclass(frozen=True)
class EnvironmentCalled:
    """A call to the environment returned or failed (a failure ends the episode)."""

    episode_id: str
    call: EnvironmentCall
    turn: int
    """The model turn a step answers (-1 for a reset or a restore)."""
    started_ns: int
    ended_ns: int
    replay: bool = False
    """Called to rebuild the environment after a restore (``step(..., replay=True)``, or the
    reset before the replay): its result was durable already."""
    mismatch: bool = False
    """A replayed call answered other messages than the recorded ones (the recorded are kept)."""
    done: bool = False
    failure: EpisodeEnd | None = None
    detail: str = ""
    """What failed, in words."""


@dataclass(frozen=True)
class EpisodeEnded:
    episode_id: str
    ended_ns: int
    end: EpisodeEnd | None
    """None: the run stopped by an exception (``error``): an engine error the sibling's retry
    takes up, or its cancellation (the group evicted or dropped, the service stopping)."""
    turns: int
    """Model turns in the episode, reused ones too."""
    prompt_tokens: int = 0
    model_tokens: int = 0
    environment_tokens: int = 0
    reward: float | None = None
    retokenization_mismatches: int = 0
    error: str = ""


class Observer(Protocol):
    def mutation_blocked(self, kind: MutationKind, wait_s: float) -> None: ...

    def generation_started(self, event: GenerationStarted) -> Mapping[str, str]:
        """Returns the trace context (W3C headers) every sibling request of the group carries,
        so the engine's own request spans join the group's trace; empty when not traced."""

    def generation_abandoned(self, group_id: int, reason: str) -> None:
        """The group whose generation started will never commit (evicted or dropped)."""

    def group_committed(self, event: GroupCommitted) -> None: ...

    def groups_leased(self, queue_s: list[float], staleness: list[int]) -> None:
        """For each leased group: ``queue_s``, time from commit to its first lease;
        ``staleness``, policy versions between the weights generating now and the group's."""

    def groups_evicted(self, count: int) -> None: ...

    def group_finished(self, event: GroupFinished) -> None:
        """Called while the group's generation is still open (before it commits or is
        abandoned), so its scoring can be told as part of it."""

    def group_dropped(self, event: GroupDropped) -> None:
        """Every drop, whatever its reason, once, after it is counted in ``Counters``."""

    def checkpoint_attempted(self, report: CheckpointReport) -> None: ...

    def restored(self, report: RestoreReport) -> None: ...

    def episode_started(self, event: EpisodeStarted) -> None: ...

    def episode_turn(self, event: EpisodeTurn) -> None: ...

    def environment_called(self, event: EnvironmentCalled) -> None: ...

    def episode_ended(self, event: EpisodeEnded) -> None: ...


class NullObserver:
    """Observes nothing; the default when telemetry is off."""

    def mutation_blocked(self, kind: MutationKind, wait_s: float) -> None:
        return None

    def generation_started(self, event: GenerationStarted) -> Mapping[str, str]:
        return {}

    def generation_abandoned(self, group_id: int, reason: str) -> None:
        return None

    def group_committed(self, event: GroupCommitted) -> None:
        return None

    def groups_leased(self, queue_s: list[float], staleness: list[int]) -> None:
        return None

    def groups_evicted(self, count: int) -> None:
        return None

    def group_finished(self, event: GroupFinished) -> None:
        return None

    def group_dropped(self, event: GroupDropped) -> None:
        return None

    def checkpoint_attempted(self, report: CheckpointReport) -> None:
        return None

    def restored(self, report: RestoreReport) -> None:
        return None

    def episode_started(self, event: EpisodeStarted) -> None:
        return None

    def episode_turn(self, event: EpisodeTurn) -> None:
        return None

    def environment_called(self, event: EnvironmentCalled) -> None:
        return None

    def episode_ended(self, event: EpisodeEnded) -> None:
        return None
