"""What the vLLM engine needs settled before it starts, and what to say when it cannot start.

Kept free of vLLM imports so that it can be tested, and read, without an engine.

- **KV-cache size on CPU.** vLLM's CPU backend otherwise reserves ``gpu_memory_utilization`` (0.9)
  of the whole NUMA node and refuses to start when that much is not free, which fails on any
  machine whose memory is in use (a browser, the page cache an install leaves behind). rolloutd
  instead asks for what its own limits can use: one full-length sequence per sibling that may be
  generating at once. vLLM then skips the fraction check altogether.
- **OpenMP thread binding on a small CPU machine.** vLLM's CPU backend binds its worker's threads
  to all cores but one, which it reserves for everything else. On a machine of two CPUs that is
  the worker's OpenMP threads pinned to one core and rolloutd, vLLM's engine core and the kernel's
  own work sharing the other. There, while the worker generated, the service's fsyncs (snapshots,
  acks, the store claim) were seen to stall for as long as generation lasted (20 to 88 s), and
  starting a process stalled with them; unbound, stalls were a few seconds and snapshots kept
  being published. rolloutd leaves the threads unbound on such machines (``nobind``) unless told
  otherwise.
- **Its output in a file.** vLLM's engine processes write hundreds of lines while they start, and
  a failure arrives as several interleaved tracebacks. They go to a log file; the service prints
  one line with the root cause and the setting to change, and names the file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GIB = 2**30

CPU_KV_CACHE_CAP_GIB = 4.0
"""The most KV cache rolloutd reserves on CPU unasked. A laptop's other programs need memory too;
vLLM queues the sequences that do not fit. ``engine.vllm.kv_cache_memory_gib`` sets any size."""

_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


@dataclass(frozen=True)
class KVCachePlan:
    """The KV cache rolloutd asks vLLM for, and how it was arrived at (for the start-up log)."""

    bytes: int
    bytes_per_token: int
    sequences: int
    tokens_per_sequence: int
    capped: bool

    def describe(self) -> str:
        text = (
            f"KV cache {self.bytes / GIB:.2f} GiB: {self.sequences} sequences of "
            f"{self.tokens_per_sequence} tokens at {self.bytes_per_token} bytes a token"
        )
        if self.capped:
            text += f", capped at {CPU_KV_CACHE_CAP_GIB:g} GiB"
        return text + " (engine.vllm.kv_cache_memory_gib sets it)"


def kv_bytes_per_token(model_config: Mapping[str, Any], dtype: str) -> int:
    """Bytes of keys and values one token occupies across all layers.

    ``model_config`` is a Hugging Face ``config.json``; multimodal models keep the language model's
    shape under ``text_config``. ``dtype`` is the engine's dtype, ``auto`` meaning the model's own.
    """
    cfg = model_config.get("text_config") or model_config
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    layers = int(cfg["num_hidden_layers"])
    if dtype == "auto":
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or model_config.get("dtype", ""))
    return 2 * layers * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 2)


def plan_cpu_kv_cache(
    model_config: Mapping[str, Any], dtype: str, *, sequences: int, max_model_len: int
) -> KVCachePlan:
    """Room for ``sequences`` sequences of ``max_model_len`` tokens, at most the cap, and never
    less than one full-length sequence (vLLM refuses to start with less)."""
    per_token = kv_bytes_per_token(model_config, dtype)
    wanted = sequences * max_model_len * per_token
    floor = max_model_len * per_token
    cap = max(int(CPU_KV_CACHE_CAP_GIB * GIB), floor)
    return KVCachePlan(
        bytes=min(wanted, cap),
        bytes_per_token=per_token,
        sequences=sequences,
        tokens_per_sequence=max_model_len,
        capped=wanted > cap,
    )


THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
SMALL_MACHINE_CPUS = 2
"""On this many usable CPUs or fewer, vLLM's CPU worker threads are left unbound by default."""


def cpu_threads_bind(configured: str | None, environ: Mapping[str, str], cpus: int) -> str | None:
    """The ``VLLM_CPU_OMP_THREADS_BIND`` to start vLLM's CPU backend with; None leaves it as is.

    ``engine.vllm.cpu_threads_bind`` wins, then the variable already in the environment; else
    ``nobind`` on a machine of ``SMALL_MACHINE_CPUS`` usable CPUs or fewer, and vLLM's own
    ``auto`` on a larger one (see the module docstring)."""
    if configured:
        return configured
    if THREADS_BIND_ENV in environ or cpus > SMALL_MACHINE_CPUS:
        return None
    return "nobind"


