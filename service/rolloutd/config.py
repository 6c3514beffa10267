"""Configuration: one YAML file, overridden by ``ROLLOUTD_*`` environment variables, then flags.

Every key is declared here; a key that configures a component (the controller, the checkpointer,
sampling, the engines) takes its default and meaning from that component's own frozen config,
which this module composes (:meth:`Config.controller`, :meth:`Config.checkpointer`,
:meth:`Config.engine_factory`) instead of restating it. This
model is the single source of truth for configuration keys (``docs/configuration.md`` is
generated from it). Errors name the offending key.
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
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rolloutd.checkpoint.checkpointer import CheckpointerConfig
from rolloutd.domain.controller import ControllerConfig
from rolloutd.domain.engine import SamplingParams
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


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class SyntheticSettings(_Section):
    tokens_per_s: float = owned(SyntheticConfig, "tokens_per_s", ge=0)
    latency_s: float = owned(SyntheticConfig, "latency_s", ge=0)
    latency_sigma: float = owned(SyntheticConfig, "latency_sigma", ge=0)
    min_tokens: int = owned(SyntheticConfig, "min_tokens", gt=0)


class VLLMSettings(_Section):
    dtype: str = owned(VLLMConfig, "dtype")
    max_model_len: int = owned(VLLMConfig, "max_model_len", gt=0)
    gpu_memory_utilization: float = owned(VLLMConfig, "gpu_memory_utilization", gt=0, le=1)
    tensor_parallel_size: int = owned(VLLMConfig, "tensor_parallel_size", ge=1)
    pipeline_parallel_size: int = owned(VLLMConfig, "pipeline_parallel_size", ge=1)
    enforce_eager: bool = owned(VLLMConfig, "enforce_eager")
    otlp_traces_endpoint: str | None = owned(VLLMConfig, "otlp_traces_endpoint")
    max_num_seqs: int = owned(VLLMConfig, "max_num_seqs", gt=0)
    kv_cache_memory_gib: float | None = owned(VLLMConfig, "kv_cache_memory_gib", gt=0)
    cpu_threads_bind: str | None = owned(VLLMConfig, "cpu_threads_bind")
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = owned(
        VLLMConfig, "logprobs_mode"
    )
    weight_update_mode: Literal["wait", "abort"] = owned(VLLMConfig, "weight_update_mode")
    log_path: str | None = owned(VLLMConfig, "log_path")
    shutdown_grace_s: float = owned(VLLMConfig, "shutdown_grace_s", gt=0)


class EngineConfig(_Section):
    kind: Literal["vllm", "synthetic"] = owned(EngineFactoryConfig, "kind")
    model: str | None = owned(EngineFactoryConfig, "model")
    cache_dir: str = owned(EngineFactoryConfig, "cache_dir")
    max_tokens: int = owned(SamplingParams, "max_tokens", gt=0)
    temperature: float = owned(SamplingParams, "temperature", ge=0)
    top_p: float = owned(SamplingParams, "top_p", gt=0, le=1)
    stop: tuple[str, ...] = owned(SamplingParams, "stop")
    synthetic: SyntheticSettings = SyntheticSettings()
    vllm: VLLMSettings = VLLMSettings()


class DatasetConfig(_Section):
    path: str | None = None
    """JSONL or Parquet prompt file; unset uses the bundled arithmetic prompt set."""
    seed: int = 0
    """Seed of the per-epoch permutation and of the siblings' seeds."""
    shuffle: bool = True
    """Permute the prompts anew in every epoch."""
    epochs: int | None = Field(None, gt=0)
    """Stop admitting after this many passes; unset: unbounded."""


class LimitsConfig(_Section):
    max_in_flight: int = owned(ControllerConfig, "max_in_flight", gt=0)
    buffer_capacity: int = owned(ControllerConfig, "buffer_capacity", gt=0)
    max_staleness: int = owned(ControllerConfig, "max_staleness", ge=0)
    lease_timeout_s: float = owned(ControllerConfig, "lease_timeout_s", gt=0)
    rewind_window: int = owned(ControllerConfig, "rewind_window", ge=0)
    max_fetch_groups: int = owned(ControllerConfig, "max_fetch_groups", gt=0)
    max_wait_ms: int = owned(ControllerConfig, "max_wait_ms", ge=0)
    max_pending_prompts: int = Field(100_000, gt=0)
    """Most submitted prompts waiting for admission; more get RESOURCE_EXHAUSTED."""


class CheckpointConfig(_Section):
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


class WeightsConfig(_Section):
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


class RecoveryConfig(_Section):
    granularity: Literal["token", "sibling", "group"] = "token"
    """What a restart keeps of unfinished groups: their finished siblings and the tokens the
    snapshot held of the others, which continue from there (token); their finished siblings only
    (sibling); nothing, every sibling is generated again (group). Only token streams generated
    tokens into checkpoints."""


class ScoringSettings(_Section):
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


class FilterSettings(_Section):
    zero_variance: bool = owned(FilterConfig, "zero_variance")
    min_reward_std: float = owned(FilterConfig, "min_reward_std", ge=0)
    max_oversample_ratio: float = Field(0.5, ge=0, le=10)
    """With ``zero_variance``: up to ``(1 + ratio) x limits.max_in_flight`` groups generate or
    finish at once (never more than ``limits.buffer_capacity``), so that dropped groups are
    replaced without waiting; however many get dropped, no more are admitted."""


