"""Configuration: one YAML file, overridden by ``ROLLOUTD_*`` environment variables, then flags.

Every key is declared here; a key that configures a component (the controller, the checkpointer,
sampling, the engines) takes its default and meaning from that component's own frozen config,
which this module composes (:meth:`Config.controller`, :meth:`Config.checkpointer`,
:meth:`Config.engine_factory`) instead of restating it. This
model is the single source of truth for configuration keys (``docs/configuration.md`` is
generated from it). Errors name the offending key. Sections of their own live beside it:
``dataset`` (:mod:`rolloutd.config.dataset`), ``episodes`` (:mod:`rolloutd.config.episodes`) and
the served ports, ``grpc``, ``http`` and ``auth`` (:mod:`rolloutd.config.endpoints`).
Environment variables nest with a double underscore: ``ROLLOUTD_LIMITS__MAX_IN_FLIGHT=32`` sets
``limits.max_in_flight``; values are parsed as YAML scalars.

Kubernetes injects service-link variables for every Service in the namespace, and a Service named
``rolloutd-admin`` yields ``ROLLOUTD_ADMIN_SERVICE_HOST`` and friends. Exactly kubelet's naming
pattern is skipped (logged at debug); every other unknown ``ROLLOUTD_*`` name is still refused, so
a mistyped key never passes silently.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import logging
import os
import re
import textwrap
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from rolloutd.checkpoint.checkpointer import CheckpointerConfig
from rolloutd.config.dataset import DatasetConfig
from rolloutd.config.endpoints import AuthConfig, GrpcConfig, HttpConfig, unauthenticated_binds
from rolloutd.config.episodes import EpisodesSettings
from rolloutd.config.section import Section
from rolloutd.domain.concurrency import ConcurrencyConfig
from rolloutd.domain.controller import ControllerConfig
from rolloutd.domain.engine import SamplingParams
from rolloutd.domain.spec import SpecError, SpecLimits, check
from rolloutd.engines.factory import EngineFactoryConfig
from rolloutd.engines.synthetic import SyntheticConfig
from rolloutd.engines.vllm_config import VLLMConfig
from rolloutd.entrypoints import SPEC
from rolloutd.scoring import FilterConfig, OnFailure, ScoringConfig

ENV_PREFIX = "ROLLOUTD_"

T = TypeVar("T")


@cache
def _attribute_docs(owner: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(owner)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for field, doc in itertools.pairwise(body):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)
        ):
            docs[field.target.id] = inspect.cleandoc(doc.value.value)
    return docs


def owned(owner: type, name: str, **constraints: Any) -> Any:
    """A key whose default and meaning the component config ``owner`` declares (its field
    ``name``); only the accepted range is stated here."""
    field = {f.name: f for f in dataclasses.fields(owner)}[name]
    return Field(field.default, description=_attribute_docs(owner)[name], **constraints)


log = logging.getLogger(__name__)

SERVICE_LINK = re.compile(
    r"^(?:[A-Z0-9_]*_)?(?:SERVICE_HOST|SERVICE_PORT(?:_[A-Z0-9_]+)?"
    r"|PORT(?:_[0-9]+_(?:TCP|UDP|SCTP)(?:_(?:PROTO|PORT|ADDR))?)?)$"
)
"""The names kubelet gives a Service's links: ``{NAME}_SERVICE_HOST``, ``{NAME}_SERVICE_PORT``,
``{NAME}_SERVICE_PORT_{PORT_NAME}``, ``{NAME}_PORT`` and ``{NAME}_PORT_{N}_{PROTO}[_PROTO|_PORT|
_ADDR]``. None of them can be a configuration key: keys below a section need ``__``, and no
top-level key ends like this."""


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; the message names the key."""


class SyntheticSettings(Section):
    tokens_per_s: float = owned(SyntheticConfig, "tokens_per_s", ge=0)
    latency_s: float = owned(SyntheticConfig, "latency_s", ge=0)
    latency_sigma: float = owned(SyntheticConfig, "latency_sigma", ge=0)
    min_tokens: int = owned(SyntheticConfig, "min_tokens", gt=0)
    kv_cache_sequences: int = owned(SyntheticConfig, "kv_cache_sequences", ge=0)


