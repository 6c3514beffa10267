"""Builds the configured engine; heavy engines are imported only here, only when chosen."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rolloutd.config import EngineConfig
from rolloutd.domain.engine import GenerationEngine
from rolloutd.engines.synthetic import SyntheticEngine


@dataclass(frozen=True)
class BuiltEngine:
    engine: GenerationEngine
    model_id: str
    """What generates, for the snapshot fingerprint: a model directory, or the tiny model's
    content-addressed cache name, or ``synthetic``."""
    model_dir: Path | None = None
    """The served model's directory, whose tensors new weights must match; the synthetic engine
    has one only when ``engine.model`` names it."""


def build_engine(config: EngineConfig, *, max_sequences: int) -> BuiltEngine:
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
            VLLMEngine(config, config.model, max_sequences=max_sequences),
            config.model,
            Path(config.model),
        )
    tiny = ensure_tiny_model(config.cache_dir)
    if config.vllm.dtype == "auto":
        # The tiny model is float32; vLLM's "auto" would serve it in bf16 and lose greedy parity
        # with transformers.
        config = config.model_copy(
            update={"vllm": config.vllm.model_copy(update={"dtype": "float32"})}
        )
    return BuiltEngine(VLLMEngine(config, tiny, max_sequences=max_sequences), tiny.name, tiny)
