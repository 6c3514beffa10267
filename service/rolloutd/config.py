"""Configuration: one YAML file, overridden by ``ROLLOUTD_*`` environment variables, then flags.

Every key is declared here; a key that configures a component (the controller, the checkpointer,
sampling) takes its default and meaning from that component's own frozen config, which this module
composes (:meth:`Config.controller`, :meth:`Config.checkpointer`) instead of restating it. This
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
    tokens_per_s: float = Field(2000.0, ge=0)
    """Generation speed of one synthetic request (0: instant)."""
    latency_s: float = Field(0.0, ge=0)
    """Median extra latency of a synthetic request."""
    latency_sigma: float = Field(0.0, ge=0)
    """Log-normal spread of that latency (0: constant)."""
    min_tokens: int = Field(8, gt=0)
    """Shortest synthetic completion; lengths are uniform in [min_tokens, engine.max_tokens]."""


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
    cpu_threads_bind: str | None = None
    """CPU only: how vLLM binds its worker's OpenMP threads (its VLLM_CPU_OMP_THREADS_BIND:
    auto, nobind, or CPU lists such as 0-3). Unset: that variable if the environment sets it;
    else nobind on a machine of 2 usable CPUs or fewer, where binding left the service's fsyncs
    stalled while the worker generated, and vLLM's auto on larger ones."""
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
    """One process writes a store: it renews its claim every third of this. A second process
    refuses to start on the store while the claim is younger than this, and takes over an older
    one; the old holder, if it comes back, is fenced (publishes nothing, turns not-ready)."""


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


class RecoveryConfig(_Section):
    granularity: Literal["token", "sibling", "group"] = "token"
    """What a restart keeps of unfinished groups: their finished siblings and the tokens the
    snapshot held of the others, which continue from there (token); their finished siblings only
    (sibling); nothing, every sibling is generated again (group). Only token streams generated
    tokens into checkpoints."""


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
    """Dashboard points kept (in memory and next to local checkpoints): 2 h at 5 s."""


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
        if self.fleet.replica >= self.fleet.replicas:
            raise ValueError(
                f"fleet.replica must be below fleet.replicas ({self.fleet.replica} >= "
                f"{self.fleet.replicas}); replicas are numbered from 0"
            )
        return self

    def controller(self) -> ControllerConfig:
        """The controller's config: its keys from ``limits``, ``group_size``, ``dataset.seed``
        and the sampling keys of ``engine``."""
        return _compose(
            ControllerConfig,
            self.limits,
            group_size=self.group_size,
            seed=self.dataset.seed,
            sampling=_compose(SamplingParams, self.engine),
            replica=self.fleet.replica,
            replicas=self.fleet.replicas,
            capture_partials=self.recovery.granularity == "token",
        )

    def checkpointer(self) -> CheckpointerConfig:
        return _compose(CheckpointerConfig, self.checkpoint)

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
    """``component``'s frozen config from the keys of ``section`` that it declares, and ``rest``."""
    names = {f.name for f in dataclasses.fields(component)}  # type: ignore[arg-type]
    given = {k: getattr(section, k) for k in type(section).model_fields if k in names}
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
