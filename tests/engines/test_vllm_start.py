"""Thread binding on CPU, and the one line that explains a failed vLLM start (no engine needed)."""

from __future__ import annotations

import os

import pytest

from rolloutd.engines.vllm_start import (
    THREADS_BIND_ENV,
    cpu_threads_bind,
    explain_start_failure,
    output_to,
    root_cause,
)

# Lines as vLLM 0.32 wrote them on this machine's CPU, trimmed to the lines that matter.
NOT_FREE = """\
(EngineCore pid=5506) INFO 11-30 18:32:39 [core.py:133] Initializing a V1 LLM engine (v0.32.0)
(VllmWorker-0 pid=5518) ERROR 11-30 18:32:46 [multiproc_executor.py:953] WorkerProc failed to start.
(VllmWorker-0 pid=5518) ERROR 11-30 18:32:46 [multiproc_executor.py:953]     raise ValueError(
(VllmWorker-0 pid=5518) ERROR 11-30 18:32:46 [multiproc_executor.py:953] ValueError: Available \
memory on node 0 (10.12/18.71 GiB) on kv cache allocation is less than requested memory for kv \
(200.0 GiB). Decrease --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used \
by other processes.
Exception: WorkerProc initialization failed due to an exception in a background process.
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""

HEAD_DIM = """\
(Worker pid=6813) ERROR 11-30 18:35:11 [multiproc_executor.py:1063] RuntimeError: Unsupported CPU \
attention configuration: head_dim=16 isa=2 kv_cache_idx=0
(EngineCore pid=6720) ERROR 11-30 18:35:11 [core.py:1512] RuntimeError: Worker failed with error \
'Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0', please check the \
stack trace above for the root cause
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""

TOO_SMALL = """\
(EngineCore pid=1) ERROR 11-30 18:35:11 [core.py:1] ValueError: To serve at least one request \
with the model's max seq len (2048), (0.50 GiB KV cache is needed, which is larger than the \
available KV cache memory (0.25 GiB). Based on the available memory, the estimated maximum model \
length is 1024. Try increasing `gpu_memory_utilization` or decreasing `max_model_len`.
"""


def test_root_cause_skips_vllms_wrappers():
    assert root_cause(NOT_FREE).startswith("ValueError: Available memory on node 0")
    assert root_cause(HEAD_DIM) == (
        "RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0"
    )
    assert root_cause("INFO all fine\n") is None


@pytest.mark.parametrize(
    ("log", "must_say"),
    [
        (NOT_FREE, ["200.0 GiB", "10.12 of 18.71 GiB", "engine.vllm.kv_cache_memory_gib"]),
        (HEAD_DIM, ["head dimension 16", "engine.model"]),
        (
            TOO_SMALL,
            ["2048 tokens", "engine.vllm.kv_cache_memory_gib", "engine.vllm.max_model_len"],
        ),
        ("ValueError: something new\n", ["vLLM could not start: ValueError: something new"]),
        ("", ["without naming a cause"]),
    ],
)
def test_failures_are_explained_in_one_line_that_names_the_setting(log, must_say):
    text = explain_start_failure(log)
    assert "\n" not in text
    for part in must_say:
        assert part in text


def test_output_goes_to_the_file_and_comes_back(tmp_path, capfd):
    path = tmp_path / "logs" / "vllm.log"
    path.parent.mkdir()
    path.write_text("previous start\n")
    with output_to(path):
        os.write(1, b"to stdout\n")
        os.write(2, b"to stderr\n")
    os.write(2, b"back on the terminal\n")
    assert path.read_text() == "to stdout\nto stderr\n"
    assert (tmp_path / "logs" / "vllm.log.1").read_text() == "previous start\n"
    assert "back on the terminal" in capfd.readouterr().err


def test_cpu_threads_are_unbound_on_two_cpus_unless_told_otherwise():
    assert cpu_threads_bind(None, {}, cpus=2) == "nobind"
    assert cpu_threads_bind(None, {}, cpus=1) == "nobind"
    assert cpu_threads_bind(None, {}, cpus=3) is None  # vLLM's own auto binding
    assert cpu_threads_bind(None, {THREADS_BIND_ENV: "0"}, cpus=2) is None  # the environment's
    assert cpu_threads_bind("0-1", {THREADS_BIND_ENV: "0"}, cpus=2) == "0-1"
    assert cpu_threads_bind("auto", {}, cpus=2) == "auto"
