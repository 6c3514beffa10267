"""Per-prompt generation settings.

A :class:`GenerationSpec` is a set of overrides: each field it leaves unset comes from the next
level. A group's settings are its prompt's spec, over its source's, over the service's
configuration (:func:`resolve`); they are fixed when the group is admitted, stored with it, and
every sibling (also one resumed token by token after a restart) generates with them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of a group, shared by its siblings; each sibling brings its own seed."""

    max_tokens: int = 64
    """Longest completion of one sibling, in tokens."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = 0
    """Sample among this many most likely tokens (0: all)."""
    min_p: float = 0.0
    """Drop tokens less likely than this fraction of the most likely one (0: none)."""
    stop: tuple[str, ...] = ()
    """Strings that end a completion (not included in its text); also when one spans the
    boundary between the tokens a restored sibling resumed from and its continuation."""


MAX_STOP_STRINGS = 16
"""Most stop strings one spec may hold."""


@dataclass(frozen=True)
class GenerationSpec:
    """Generation settings of a prompt or a source; None: not set here."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] | None = None
    seed: int | None = None
    """The group's seed: each sibling's seed derives from it and its index."""
    group_size: int | None = None

    def set_fields(self) -> dict[str, Any]:
        """The settings this spec sets, by name."""
        return {
            f.name: value
            for f in dataclasses.fields(self)
            if (value := getattr(self, f.name)) is not None
        }

    def over(self, base: GenerationSpec) -> GenerationSpec:
        """This spec where it sets a field, ``base`` elsewhere."""
        return dataclasses.replace(base, **self.set_fields())

    def __bool__(self) -> bool:
        return bool(self.set_fields())

    def to_json(self) -> dict[str, Any]:
        """The fields set, as JSON values."""
        return {k: list(v) if k == "stop" else v for k, v in self.set_fields().items()}

    @staticmethod
    def from_json(value: Any) -> GenerationSpec:
        """A spec from JSON; :class:`SpecError` names the first field that is not one."""
        if value is None:
            return EMPTY
        if not isinstance(value, Mapping):
            raise SpecError("generation", "must be an object")
        unknown = sorted(set(value) - FIELDS.keys())
        if unknown:
            raise SpecError(unknown[0], f"is not a generation setting (known: {', '.join(FIELDS)})")
        fields: dict[str, Any] = {}
        for name, raw in value.items():
            if raw is not None:
                fields[name] = _typed(name, raw)
        return GenerationSpec(**fields)


EMPTY = GenerationSpec()

FIELDS: dict[str, type] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "max_tokens": int,
    "stop": tuple,
    "seed": int,
    "group_size": int,
}
"""Each setting and its type, in declaration order."""


class SpecError(ValueError):
    """A generation setting that cannot be used; ``field`` names it."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"generation.{field} {problem}")
        self.field = field
        self.problem = problem


def _typed(name: str, raw: Any) -> Any:
    kind = FIELDS[name]
    if kind is tuple:
        if isinstance(raw, str):
            raw = [raw]
        if not isinstance(raw, list | tuple) or not all(isinstance(s, str) and s for s in raw):
            raise SpecError(name, "must be a list of non-empty strings")
        return tuple(raw)
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise SpecError(name, f"must be a number, not {type(raw).__name__}")
    if kind is int:
        if isinstance(raw, float) and not raw.is_integer():
            raise SpecError(name, f"must be a whole number, not {raw}")
        return int(raw)
    if not math.isfinite(raw):
        raise SpecError(name, f"must be finite, not {raw}")
    return float(raw)


@dataclass(frozen=True)
class SpecLimits:
    """What an engine and the service accept."""

    max_group_size: int = 1024
    """``limits.max_group_size``."""
    max_model_len: int | None = None
    """The engine's context length (None: unbounded, the synthetic engine)."""


def check(spec: GenerationSpec, limits: SpecLimits) -> None:
    """Raises :class:`SpecError` for the first setting outside what the engine accepts."""
    if spec.temperature is not None and spec.temperature < 0:
        raise SpecError("temperature", f"must be at least 0 (0: greedy), not {spec.temperature}")
    if spec.top_p is not None and not 0 < spec.top_p <= 1:
        raise SpecError("top_p", f"must be in (0, 1], not {spec.top_p}")
    if spec.top_k is not None and spec.top_k < 0:
        raise SpecError("top_k", f"must be at least 0 (0: off), not {spec.top_k}")
    if spec.min_p is not None and not 0 <= spec.min_p <= 1:
        raise SpecError("min_p", f"must be in [0, 1], not {spec.min_p}")
    if spec.max_tokens is not None:
        if spec.max_tokens < 1:
            raise SpecError("max_tokens", f"must be at least 1, not {spec.max_tokens}")
        if limits.max_model_len is not None and spec.max_tokens >= limits.max_model_len:
            raise SpecError(
                "max_tokens",
                f"{spec.max_tokens} leaves no room for the prompt within "
                f"engine.vllm.max_model_len={limits.max_model_len}",
            )
    if spec.stop is not None and len(spec.stop) > MAX_STOP_STRINGS:
        raise SpecError("stop", f"holds {len(spec.stop)} strings; at most {MAX_STOP_STRINGS}")
    if spec.seed is not None and not 0 <= spec.seed < 2**31 - 1:
        raise SpecError("seed", f"must be in [0, 2^31 - 1), not {spec.seed}")
    if spec.group_size is not None and not 1 <= spec.group_size <= limits.max_group_size:
        raise SpecError(
            "group_size",
            f"must be in [1, limits.max_group_size={limits.max_group_size}], not {spec.group_size}",
        )


def check_prompt_length(max_tokens: int, prompt_tokens: int, max_model_len: int | None) -> None:
    """Raises :class:`SpecError` when ``max_tokens`` more tokens after the prompt do not fit the
    engine's context."""
    if max_model_len is not None and prompt_tokens + max_tokens > max_model_len:
        raise SpecError(
            "max_tokens",
            f"{max_tokens} after a prompt of {prompt_tokens} tokens exceeds "
            f"engine.vllm.max_model_len={max_model_len} (at most {max_model_len - prompt_tokens})",
        )


@dataclass(frozen=True)
class Resolved:
    """A group's settings: what its siblings are generated with."""

    params: SamplingParams
    group_size: int
    seed: int | None
    """The spec's seed; None: derived from the service's seed and the group's id."""


def resolve(spec: GenerationSpec, defaults: SamplingParams, group_size: int) -> Resolved:
    """``spec`` (a prompt's over its source's) over the service's ``defaults``."""
    sampling = {f.name for f in dataclasses.fields(SamplingParams)}
    params = dataclasses.replace(
        defaults, **{k: v for k, v in spec.set_fields().items() if k in sampling}
    )
    return Resolved(params, spec.group_size or group_size, spec.seed)
