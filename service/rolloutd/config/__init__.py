"""Configuration: one YAML file, overridden by ``ROLLOUTD_*`` environment variables, then flags.

What the rest of rolloutd imports (``from rolloutd.config import Config, load_config``); each
module beside it has one job:

- :mod:`~rolloutd.config.loader` reads the file, the environment and the flags into a ``Config``;
- :mod:`~rolloutd.config.model` is ``Config``, the root: every section, the checks across them,
  and the component configs composed from their keys;
- :mod:`~rolloutd.config.components` holds the sections of one component each (engine, limits,
  checkpoint, weights, recovery, scoring, filter, pipeline, fleet);
- :mod:`~rolloutd.config.dataset`, :mod:`~rolloutd.config.episodes` and
  :mod:`~rolloutd.config.endpoints` (``grpc``, ``http``, ``auth``) hold the other sections;
- :mod:`~rolloutd.config.section` is what every section is, and how a key takes its default and
  meaning from a component's own config.
"""

from rolloutd.config.components import (
    CheckpointConfig,
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
)
from rolloutd.config.dataset import DatasetConfig, GenerationSettings, SourceSettings
from rolloutd.config.endpoints import (
    AuthConfig,
    GrpcConfig,
    HttpConfig,
    is_loopback,
    unauthenticated_binds,
)
from rolloutd.config.episodes import ENVIRONMENT_PATTERN, EpisodesSettings
from rolloutd.config.loader import ENV_PREFIX, SERVICE_LINK, ConfigError, env_overrides, load_config
from rolloutd.config.model import Config
from rolloutd.config.section import Section, owned

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