@contextlib.contextmanager
def output_to(path: Path, *, rotate: bool = True) -> Iterator[None]:
    """Points this process's stdout and stderr at ``path`` while vLLM starts its processes (or
    stops them: ``rotate=False`` appends to the file of the start).

    vLLM's engine processes inherit the two descriptors when they are created and keep writing to
    the file for their whole life; this process gets its own descriptors back on exit. Anything
    this process writes to them meanwhile (vLLM's own start-up lines) lands in the file as well;
    the ``rolloutd`` command's log handler writes to a descriptor of its own. The
    previous file is kept as ``<name>.1``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    if rotate and path.exists():
        path.replace(path.with_name(path.name + ".1"))
    saved = [os.dup(1), os.dup(2)]
    with open(path, "ab", buffering=0) as log:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(OSError, ValueError):
                    stream.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


_EXCEPTION = re.compile(r"(?:^|\] )(?P<type>[A-Za-z_.]*(?:Error|Exception)): (?P<text>.+)$")

_WRAPPERS = (
    "Engine core initialization failed",
    "WorkerProc initialization failed",
    "Worker failed with error",
)
"""vLLM's own wrappers around a root cause raised in another process; never the cause."""

_KV_NOT_FREE = re.compile(
    r"Available memory on node \d+ \((?P<free>[\d.]+)/(?P<total>[\d.]+) GiB\) on kv cache "
    r"allocation is less than requested memory for kv \((?P<kv>[\d.]+)"
)
_KV_TOO_SMALL = re.compile(
    r"max seq len \((?P<len>\d+)\), \((?P<need>[\d.]+) GiB KV cache is needed, which is larger "
    r"than the available KV cache memory \((?P<have>[\d.]+) GiB\)"
)
_HEAD_DIM = re.compile(r"Unsupported CPU attention configuration: head_dim=(?P<dim>\d+)")
_GPU_NOT_FREE = re.compile(
    r"Free memory on device \S+ \((?P<free>[\d.]+)/(?P<total>[\d.]+) GiB\) on startup is less "
    r"than desired GPU memory utilization \((?P<frac>[\d.]+), (?P<want>[\d.]+) GiB\)"
)


def root_cause(log_text: str) -> str | None:
    """The first exception line in vLLM's output that is not one of its wrappers."""
    for line in log_text.splitlines():
        match = _EXCEPTION.search(line.strip())
        if match is None or match["text"].startswith(_WRAPPERS):
            continue
        return f"{match['type']}: {match['text']}"
    return None


def explain_start_failure(log_text: str) -> str:
    """One line: why vLLM did not start, and the setting to change."""
    cause = root_cause(log_text)
    if cause is None:
        return "vLLM's engine exited while starting, without naming a cause"
    if m := _KV_NOT_FREE.search(cause):
        return (
            f"not enough free memory for the KV cache: it needs {m['kv']} GiB and "
            f"{m['free']} of {m['total']} GiB are free; lower engine.vllm.kv_cache_memory_gib "
            "or free memory"
        )
    if m := _KV_TOO_SMALL.search(cause):
        return (
            f"one sequence of {m['len']} tokens needs {m['need']} GiB of KV cache but "
            f"{m['have']} GiB is reserved; raise engine.vllm.kv_cache_memory_gib or lower "
            "engine.vllm.max_model_len"
        )
    if m := _HEAD_DIM.search(cause):
        return (
            f"vLLM's CPU attention does not support the model's head dimension {m['dim']} "
            "(it supports 32, 64, 80, 96, 112, 128, 160, 192, 224, 256 and 512); "
            "choose another model with engine.model (--model)"
        )
    if m := _GPU_NOT_FREE.search(cause):
        return (
            f"not enough free GPU memory: vLLM wants {m['want']} GiB "
            f"(engine.vllm.gpu_memory_utilization {m['frac']}) and {m['free']} of "
            f"{m['total']} GiB are free; lower engine.vllm.gpu_memory_utilization or set "
            "engine.vllm.kv_cache_memory_gib"
        )
    return f"vLLM could not start: {cause}"
