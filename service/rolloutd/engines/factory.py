"""Builds the configured engine; heavy engines are imported only here, only when chosen."""

from __future__ import annotations

from dataclasses import dataclass

from rolloutd.config import EngineConfig
from rolloutd.domain.engine import GenerationEngine
from rolloutd.engines.synthetic import SyntheticConfig, SyntheticEngine


@dataclass(frozen=True)
class BuiltEngine:
    engine: GenerationEngine
    model_id: str
    """What generates, for the snapshot fingerprint: a model directory, or the tiny model's
    content-addressed cache name, or ``synthetic``."""


def build_engine(config: EngineConfig) -> BuiltEngine:
    if config.kind == "synthetic":
        s = config.synthetic
        return BuiltEngine(
            SyntheticEngine(SyntheticConfig(s.tokens_per_s, s.latency_s, s.latency_sigma)),
            "synthetic",
        )
    from rolloutd.engines.tiny_model import ensure_tiny_model
    from rolloutd.engines.vllm import VLLMEngine

    if config.model is not None:
        return BuiltEngine(VLLMEngine(config, config.model), config.model)
    tiny = ensure_tiny_model(config.cache_dir)
    if config.vllm.dtype == "auto":
        # The tiny model is float32; vLLM's "auto" would serve it in bf16 and lose greedy parity
        # with transformers.
        config = config.model_copy(
            update={"vllm": config.vllm.model_copy(update={"dtype": "float32"})}
        )
    return BuiltEngine(VLLMEngine(config, tiny), tiny.name)