class VLLMSettings(Section):
    dtype: str = owned(VLLMConfig, "dtype")
    max_model_len: int = owned(VLLMConfig, "max_model_len", gt=0)
    gpu_memory_utilization: float = owned(VLLMConfig, "gpu_memory_utilization", gt=0, le=1)
    tensor_parallel_size: int = owned(VLLMConfig, "tensor_parallel_size", ge=1)
    pipeline_parallel_size: int = owned(VLLMConfig, "pipeline_parallel_size", ge=1)
    enforce_eager: bool = owned(VLLMConfig, "enforce_eager")
    otlp_traces_endpoint: str | None = owned(VLLMConfig, "otlp_traces_endpoint")
    max_num_seqs: int = owned(VLLMConfig, "max_num_seqs", gt=0)
    kv_cache_memory_gib: float | None = owned(VLLMConfig, "kv_cache_memory_gib", gt=0)
    block_size: int | None = owned(VLLMConfig, "block_size", gt=0)
    cpu_threads_bind: str | None = owned(VLLMConfig, "cpu_threads_bind")
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = owned(
        VLLMConfig, "logprobs_mode"
    )
    weight_update_mode: Literal["wait", "abort"] = owned(VLLMConfig, "weight_update_mode")
    log_path: str | None = owned(VLLMConfig, "log_path")
    shutdown_grace_s: float = owned(VLLMConfig, "shutdown_grace_s", gt=0)


class EngineConfig(Section):
    kind: Literal["vllm", "synthetic"] = owned(EngineFactoryConfig, "kind")
    model: str | None = owned(EngineFactoryConfig, "model")
    cache_dir: str = owned(EngineFactoryConfig, "cache_dir")
    max_tokens: int = owned(SamplingParams, "max_tokens", gt=0)
    temperature: float = owned(SamplingParams, "temperature", ge=0)
    top_p: float = owned(SamplingParams, "top_p", gt=0, le=1)
    top_k: int = owned(SamplingParams, "top_k", ge=0)
    min_p: float = owned(SamplingParams, "min_p", ge=0, le=1)
    stop: tuple[str, ...] = owned(SamplingParams, "stop")
    synthetic: SyntheticSettings = SyntheticSettings()
    vllm: VLLMSettings = VLLMSettings()


class LimitsConfig(Section):
    max_in_flight: int | Literal["auto"] = Field(ControllerConfig.max_in_flight)
    """Most groups generating or finishing at once; ``auto``: as many as the engine's KV cache
    holds without preempting, found from its KV-cache usage and preemptions, up to
    ``limits.max_in_flight_ceiling``."""
    max_in_flight_ceiling: int = owned(ConcurrencyConfig, "ceiling", gt=0)
    kv_cache_soft_limit: float = owned(ConcurrencyConfig, "kv_cache_soft_limit", gt=0, le=1)
    staleness_gating: bool = owned(ControllerConfig, "staleness_gating")
    buffer_capacity: int = owned(ControllerConfig, "buffer_capacity", gt=0)
    max_staleness: int = owned(ControllerConfig, "max_staleness", ge=0)
    lease_timeout_s: float = owned(ControllerConfig, "lease_timeout_s", gt=0)
    rewind_window: int = owned(ControllerConfig, "rewind_window", ge=0)
    max_fetch_groups: int = owned(ControllerConfig, "max_fetch_groups", gt=0)
    max_wait_ms: int = owned(ControllerConfig, "max_wait_ms", ge=0)
    max_pending_prompts: int = Field(100_000, gt=0)
    """Most submitted prompts waiting for admission; more get RESOURCE_EXHAUSTED."""
    max_group_size: int = Field(1024, gt=0)
    """Largest ``group_size`` a prompt, a source or the service may ask for."""
    max_pending_bytes: int = Field(256 << 20, gt=0)
    """Most bytes of submitted prompts (text, messages and metadata as JSON) waiting for
    admission; more get RESOURCE_EXHAUSTED."""
    max_metadata_bytes: int = owned(ControllerConfig, "max_metadata_bytes", gt=0)
    max_submit_bytes: int = owned(ControllerConfig, "max_submit_bytes", gt=0)
    max_lease_expiries: int = owned(ControllerConfig, "max_lease_expiries", gt=0)
    max_version_step: int = owned(ControllerConfig, "max_version_step", gt=0)
    max_step_ahead: int = owned(ControllerConfig, "max_step_ahead", gt=0)

    @field_validator("max_in_flight", mode="before")
    @classmethod
    def _positive_or_auto(cls, value: Any) -> Any:
        if value == "auto" or (type(value) is int and value > 0):
            return value
        raise ValueError(f"must be a positive int or auto, got {value!r}")

    @property
    def in_flight_cap(self) -> int:
        """The most groups ever in flight: the fixed limit, or the adaptive one's ceiling."""
        return self.max_in_flight_ceiling if self.max_in_flight == "auto" else self.max_in_flight


