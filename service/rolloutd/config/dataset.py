"""The ``dataset`` section of the configuration (``Config`` composes it): where prompts come
from, one file or several weighted sources, each with its own generation settings, verifier and
environment. Checks across sections (a source's settings within ``limits``, its verifier beside
``pipeline.finishing_stage``) stay in ``Config``."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from rolloutd.config.episodes import ENVIRONMENT_PATTERN
from rolloutd.config.section import Section
from rolloutd.domain.spec import GenerationSpec


class GenerationSettings(Section):
    """Generation settings of a source's prompts (a row's own ``generation`` wins); each one unset
    here comes from ``engine.*`` and ``group_size``."""

    temperature: float | None = Field(None, ge=0)
    """Sampling temperature (0: greedy); unset: ``engine.temperature``."""
    top_p: float | None = Field(None, gt=0, le=1)
    """Nucleus sampling threshold; unset: ``engine.top_p``."""
    top_k: int | None = Field(None, ge=0)
    """Sample among this many most likely tokens (0: all); unset: ``engine.top_k``."""
    min_p: float | None = Field(None, ge=0, le=1)
    """Minimum probability relative to the most likely token; unset: ``engine.min_p``."""
    max_tokens: int | None = Field(None, gt=0)
    """Longest completion of one sibling; unset: ``engine.max_tokens``."""
    stop: tuple[str, ...] | None = None
    """Strings that end a completion; unset: ``engine.stop``."""
    seed: int | None = Field(None, ge=0, lt=2**31 - 1)
    """Seed of every group of the source (each sibling's derives from it and its index);
    unset: derived from ``dataset.seed`` and the group's id."""
    group_size: int | None = Field(None, gt=0)
    """Siblings of each group; unset: ``group_size``."""

    def spec(self) -> GenerationSpec:
        return GenerationSpec(**self.model_dump())


class SourceSettings(Section):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    """The source's name: a metric label and what delivered groups carry (letters, digits,
    ``_ . -``; at most 63)."""
    path: str | None = None
    """JSONL or Parquet prompt file (``bundled:arithmetic``: the bundled set)."""
    weight: float = Field(1.0, ge=0)
    """Share of admissions drawn from this source, relative to the others' weights (0: none
    for now). May change at a restore; each source keeps its cursor."""
    generation: GenerationSettings = GenerationSettings()
    verifier: str | None = None
    """Verifier of this source's groups, as ``scoring.verifier`` (unset: ``scoring.verifier``)."""
    environment: str | None = Field(None, pattern=ENVIRONMENT_PATTERN)
    """Environment of this source's episodes, as ``episodes.environment`` (unset:
    ``episodes.environment``)."""
    environment_config: dict[str, Any] | None = None
    """Keyword arguments of this source's environment (unset: ``episodes.environment_config``)."""


class DatasetConfig(Section):
    path: str | None = None
    """JSONL or Parquet prompt file; unset uses the bundled arithmetic prompt set. Exclusive
    with ``sources``."""
    sources: tuple[SourceSettings, ...] = ()
    """Several prompt files, each with a weight and its own generation settings: admission
    draws a source by weight (deterministically from ``seed``), and each keeps its own epoch
    and cursor. ``[{name, path, weight, generation, verifier}]``."""
    seed: int = 0
    """Seed of the per-epoch permutation and of the siblings' seeds."""
    shuffle: bool = True
    """Permute the prompts anew in every epoch."""
    epochs: int | None = Field(None, gt=0)
    """Stop admitting after this many passes; unset: unbounded."""

    @model_validator(mode="after")
    def _check(self) -> DatasetConfig:
        if self.sources:
            if self.path is not None:
                raise ValueError("dataset.path and dataset.sources exclude each other: use one")
            names = [s.name for s in self.sources]
            if len(set(names)) != len(names):
                raise ValueError(f"dataset.sources: names must be unique, got {names}")
            if not any(s.weight > 0 for s in self.sources):
                raise ValueError("dataset.sources: at least one source needs a weight above 0")
        for i, source in enumerate(self.sources):
            if source.environment_config is not None and source.environment is None:
                raise ValueError(
                    f"dataset.sources[{i}].environment_config needs "
                    f"dataset.sources[{i}].environment"
                )
        return self
