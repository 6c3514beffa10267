"""Episodes: multi-turn samples of model turns and environment steps (tool calls).

Users write an :class:`Environment` (a plain class, sync or async; see
:mod:`rolloutd.domain.episode` for the protocol and its durability contract) and name it in
``episodes.environment``; ``examples/`` has a runnable calculator environment.
"""

from rolloutd.domain.episode import (
    Environment,
    EnvironmentFailure,
    EnvironmentPort,
    EpisodeEnd,
    EpisodeLimits,
    EpisodeStart,
    Message,
    StepResult,
)

__all__ = [
    "Environment",
    "EnvironmentFailure",
    "EnvironmentPort",
    "EpisodeEnd",
    "EpisodeLimits",
    "EpisodeStart",
    "Message",
    "StepResult",
]