class CheckpointConfig(Section):
    dir: str = "./.rolloutd/checkpoints"
    """Snapshot store: a directory or an fsspec URL (s3://bucket/prefix)."""
    interval_s: float = owned(CheckpointerConfig, "interval_s", ge=0)
    keep_latest: int = owned(CheckpointerConfig, "keep_latest", gt=0)
    keep_tagged: int = owned(CheckpointerConfig, "keep_tagged", ge=0)
    max_consecutive_failures: int = owned(CheckpointerConfig, "max_consecutive_failures", gt=0)
    timeout_s: float = owned(CheckpointerConfig, "timeout_s", gt=0)
    compact_segments: int = owned(CheckpointerConfig, "compact_segments", gt=1)
    storage_options: dict[str, Any] = Field(default_factory=dict)
    """Passed to fsspec (e.g. endpoint_url, key, secret for s3)."""
    lock_timeout_s: float = Field(30.0, gt=0)
    """One process writes a store: it renews its claim every third of this, and writes nothing
    once half of it passed without a renewal. A second process takes over a claim older than
    this; the old holder, if it comes back, is fenced (publishes nothing, turns not-ready)."""
    claim_wait_s: float | None = Field(None, ge=0)
    """How long a start waits for another process's younger claim to lapse (a frozen holder),
    saying so every few seconds, before it exits naming the holder; a holder seen renewing
    meanwhile is alive, and the start exits at once. Unset: 1.5 times lock_timeout_s, enough for
    a claim renewed just before its holder froze, on hosts whose clocks differ by up to half the
    timeout."""

    @property
    def claim_wait(self) -> float:
        """``claim_wait_s``, or its default."""
        return 1.5 * self.lock_timeout_s if self.claim_wait_s is None else self.claim_wait_s