class PipelineConfig(_Section):
    sibling_runner: str | None = Field(None, pattern=SPEC.pattern)
    """Entry point ``package.module:attribute`` of a sibling runner: a class (or factory) called
    with no arguments, whose ``async run(job)`` produces one sibling (see
    ``rolloutd.domain.runner``). Unset: one streamed engine request per sibling."""
    finishing_stage: str | None = Field(None, pattern=SPEC.pattern)
    """Entry point ``package.module:attribute`` of a finishing stage: a class (or factory)
    called with no arguments, whose ``async finish(group)`` commits a finished group or drops it
    with a reason (see ``rolloutd.domain.finishing``). Unset: every finished group is
    committed."""


class GrpcConfig(_Section):
    host: str = "0.0.0.0"
    """Address the gRPC server binds."""
    port: int = Field(50051, ge=0, le=65535)
    """gRPC port; 0 picks a free one."""
    grace_s: float = Field(10.0, ge=0)
    """On shutdown, RPCs in progress get this long to finish."""
    max_message_mb: int = Field(64, gt=0)
    """Largest gRPC message, in MiB."""
    tls_cert: str | None = None
    """PEM certificate chain; with tls_key, serves TLS."""
    tls_key: str | None = None
    """PEM private key."""
    tls_client_ca: str | None = None
    """PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS).
    Needs tls_cert and tls_key."""


class HttpConfig(_Section):
    enabled: bool = True
    """Serve the admin HTTP app (health, readiness, /metrics, status)."""
    host: str = "0.0.0.0"
    """Address the admin app binds."""
    port: int = Field(8080, ge=0, le=65535)
    """Admin port; 0 picks a free one."""
    dashboard_interval_s: float = Field(5.0, gt=0)
    """How often the dashboard on the admin port's front page samples the metrics."""
    dashboard_points: int = Field(1440, gt=0)
    """Dashboard points kept (in memory and next to the checkpoints): 2 h at 5 s."""


class FleetConfig(_Section):
    replica: int = owned(ControllerConfig, "replica", ge=0)
    replicas: int = owned(ControllerConfig, "replicas", gt=0)


class AuthConfig(_Section):
    token: str | None = None
    """Bearer token required on mutating RPCs; unset: no authentication."""


class Config(_Section):
    engine: EngineConfig = EngineConfig()
    dataset: DatasetConfig = DatasetConfig()
    group_size: int = owned(ControllerConfig, "group_size", gt=0, le=1024)
    limits: LimitsConfig = LimitsConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    recovery: RecoveryConfig = RecoveryConfig()
    pipeline: PipelineConfig = PipelineConfig()
    scoring: ScoringSettings = ScoringSettings()
    filter: FilterSettings = FilterSettings()
    weights: WeightsConfig = WeightsConfig()
    restore: str = "latest"
    """Snapshot to restore at start: latest, none, a sequence number or a tag."""
    grpc: GrpcConfig = GrpcConfig()
    http: HttpConfig = HttpConfig()
    auth: AuthConfig = AuthConfig()
    fleet: FleetConfig = FleetConfig()

    @field_validator("restore", mode="before")
    @classmethod
    def _restore_as_text(cls, value: Any) -> Any:
        # YAML and environment values parse `42` as a number; a sequence number is meant.
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        if self.limits.max_in_flight > self.limits.buffer_capacity:
            raise ValueError(
                "limits.max_in_flight must not exceed limits.buffer_capacity "
                f"({self.limits.max_in_flight} > {self.limits.buffer_capacity})"
            )
        if (self.grpc.tls_cert is None) != (self.grpc.tls_key is None):
            raise ValueError("grpc.tls_cert and grpc.tls_key must be set together")
        if self.grpc.tls_client_ca is not None and self.grpc.tls_cert is None:
            raise ValueError("grpc.tls_client_ca needs grpc.tls_cert and grpc.tls_key")
        self.scoring_config()  # its cross-field checks name their keys
        self.filter_config()
        if self.filter.zero_variance and not (self.scoring.verifier or self.scoring.group_verifier):
            raise ValueError(
                "filter.zero_variance needs rewards: set scoring.verifier or scoring.group_verifier"
            )
        if self.pipeline.finishing_stage and (self.scoring.verifier or self.scoring.group_verifier):
            raise ValueError(
                "pipeline.finishing_stage replaces the scoring stage: unset it or scoring.verifier"
            )
        if self.fleet.replica >= self.fleet.replicas:
            raise ValueError(
                f"fleet.replica must be below fleet.replicas ({self.fleet.replica} >= "
                f"{self.fleet.replicas}); replicas are numbered from 0"
            )
        return self

    def controller(self) -> ControllerConfig:
        """The controller's config: its keys from ``limits``, ``group_size``, ``dataset.seed``
        and the sampling keys of ``engine``."""
        in_flight = self.limits.max_in_flight
        if self.filter.zero_variance:
            in_flight = min(
                int(in_flight * (1 + self.filter.max_oversample_ratio)), self.limits.buffer_capacity
            )
        return _compose(
            ControllerConfig,
            self.limits,
            max_in_flight=in_flight,
            group_size=self.group_size,
            seed=self.dataset.seed,
            sampling=_compose(SamplingParams, self.engine),
            replica=self.fleet.replica,
            replicas=self.fleet.replicas,
            capture_partials=self.recovery.granularity == "token",
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

    def semantic_fingerprint(self, dataset_digest: str, model_id: str) -> dict[str, Any]:
        """Keys whose change makes a snapshot's groups mean something else. The dataset is
        identified by its content, so the same file mounted elsewhere still restores."""
        return {
            "engine.model": model_id,
            "group_size": self.group_size,
            "dataset": dataset_digest,
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
