"""Configuration: one YAML file, overridden by ``ROLLOUTD_*`` environment variables, then flags.

What the rest of rolloutd imports; the modules beside it each hold one part: the model
(:mod:`~rolloutd.config.model`), the sections of its own (:mod:`~rolloutd.config.dataset`,
:mod:`~rolloutd.config.episodes`, :mod:`~rolloutd.config.endpoints`) and what every section is
(:mod:`~rolloutd.config.section`).
"""

from rolloutd.config.dataset import DatasetConfig, GenerationSettings, SourceSettings
from rolloutd.config.endpoints import (
    AuthConfig,
    GrpcConfig,
    HttpConfig,
    is_loopback,
    unauthenticated_binds,
)
from rolloutd.config.episodes import ENVIRONMENT_PATTERN, EpisodesSettings
from rolloutd.config.model import (
    ENV_PREFIX,
    SERVICE_LINK,
    CheckpointConfig,
    Config,
    ConfigError,
    EngineConfig,
    FilterSettings,
    FleetConfig,
    LimitsConfig,
    PipelineConfig,
    RecoveryConfig,
    ScoringSettings,
    SyntheticSettings,
    VLLMSettings,
    WeightsConfig,
    env_overrides,
    load_config,
    owned,
)
from rolloutd.config.section import Section

__all__ = [
    "ENVIRONMENT_PATTERN",
    "ENV_PREFIX",
    "SERVICE_LINK",
    "AuthConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DatasetConfig",
    "EngineConfig",
    "EpisodesSettings",
    "FilterSettings",
    "FleetConfig",
    "GenerationSettings",
    "GrpcConfig",
    "HttpConfig",
    "LimitsConfig",
    "PipelineConfig",
    "RecoveryConfig",
    "ScoringSettings",
    "Section",
    "SourceSettings",
    "SyntheticSettings",
    "VLLMSettings",
    "WeightsConfig",
    "env_overrides",
    "is_loopback",
    "load_config",
    "owned",
    "unauthenticated_binds",
]
