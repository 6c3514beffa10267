"""The vLLM engine's settings, kept free of vLLM imports so that configuration can be read,
validated and documented without loading an engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class VLLMConfig:
    """The vLLM engine's settings; ``rolloutd.config`` exposes them as ``engine.vllm.*`` keys with
    these defaults and meanings."""

    dtype: str = "auto"
    """Weights dtype passed to vLLM (float32 on CPU for exact greedy parity)."""
    max_model_len: int = 2048
    """Longest prompt plus completion the engine accepts."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory vLLM may use. GPU only: on CPU the KV cache is sized explicitly
    (kv_cache_memory_gib), and this fraction is never asked of the machine's memory."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallelism inside one pod."""
    pipeline_parallel_size: int = 1
    """vLLM pipeline parallelism inside one pod."""
    enforce_eager: bool = False
    """Disable CUDA graphs / compilation (faster start, slower decode)."""
    otlp_traces_endpoint: str | None = None
    """Turns on vLLM's own request tracing, exported to this OTLP endpoint."""
    max_num_seqs: int = 256
    """Most sequences vLLM schedules at once."""
    kv_cache_memory_gib: float | None = None
    """KV-cache size in GiB; when set it wins over gpu_memory_utilization. Unset: on GPU vLLM sizes
    it from gpu_memory_utilization; on CPU rolloutd reserves room for every sibling that may
    generate at once (limits.max_in_flight, or limits.max_in_flight_ceiling with auto, x
    group_size sequences of max_model_len tokens, at most 4 GiB). vLLM's own
    VLLM_CPU_KVCACHE_SPACE variable, if set, overrides both."""
    block_size: int | None = None
    """Tokens per KV-cache block; unset: vLLM's own (128 on CPU, 16 on GPU). A sequence takes
    blocks as it grows, and vLLM preempts a running one when none is free."""
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
    shutdown_grace_s: float = 10.0
    """If the service dies without stopping the engine, its processes get SIGTERM and, this long
    after, SIGKILL."""
