"""Builds the configured engine; heavy engines are imported only here, only when chosen."""

from __future__ import annotations

from rolloutd.config import EngineConfig
from rolloutd.engines.base import GenerationEngine
from rolloutd.engines.synthetic import SyntheticConfig, SyntheticEngine


def build_engine(config: EngineConfig) -> GenerationEngine:
    if config.kind == "synthetic":
        s = config.synthetic
        return SyntheticEngine(SyntheticConfig(s.tokens_per_s, s.latency_s, s.latency_sigma))
    from rolloutd.engines.tiny_model import ensure_tiny_model
    from rolloutd.engines.vllm import VLLMEngine

    model = config.model or str(ensure_tiny_model(config.cache_dir))
    return VLLMEngine(config, model)
