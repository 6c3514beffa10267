"""Builds the configured engine; heavy engines are imported only here, only when chosen."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rolloutd.domain.engine import GenerationEngine
from rolloutd.engines.synthetic import SyntheticConfig, SyntheticEngine
from rolloutd.engines.vllm_config import VLLMConfig


@dataclass(frozen=True)
class EngineFactoryConfig:
    """Which engine to build and on what; ``rolloutd.config`` exposes these as ``engine.*`` keys
    with these defaults and meanings. The sampling keys of ``engine`` belong to the controller."""

    kind: Literal["vllm", "synthetic"] = "vllm"
    """Which engine generates: vLLM, or the deterministic synthetic engine."""
    model: str | None = None
    """Local Hugging Face model directory; unset builds the tiny model once into the cache."""
    cache_dir: str = "./.rolloutd/cache"
    """Where the tiny model is built."""
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)


@dataclass(frozen=True)
class BuiltEngine:
    engine: GenerationEngine
    model_id: str
    """What generates, for the snapshot fingerprint: a model directory, or the tiny model's
    content-addressed cache name, or ``synthetic``."""
    model_dir: Path | None = None
    """The served model's directory, whose tensors new weights must match; the synthetic engine
    has one only when ``engine.model`` names it."""


def build_engine(config: EngineFactoryConfig, *, max_sequences: int) -> BuiltEngine:
    """``max_sequences``: the most siblings that may generate at once (the vLLM engine sizes its
    KV cache on CPU for them)."""
    if config.kind == "synthetic":
        return BuiltEngine(
            SyntheticEngine(config.synthetic),
            "synthetic",
            None if config.model is None else Path(config.model),
        )
    from rolloutd.engines.tiny_model import ensure_tiny_model
    from rolloutd.engines.vllm import VLLMEngine

    if config.model is not None:
        return BuiltEngine(
            VLLMEngine(config.vllm, config.model, max_sequences=max_sequences),
            config.model,
            Path(config.model),
        )
    tiny = ensure_tiny_model(config.cache_dir)
    settings = config.vllm
    if settings.dtype == "auto":
        # The tiny model is float32; vLLM's "auto" would serve it in bf16 and lose greedy parity
        # with transformers.
        settings = dataclasses.replace(settings, dtype="float32")
    return BuiltEngine(VLLMEngine(settings, tiny, max_sequences=max_sequences), tiny.name, tiny)
