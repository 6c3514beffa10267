"""The configuration model: :class:`Config`, the root that holds every section, checks what
spans several of them, and composes each component's frozen config from its keys
(:meth:`Config.controller`, :meth:`Config.checkpointer`, :meth:`Config.engine_factory`).

It is the single source of truth for configuration keys (``docs/configuration.md`` is generated
from it); errors name the offending key. The sections live beside it: those of one component
each (:mod:`rolloutd.config.components`), ``dataset`` (:mod:`rolloutd.config.dataset`),
``episodes`` (:mod:`rolloutd.config.episodes`) and the served ports, ``grpc``, ``http`` and
``auth`` (:mod:`rolloutd.config.endpoints`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, Field, field_validator, model_validator

from rolloutd.checkpoint.checkpointer import CheckpointerConfig
from rolloutd.config.components import (
    CheckpointConfig,
    EngineConfig,
    FilterSettings,
    FleetConfig,
    LimitsConfig,
    PipelineConfig,
    RecoveryConfig,
    ScoringSettings,
    WeightsConfig,
)
from rolloutd.config.dataset import DatasetConfig
from rolloutd.config.endpoints import AuthConfig, GrpcConfig, HttpConfig, unauthenticated_binds
from rolloutd.config.episodes import EpisodesSettings
from rolloutd.config.section import Section, owned
from rolloutd.domain.concurrency import ConcurrencyConfig
from rolloutd.domain.controller import ControllerConfig
from rolloutd.domain.engine import SamplingParams
from rolloutd.domain.spec import SpecError, SpecLimits, check
from rolloutd.engines.factory import EngineFactoryConfig
from rolloutd.engines.synthetic import SyntheticConfig
from rolloutd.engines.vllm_config import VLLMConfig
from rolloutd.scoring import FilterConfig, OnFailure, ScoringConfig

T = TypeVar("T")


class Config(Section):
    engine: EngineConfig = EngineConfig()
    dataset: DatasetConfig = DatasetConfig()
    group_size: int = owned(ControllerConfig, "group_size", gt=0)
    limits: LimitsConfig = LimitsConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    recovery: RecoveryConfig = RecoveryConfig()
    pipeline: PipelineConfig = PipelineConfig()
    scoring: ScoringSettings = ScoringSettings()
    filter: FilterSettings = FilterSettings()
    episodes: EpisodesSettings = EpisodesSettings()
    weights: WeightsConfig = WeightsConfig()
    restore: str = "latest"
    """Snapshot to restore at start: latest, none, a sequence number or a tag."""
    umask: int = Field(0o077, ge=0, le=0o777)
    """umask of ``rolloutd serve``: the snapshots, journal, staged weights and logs it creates
    are its user's alone (files 0600, directories 0700); ``0o027`` lets its group read them.
    Octal: ``0o027`` or ``"027"`` in YAML and in ROLLOUTD_UMASK."""
    switch_interval_ms: float = Field(0.5, gt=0, le=100)
    """How long a thread of ``rolloutd serve`` holds Python's GIL before another one waiting for
    it may run (``sys.setswitchinterval``; Python's own default is 5 ms). The event loop is busy
    most of the time (vLLM's outputs, the episodes), and the threads it hands I/O to (the
    journal's sync, environment calls) wait up to this long at each handoff: with 5 ms an
    episode's durable turns cost 13% of its throughput, with 0.5 ms nothing measurable
    (benchmarks/README.md, episodes.py)."""
    grpc: GrpcConfig = GrpcConfig()
    http: HttpConfig = HttpConfig()
    auth: AuthConfig = AuthConfig()
    fleet: FleetConfig = FleetConfig()

    @field_validator("umask", mode="before")
    @classmethod
    def _octal(cls, value: Any) -> Any:
        # YAML reads 0o027 as text and 027 as a number in base 8 already; text is octal digits.
        if isinstance(value, str):
            try:
                return int(value.removeprefix("0o"), 8)
            except ValueError:
                raise ValueError(f"not an octal umask: {value!r}") from None
        return value

    @field_validator("restore", mode="before")
    @classmethod
    def _restore_as_text(cls, value: Any) -> Any:
        # YAML and environment values parse `42` as a number; a sequence number is meant.
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        if self.limits.in_flight_cap > self.limits.buffer_capacity:
            key = "max_in_flight" + ("_ceiling" if self.limits.max_in_flight == "auto" else "")
            raise ValueError(
                f"limits.{key} must not exceed limits.buffer_capacity "
                f"({self.limits.in_flight_cap} > {self.limits.buffer_capacity})"
            )
        if 2 * self.limits.max_metadata_bytes >= self.grpc.max_message_mb << 20:
            raise ValueError(
                "limits.max_metadata_bytes must be below half of grpc.max_message_mb (a group "
                "carries its metadata twice, as a Struct and as JSON): "
                f"{self.limits.max_metadata_bytes} >= {(self.grpc.max_message_mb << 20) // 2}"
            )
        if (self.grpc.tls_cert is None) != (self.grpc.tls_key is None):
            raise ValueError("grpc.tls_cert and grpc.tls_key must be set together")
        if self.grpc.tls_client_ca is not None and self.grpc.tls_cert is None:
            raise ValueError("grpc.tls_client_ca needs grpc.tls_cert and grpc.tls_key")
        if (self.http.tls_cert is None) != (self.http.tls_key is None):
            raise ValueError("http.tls_cert and http.tls_key must be set together")
        if self.http.tls_client_ca is not None and self.http.tls_cert is None:
            raise ValueError("http.tls_client_ca needs http.tls_cert and http.tls_key")
        self.scoring_config()  # its cross-field checks name their keys
        self.filter_config()
        if self.filter.zero_variance and not (
            self.scoring.verifier
            or self.scoring.group_verifier
            or any(s.verifier for s in self.dataset.sources)
            or self.episodes_configured()
        ):
            raise ValueError(
                "filter.zero_variance needs rewards: set scoring.verifier or scoring.group_verifier"
            )
        if self.pipeline.finishing_stage and (self.scoring.verifier or self.scoring.group_verifier):
            raise ValueError(
                "pipeline.finishing_stage replaces the scoring stage: unset it or scoring.verifier"
            )
        if self.group_size > self.limits.max_group_size:
            raise ValueError(
                f"group_size {self.group_size} exceeds limits.max_group_size "
                f"{self.limits.max_group_size}"
            )
        for i, source in enumerate(self.dataset.sources):
            try:
                check(source.generation.spec(), self.spec_limits())
            except SpecError as exc:
                raise ValueError(f"dataset.sources[{i}].{exc}") from exc
            if source.verifier and self.pipeline.finishing_stage:
                raise ValueError(
                    f"dataset.sources[{i}].verifier: pipeline.finishing_stage replaces the "
                    "scoring stage"
                )
        if self.episodes_configured() and self.pipeline.sibling_runner:
            raise ValueError(
                "pipeline.sibling_runner replaces the episode runner: unset it or "
                "episodes.environment"
            )
        if self.fleet.replica >= self.fleet.replicas:
            raise ValueError(
                f"fleet.replica must be below fleet.replicas ({self.fleet.replica} >= "
                f"{self.fleet.replicas}); replicas are numbered from 0"
            )
        return self

    def unauthenticated_binds(self) -> list[str]:
        """The host keys of ports bound beyond this machine that nothing authenticates
        (:func:`rolloutd.config.endpoints.unauthenticated_binds`)."""
        return unauthenticated_binds(self.grpc, self.http, self.auth)

    def controller(self) -> ControllerConfig:
        """The controller's config: its keys from ``limits``, ``group_size``, ``dataset.seed``
        and the sampling keys of ``engine``."""
        in_flight = self.limits.in_flight_cap
        if self.filter.zero_variance:
            in_flight = min(
                int(in_flight * (1 + self.filter.max_oversample_ratio)), self.limits.buffer_capacity
            )
        adaptive = self.limits.max_in_flight == "auto"
        return _compose(
            ControllerConfig,
            self.limits,
            max_in_flight=in_flight,
            concurrency=ConcurrencyConfig(
                ceiling=in_flight, kv_cache_soft_limit=self.limits.kv_cache_soft_limit
            )
            if adaptive
            else None,
            group_size=self.group_size,
            seed=self.dataset.seed,
            sampling=_compose(SamplingParams, self.engine),
            spec_limits=self.spec_limits(),
            replica=self.fleet.replica,
            replicas=self.fleet.replicas,
            capture_partials=self.recovery.granularity == "token",
            durable_turns=self.episodes.durable_turns,
        )

    def episodes_configured(self) -> bool:
        """Whether any prompt runs as an episode."""
        return self.episodes.environment is not None or any(
            s.environment for s in self.dataset.sources
        )

    def spec_limits(self) -> SpecLimits:
        """What a prompt's or a source's generation settings may ask for."""
        vllm = self.engine.kind == "vllm"
        return SpecLimits(
            self.limits.max_group_size, self.engine.vllm.max_model_len if vllm else None
        )

    def scoring_config(self) -> ScoringConfig:
        return _compose(ScoringConfig, self.scoring, on_failure=OnFailure(self.scoring.on_failure))

    def filter_config(self) -> FilterConfig:
        return _compose(FilterConfig, self.filter)

    def checkpointer(self) -> CheckpointerConfig:
        return _compose(CheckpointerConfig, self.checkpoint)

    def engine_factory(self) -> EngineFactoryConfig:
        """What the engine factory builds: ``engine.kind``, ``engine.model``,
        ``engine.cache_dir`` and the ``engine.synthetic`` and ``engine.vllm`` sections."""
        return _compose(
            EngineFactoryConfig,
            self.engine,
            synthetic=_compose(SyntheticConfig, self.engine.synthetic),
            vllm=_compose(VLLMConfig, self.engine.vllm),
        )

    def semantic_fingerprint(
        self, dataset_digest: str | Mapping[str, str], model_id: str
    ) -> dict[str, Any]:
        """Keys whose change makes a snapshot's groups mean something else. The dataset is
        identified by its content, so the same file mounted elsewhere still restores. With
        ``dataset.sources``, ``dataset_digest`` maps each source's name to a digest of its
        content and generation settings, each its own key (a source's weight may change)."""
        if isinstance(dataset_digest, str):
            dataset: dict[str, Any] = {"dataset": dataset_digest}
        else:
            dataset = {"dataset.sources": list(dataset_digest)} | {
                f"dataset.sources[{name}]": digest for name, digest in dataset_digest.items()
            }
        return {
            "engine.model": model_id,
            "group_size": self.group_size,
            **dataset,
            "dataset.seed": self.dataset.seed,
            "dataset.shuffle": self.dataset.shuffle,
            "fleet.replicas": self.fleet.replicas,
            "fleet.replica": self.fleet.replica,
        }


def _compose(component: type[T], section: BaseModel, **rest: Any) -> T:
    """``component``'s frozen config from the keys of ``section`` that it declares, and ``rest``
    (which wins: nested sections are composed by the caller)."""
    names = {f.name for f in dataclasses.fields(component)}  # type: ignore[arg-type]
    given = {
        k: getattr(section, k) for k in type(section).model_fields if k in names and k not in rest
    }
    return component(**given, **rest)
