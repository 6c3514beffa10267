"""Episodes: a sibling that is a conversation of model turns and environment steps (tool calls,
code execution, games), with the environment protocol users write against.

An *environment* is asked, per episode, ``reset(start)`` once and then ``step(episode_id, turn,
completion)`` after each model turn (turns numbered from 0). Users implement it as a plain class
(sync or async methods; see :class:`Environment`) or serve it over HTTP; rolloutd adapts either
to :class:`EnvironmentPort`, the port the episode runner calls.

The durability contract (docs/design.md, "Episodes"):

* a model turn's tokens are durable before ``step`` is called for that turn, and ``step``'s
  result is durable before the next model turn's tokens are (its write overlaps that turn);
* after a crash and a restore, a turn whose tokens were durable is never generated again, and a
  ``step`` whose result was durable is never called live again;
* a ``step`` that was running when the process died, or had returned but whose result was not
  durable yet, is called again with the same
  ``(episode_id, turn)`` key and the same ``completion``: an environment with external side
  effects deduplicates on that key;
* the environment's own state comes back through ``state()`` / ``restore(start, state)`` when it
  has them (the state is saved with each step's result), otherwise by replaying the durable
  turns through ``step(..., replay=True)``, in which the environment must not repeat side
  effects; a replayed step that returns other messages than the recorded ones is counted and the
  recorded ones are kept.

Kept free of imports beyond the standard library: the domain and user code both import it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

Message = Mapping[str, Any]
"""A chat message as the chat template takes it: ``{"role": ..., "content": ...}`` (a tool
message may carry ``name`` or ``tool_call_id``)."""


@dataclass(frozen=True)
class EpisodeStart:
    """What an environment is told when an episode starts (and again when it is restored)."""

    episode_id: str
    """Stable across restarts and unique per sibling: ``"g<group id>-s<sibling>"``. Together
    with a turn number it is the key an environment deduplicates side effects on."""
    group_id: int
    sibling: int
    prompt_id: str
    messages: tuple[Message, ...]
    """The prompt's messages (a text prompt is one user message)."""
    metadata: Any
    """The prompt's ``metadata`` exactly as submitted or read from the dataset (None: none)."""
    tools: tuple[Mapping[str, Any], ...] = ()
    """JSON schemas of the tools, as passed to the chat template (from the dataset row or the
    submission)."""


@dataclass(frozen=True)
class StepResult:
    """What an environment answers after a model turn."""

    messages: tuple[Message, ...] = ()
    """Messages to append after the model's turn (``{"role": "tool", "content": ...}``)."""
    done: bool = False
    """The episode is over: no further model turn."""
    reward: float | None = None
    """The episode's reward, when ``done`` (None: a verifier scores the conversation)."""


class EpisodeEnd(enum.Enum):
    """Why an episode ended: the finish reason of its sample (``episode:<value>``)."""

    DONE = "done"
    """The environment said ``done``."""
    MAX_TURNS = "max_turns"
    """``episodes.max_turns`` model turns ran."""
    MAX_TOTAL_TOKENS = "max_total_tokens"
    """Prompt, model and environment tokens reached ``episodes.max_total_tokens``."""
    STEP_FAILED = "step_failed"
    """``step`` (or ``reset``) raised, or the environment could not be reached within its
    retries."""
    STEP_TIMEOUT = "step_timeout"
    """``step`` (or ``reset``) ran past ``episodes.step_timeout_s``."""
    MALFORMED = "malformed"
    """The environment answered something that is not a valid :class:`StepResult`."""

    @property
    def failed(self) -> bool:
        """The environment failed: the group is handled as ``scoring.on_failure`` says."""
        return self in (EpisodeEnd.STEP_FAILED, EpisodeEnd.STEP_TIMEOUT, EpisodeEnd.MALFORMED)

    @property
    def finish_reason(self) -> str:
        """The finish reason of the episode's sample, as trainers receive it."""
        return FINISH_PREFIX + self.value

    @classmethod
    def of_finish_reason(cls, finish_reason: str) -> EpisodeEnd | None:
        """The end a stored finish reason names (None: not an episode's). Only a snapshot's
        codec reads it back: a live sample carries its end as ``Sample.episode_end``."""
        if not finish_reason.startswith(FINISH_PREFIX):
            return None
        return cls(finish_reason.removeprefix(FINISH_PREFIX))


FINISH_PREFIX = "episode:"
"""What an episode's finish reason starts with (``episode:<EpisodeEnd value>``)."""


class EnvironmentFailure(Exception):
    """Raised by an :class:`EnvironmentPort` when a call fails; ``end`` says how the episode
    ends because of it."""

    def __init__(self, end: EpisodeEnd, detail: str) -> None:
        super().__init__(detail)
        self.end = end
        self.detail = detail


@runtime_checkable
class Environment(Protocol):
    """What a user writes (``episodes.environment: "package.module:Class"``).

    The class is built once with ``episodes.environment_config`` (a mapping, as keyword
    arguments) and serves every episode; per-episode state is keyed by ``episode_id``. Each
    method may be sync or async: sync ones run in a worker thread so that a CPU-heavy or
    blocking environment does not stall the service. Two optional methods make its state
    durable without a replay::

        def state(self, episode_id: str) -> bytes: ...
        def restore(self, start: EpisodeStart, state: bytes) -> None: ...
    """

    def reset(self, start: EpisodeStart) -> Sequence[Message]:
        """Starts (or, after a restart without ``state``, restarts) an episode; returns the
        messages to add after the prompt (possibly none)."""
        ...

    def step(
        self, episode_id: str, turn: int, completion: str, *, replay: bool = False
    ) -> StepResult:
        """Answers model turn ``turn`` (its text, ``completion``). With ``replay`` the turn
        happened before a restart and its result is already recorded: rebuild state only, and
        repeat no side effect. A call for the same ``(episode_id, turn)`` without ``replay``
        may come twice (a crash during the first): the completion is then the same."""
        ...


@runtime_checkable
class EnvironmentPort(Protocol):
    """What the episode runner calls: an :class:`Environment` adapted (async, bounded by
    ``episodes.step_timeout_s``, results validated), in process or over HTTP. Failures raise
    :class:`EnvironmentFailure`."""

    name: str
    """What traces call the environment (its spec or URL)."""
    has_state: bool
    """Whether ``state``/``restore`` are available (else a restore replays)."""

    async def reset(self, start: EpisodeStart) -> tuple[Message, ...]: ...

    async def step(
        self, episode_id: str, turn: int, completion: str, *, replay: bool = False
    ) -> StepResult: ...

    async def state(self, episode_id: str) -> bytes: ...

    async def restore(self, start: EpisodeStart, state: bytes) -> None: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class EpisodeLimits:
    """``episodes.*`` limits an episode runs under."""

    max_turns: int = 8
    max_total_tokens: int = 4096
    step_timeout_s: float = 60.0
