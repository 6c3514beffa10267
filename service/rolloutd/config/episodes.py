"""The ``episodes`` section of the configuration (``Config`` composes it): multi-turn
episodes of model turns and environment steps (docs/design.md, "Episodes").

Its limits take their defaults and meanings from the domain's :class:`EpisodeLimits`; a
dataset source may name an environment of its own (``dataset.sources[].environment``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import Field

from rolloutd.config.section import Section
from rolloutd.domain.episode import EpisodeLimits

_LIMITS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(EpisodeLimits)}

ENVIRONMENT_PATTERN = r"^(https?://\S+|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$"
"""``package.module:Class`` or ``http(s)://host:port[/prefix]``."""


class EpisodesSettings(Section):
    environment: str | None = Field(None, pattern=ENVIRONMENT_PATTERN)
    """The environment every prompt's episode runs in: ``package.module:Class`` (imported from
    the service's Python path, built with ``environment_config``) or ``http://host:port`` (an
    environment served over HTTP). Unset: single-turn samples (unless a source names one)."""
    environment_config: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments the environment class is built with."""
    max_turns: int = Field(_LIMITS["max_turns"], gt=0)
    """Most model turns of an episode; an episode that reaches it ends with
    ``episode:max_turns``."""
    max_total_tokens: int = Field(_LIMITS["max_total_tokens"], gt=0)
    """Most tokens of an episode, prompt, model and environment together; an episode that
    reaches it ends with ``episode:max_total_tokens``. A model turn's ``max_tokens`` is capped by
    what is left."""
    step_timeout_s: float = Field(_LIMITS["step_timeout_s"], gt=0)
    """The longest one ``reset``/``step`` call may take; past it the episode ends with
    ``episode:step_timeout``."""
    retries: int = Field(2, ge=0)
    """An HTTP environment: retries of a call that could not connect or got a 5xx (never of a
    step that timed out)."""
    durable_turns: bool = True
    """Journal each model turn and each step's result before the episode goes on, so that a
    restart never generates a durable turn again nor calls a durable step again. Off only to
    measure what durability costs (``benchmarks/episodes.py``)."""

    def limits(self) -> EpisodeLimits:
        return EpisodeLimits(self.max_turns, self.max_total_tokens, self.step_timeout_s)
