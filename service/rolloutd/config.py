"""Configuration: one YAML file, overridden by ``ROLLOUTD_*`` environment variables, then flags.

Every key is declared here, with its default and meaning; this model is the single source of truth
for configuration (``docs/configuration.md`` is generated from it). Errors name the offending key.
Environment variables nest with a double underscore: ``ROLLOUTD_LIMITS__MAX_IN_FLIGHT=32`` sets
``limits.max_in_flight``; values are parsed as YAML scalars.

Kubernetes injects service-link variables for every Service in the namespace, and a Service named
``rolloutd-admin`` yields ``ROLLOUTD_ADMIN_SERVICE_HOST`` and friends. Exactly kubelet's naming
pattern is skipped (logged at debug); every other unknown ``ROLLOUTD_*`` name is still refused, so
a mistyped key never passes silently.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

ENV_PREFIX = "ROLLOUTD_"

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
    tokens_per_s: float = Field(2000.0, ge=0)
    """Generation speed of one synthetic request (0: instant)."""
    latency_s: float = Field(0.0, ge=0)
    """Median extra latency of a synthetic request."""
    latency_sigma: float = Field(0.0, ge=0)
    """Log-normal spread of that latency."""


class VLLMSettings(_Section):
    dtype: str = "auto"
    """Weights dtype passed to vLLM (float32 on CPU for exact greedy parity)."""
    max_model_len: int = Field(2048, gt=0)
    """Longest prompt plus completion the engine accepts."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Fraction of GPU memory vLLM may use. GPU only: on CPU the KV cache is sized explicitly
    (kv_cache_memory_gib), and this fraction is never asked of the machine's memory."""
    tensor_parallel_size: int = Field(1, ge=1)
    """vLLM tensor parallelism inside one pod."""
    pipeline_parallel_size: int = Field(1, ge=1)
    """vLLM pipeline parallelism inside one pod."""
    enforce_eager: bool = False
    """Disable CUDA graphs / compilation (faster start, slower decode)."""
    otlp_traces_endpoint: str | None = None
    """Turns on vLLM's own request tracing, exported to this OTLP endpoint."""
    max_num_seqs: int = Field(256, gt=0)
    """Most sequences vLLM schedules at once."""
    kv_cache_memory_gib: float | None = Field(None, gt=0)
    """KV-cache size in GiB; when set it wins over gpu_memory_utilization. Unset: on GPU vLLM sizes
    it from gpu_memory_utilization; on CPU rolloutd reserves room for every sibling that may
    generate at once (limits.max_in_flight x group_size sequences of max_model_len tokens, at most
    4 GiB). vLLM's own VLLM_CPU_KVCACHE_SPACE variable, if set, overrides both."""
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    """Logprob reported for each sampled token: under the model's own distribution (raw), or
    under the distribution actually sampled from, after temperature and top-p (processed)."""
    weight_update_mode: Literal["wait", "abort"] = "wait"
    """Requests in flight when weights are updated: wait lets them finish on the old weights
    (they carry the old policy version); abort ends them at once with a retryable error."""
    log_path: str | None = "./.rolloutd/logs/vllm.log"
    """File that vLLM's own output (its engine processes' stdout and stderr) goes to; the service
    prints one line naming the cause when vLLM cannot start. Unset (or --log-level debug): vLLM
    writes to the service's own stdout and stderr."""
    shutdown_grace_s: float = Field(10.0, gt=0)
    """If the service dies without stopping the engine, its processes get SIGTERM and, this long
    after, SIGKILL."""


class EngineConfig(_Section):
    kind: Literal["vllm", "synthetic"] = "vllm"
    """Which engine generates: vLLM, or the deterministic synthetic engine."""
    model: str | None = None
    """Local Hugging Face model directory; unset builds the tiny model once into the cache."""
    cache_dir: str = "./.rolloutd/cache"
    """Where the tiny model is built."""
    max_tokens: int = Field(64, gt=0)
    """Longest completion of one sibling, in tokens."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature (0: greedy)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
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
    max_in_flight: int = Field(16, gt=0)
    """Most groups generating at once."""
    buffer_capacity: int = Field(256, gt=0)
    """Most groups generating, ready or leased at once (acked ones are bounded by rewind_window)."""
    max_staleness: int = Field(4, ge=0)
    """Groups more than this many policy versions old are evicted."""
    lease_timeout_s: float = Field(300.0, gt=0)
    """An unacknowledged lease expires after this long and its groups become available again."""
    rewind_window: int = Field(8, ge=0)
    """Acked groups wait at most this many trainer steps for Checkpoint before finalizing."""
    max_fetch_groups: int = Field(1024, gt=0)
    """Largest max_groups a FetchGroups request may ask for."""
    max_wait_ms: int = Field(600_000, ge=0)
    """Longest wait_ms a FetchGroups request may ask for."""
    max_pending_prompts: int = Field(100_000, gt=0)
    """Most submitted prompts waiting for admission; more get RESOURCE_EXHAUSTED."""


class CheckpointConfig(_Section):
    dir: str = "./.rolloutd/checkpoints"
    """Snapshot store: a directory or an fsspec URL (s3://bucket/prefix)."""
    interval_s: float = Field(60.0, ge=0)
    """Periodic checkpoint interval in seconds; 0 disables periodic checkpoints."""
    keep_latest: int = Field(3, gt=0)
    """Newest snapshots kept, tagged or not."""
    keep_tagged: int = Field(10, ge=0)
    """Newest tagged snapshots kept besides keep_latest, whatever their trainer step: rollback
    points for --restore TAG (0: tags protect nothing). Snapshots whose trainer step a Rewind
    may still need (within limits.rewind_window) are kept as well; all others are retired."""
    max_consecutive_failures: int = Field(3, gt=0)
    """Failed attempts in a row after which the service reports not-ready."""
    timeout_s: float = Field(120.0, gt=0)
    """An attempt that takes longer fails with reason timeout."""
    compact_segments: int = Field(8, gt=1)
    """Compact once a snapshot references more than this many segments."""
    storage_options: dict[str, Any] = Field(default_factory=dict)
    """Passed to fsspec (e.g. endpoint_url, key, secret for s3)."""


class RecoveryConfig(_Section):
    granularity: Literal["sibling", "group"] = "sibling"
    """Reuse staged siblings of unfinished groups (sibling) or re-run whole groups (group)."""


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


class AuthConfig(_Section):
    token: str | None = None
    """Bearer token required on mutating RPCs; unset: no authentication."""


class Config(_Section):
    engine: EngineConfig = EngineConfig()
    dataset: DatasetConfig = DatasetConfig()
    group_size: int = Field(4, gt=0, le=1024)
    """Siblings per prompt (N in GRPO)."""
    limits: LimitsConfig = LimitsConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    recovery: RecoveryConfig = RecoveryConfig()
    restore: str = "latest"
    """Snapshot to restore at start: latest, none, a sequence number or a tag."""
    grpc: GrpcConfig = GrpcConfig()
    http: HttpConfig = HttpConfig()
    auth: AuthConfig = AuthConfig()

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
        return self

    def semantic_fingerprint(self, dataset_digest: str, model_id: str) -> dict[str, Any]:
        """Keys whose change makes a snapshot's groups mean something else. The dataset is
        identified by its content, so the same file mounted elsewhere still restores."""
        return {
            "engine.model": model_id,
            "group_size": self.group_size,
            "dataset": dataset_digest,
            "dataset.seed": self.dataset.seed,
            "dataset.shuffle": self.dataset.shuffle,
        }


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
