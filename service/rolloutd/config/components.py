"""The sections that configure one component each: the engine (``engine``, with its synthetic and
vLLM settings), the controller's ``limits``, the checkpointer (``checkpoint``), ``weights``,
``recovery``, ``scoring`` and its ``filter``, the ``pipeline``'s entry points and the ``fleet``.

Most keys are :func:`~rolloutd.config.section.owned`: the component's frozen config declares
their defaults and meanings. :class:`~rolloutd.config.model.Config` holds these sections and
makes the checks across them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from rolloutd.checkpoint.checkpointer import CheckpointerConfig
from rolloutd.config.section import Section, owned
from rolloutd.domain.concurrency import ConcurrencyConfig
from rolloutd.domain.controller import ControllerConfig
from rolloutd.domain.engine import SamplingParams
from rolloutd.engines.factory import EngineFactoryConfig
from rolloutd.engines.synthetic import SyntheticConfig
from rolloutd.engines.vllm_config import VLLMConfig
from rolloutd.entrypoints import SPEC
from rolloutd.scoring import FilterConfig, ScoringConfig


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