class WeightsConfig(Section):
    staging_dir: str = "./.rolloutd/weights"
    """Local directory where weights from a URL or a push are staged and verified before loading;
    it also keeps the weights served and those the latest snapshot records, so a restarted service
    reloads them. Needs room for three copies of the weights (more when several updates come
    between two checkpoints)."""
    storage_options: dict[str, Any] | None = None
    """Passed to fsspec when UpdateWeights names a URL; unset uses checkpoint.storage_options."""
    fetch_concurrency: int = Field(8, gt=0)
    """Ranged reads in flight when copying weights from a URL (also the threads that hash)."""
    store: str | None = None
    """Directory or fsspec URL of the weights store the trainer publishes to (the newest full
    version and the deltas after it, see docs/operations.md): at start-up, after restoring, the
    service catches up to its newest version before admitting work. Unset: no catching up."""
    allowed_urls: tuple[str, ...] = ()
    """Prefixes (a scheme and a bucket or directory: ``s3://bucket/weights/``) that UpdateWeights
    may name as a URL; any other URL is refused before the service connects anywhere. Empty: no
    URLs, only local directories under weights.local_root."""
    local_root: str | None = None
    """Directory under which UpdateWeights may name local weights (symlinks resolved); other
    paths are refused. Unset: any local directory the service can read."""
    transfer_timeout_s: float = Field(1800.0, gt=0)
    """Longest one transfer may take (listing and copying from a URL, or a whole push); past it
    the update fails with DEADLINE_EXCEEDED and its staged files are removed."""
    push_idle_timeout_s: float = Field(60.0, gt=0)
    """Longest a PushWeights stream may go without a message before it is ended."""

    @field_validator("allowed_urls")
    @classmethod
    def _prefixes(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for prefix in value:
            scheme, sep, rest = prefix.partition("://")
            if not sep or not scheme or not rest.strip("/") or "::" in prefix:
                raise ValueError(
                    f"{prefix!r} is not a URL prefix: give a scheme and a bucket or directory "
                    "(s3://bucket/weights/)"
                )
        return value


class RecoveryConfig(Section):
    granularity: Literal["token", "sibling", "group"] = "token"
    """What a restart keeps of unfinished groups: their finished siblings and the tokens the
    snapshot held of the others, which continue from there (token); their finished siblings only
    (sibling); nothing, every sibling is generated again (group). Only token streams generated
    tokens into checkpoints."""


class ScoringSettings(Section):
    verifier: str | None = owned(ScoringConfig, "verifier")
    group_verifier: str | None = owned(ScoringConfig, "group_verifier")
    workers: int = owned(ScoringConfig, "workers", gt=0)
    timeout_s: float = owned(ScoringConfig, "timeout_s", gt=0)
    on_failure: Literal["drop", "deliver"] = "drop"
    """What becomes of a group with a failed score: dropped (reason ``scoring_failed``), or
    delivered with its failed scores (no reward, the reason in ``reward_info_json``)."""
    http_concurrency: int = owned(ScoringConfig, "http_concurrency", gt=0)
    http_retries: int = owned(ScoringConfig, "http_retries", ge=0)
    http_backoff_s: float = owned(ScoringConfig, "http_backoff_s", ge=0)


class FilterSettings(Section):
    zero_variance: bool = owned(FilterConfig, "zero_variance")
    min_reward_std: float = owned(FilterConfig, "min_reward_std", ge=0)
    max_oversample_ratio: float = Field(0.5, ge=0, le=10)
    """With ``zero_variance``: up to ``(1 + ratio) x limits.max_in_flight`` groups generate or
    finish at once (never more than ``limits.buffer_capacity``), so that dropped groups are
    replaced without waiting; however many get dropped, no more are admitted."""


class PipelineConfig(Section):
    sibling_runner: str | None = Field(None, pattern=SPEC.pattern)
    """Entry point ``package.module:attribute`` of a sibling runner: a class (or factory) called
    with no arguments, whose ``async run(job)`` produces one sibling (see
    ``rolloutd.domain.runner``). Unset: one streamed engine request per sibling."""
    finishing_stage: str | None = Field(None, pattern=SPEC.pattern)
    """Entry point ``package.module:attribute`` of a finishing stage: a class (or factory)
    called with no arguments, whose ``async finish(group)`` commits a finished group or drops it
    with a reason (see ``rolloutd.domain.finishing``). Unset: every finished group is
    committed."""


class FleetConfig(Section):
    replica: int = owned(ControllerConfig, "replica", ge=0)
    replicas: int = owned(ControllerConfig, "replicas", gt=0)


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


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{dotted}': '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """``ROLLOUTD_A__B=v`` becomes ``{"a": {"b": yaml(v)}}``."""
    tree: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name.startswith(ENV_PREFIX + "_"):
            continue
        dotted = name[len(ENV_PREFIX) :].lower().replace("__", ".")
        if dotted in _NON_CONFIG_ENV:
            continue
        if "__" not in name and SERVICE_LINK.match(name):
            log.debug("ignoring %s: a Kubernetes service link, not a configuration key", name)
            continue
        _set_dotted(tree, dotted, yaml.safe_load(raw) if raw != "" else None)
    return tree


_NON_CONFIG_ENV = {"fault", "fault.point"}
"""ROLLOUTD_* variables that are not configuration keys (fault injection in tests)."""


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """File, then environment, then ``overrides`` (dotted keys from flags), validated once."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"config file {p}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p}: not valid YAML: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"config file {p}: must be a mapping of keys, not {type(loaded).__name__}"
            )
        tree = loaded
    tree = _merge(tree, env_overrides(os.environ if environ is None else environ))
    for dotted, value in (overrides or {}).items():
        _set_dotted(tree, dotted, value)
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None


def _describe(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(root)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"config key '{key}': {msg}")
    return "; ".join(lines)
