"""What the vLLM engine needs settled before it starts, and what to say when it cannot start.

Kept free of vLLM imports so that it can be tested, and read, without an engine.

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

The KV cache's size is settled in :mod:`rolloutd.engines.vllm_kv_cache`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

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


def export_cpu_threads_bind(configured: str | None) -> str | None:
    """Settles ``VLLM_CPU_OMP_THREADS_BIND`` in this process's environment (see
    :func:`cpu_threads_bind`) and returns what it set, or None when it left it as it was.

    This is the one place rolloutd writes ``os.environ``. vLLM's CPU worker reads its OpenMP
    thread binding only from that environment variable (``vllm.envs``), in the engine processes
    it starts, which inherit this process's environment; no engine argument or config field
    carries it. Call it on CPU only, before vLLM starts its processes.
    """
    bind = cpu_threads_bind(configured, os.environ, _usable_cpus())
    if bind is not None:
        # VLLM_CPU_OMP_THREADS_BIND: how vLLM's CPU worker pins its OpenMP threads; unbound on a
        # small machine so the service's fsyncs are not starved while the worker generates.
        os.environ[THREADS_BIND_ENV] = bind
    return bind


def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


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


def describe_start_failure(exc: BaseException, log_path: str | None) -> str:
    """One line on why the start failed: vLLM's root cause from its log, or the error itself."""
    if log_path is None:
        return f"vLLM could not start: {type(exc).__name__}: {exc}"
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        text = ""
    return f"{explain_start_failure(text)} (vLLM's log: {log_path})"
