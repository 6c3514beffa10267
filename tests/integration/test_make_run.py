"""The README's first command as a newcomer runs it: ``rolloutd serve`` on embedded defaults, on a
machine whose memory is in use, with no tuning variable in the environment; and a configuration
that cannot start, which must say why in one line and leave nothing running."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from rolloutd.client import RolloutClient
from tests.integration.proc import ServeProcess, foreign_lines

pytestmark = [pytest.mark.process]

GIB = 2**30
_MARK = "RDTEST_MARK"
"""Every process a test starts inherits this variable, so that any left running can be found."""


def newcomer_env(mark: str) -> dict[str, str]:
    """The environment of a shell on a fresh machine: none of the suite's tuning variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VLLM_", "ROLLOUTD_", "OTEL_", "PYTEST_"))
    }
    env[_MARK] = mark
    env["PYTHONUNBUFFERED"] = "1"
    return env


def processes_marked(mark: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(_MARK) == mark:
                found.append(proc)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def wait_none_marked(mark: str, timeout_s: float = 30.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while (left := processes_marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.fixture
def memory_in_use() -> Iterator[int]:
    """Another process holds several GiB, so that less than 90% of the machine's memory is free:
    vLLM's CPU default (reserve gpu_memory_utilization=0.9 of the node) cannot start then."""
    vm = psutil.virtual_memory()
    hold = max(3 * GIB, int(vm.available - 0.85 * vm.total))
    hog = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "b = bytearray(int(sys.argv[1]))\n"
            "for i in range(0, len(b), 4096): b[i] = 1\n"
            "print('held', flush=True)\n"
            "time.sleep(3600)\n",
            str(hold),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == "held"
        assert psutil.virtual_memory().available < 0.9 * psutil.virtual_memory().total
        yield hold
    finally:
        hog.kill()
        hog.wait(30)


@pytest.mark.vllm
def test_make_run_serves_the_tiny_model_on_a_busy_machine(tmp_path: Path, memory_in_use: int):
    mark = uuid.uuid4().hex
    # `make run` is `.venv/bin/rolloutd serve` in the checkout; only the ports differ here, so that
    # the test does not collide with a service already running on the machine.
    env = newcomer_env(mark)
    service = ServeProcess(
        ["--grpc-port", "0", "--http-port", "0"],
        env=env,
        inherit_env=False,
        cwd=tmp_path,
        log_path=tmp_path / "serve.log",
    )
    try:
        target = service.wait_listening(timeout=300)
        with RolloutClient([target]) as client:
            lease = client.fetch(1, wait_ms=120_000, consumer="newcomer")
            assert lease is not None, service.output
            (group,) = lease.groups
            assert len(group.samples) == 4
            assert all(len(s.token_ids) == len(s.logprobs) > 0 for s in group.samples)
            client.ack(lease, trainer_step=1)
        trainer = subprocess.run(
            [
                str(ServeProcess.python_bin("rolloutd")),
                "trainer",
                "--target",
                target,
                "--steps",
                "2",
                "--groups-per-step",
                "2",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert trainer.returncode == 0, trainer.stderr
        assert "step" in trainer.stdout and "done: 2 steps" in trainer.stdout
        assert "KV cache 0.50 GiB" in service.output
        assert (tmp_path / ".rolloutd" / "logs" / "vllm.log").stat().st_size > 0
        assert "Traceback" not in service.output
    finally:
        service.terminate(timeout=120)
    assert wait_none_marked(mark) == []
    # vLLM's and Triton's own output (start, shutdown, nanobind's leak reports at exit) stays
    # out of the terminal: only rolloutd's lines at the default log level
    assert foreign_lines(service.output) == [], service.output
    assert "ready: gRPC 127.0.0.1:" in service.output  # loopback unless told otherwise


def run_unstartable(
    tmp_path: Path, *flags: str, env: dict[str, str]
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            str(ServeProcess.python_bin("rolloutd")),
            "serve",
            "--grpc-port",
            "0",
            "--http-port",
            "0",
            *flags,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *must_say: str) -> None:
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("rolloutd: "), result.stderr
    for part in must_say:
        assert part in last, last


def test_a_missing_model_directory_is_one_line_naming_the_key(tmp_path: Path):
    mark = uuid.uuid4().hex
    result = run_unstartable(
        tmp_path, "--model", str(tmp_path / "no-such-model"), env=newcomer_env(mark)
    )
    assert_one_line_error(result, "engine.model", "no-such-model", "does not exist")
    assert wait_none_marked(mark) == []


@pytest.mark.vllm
def test_a_kv_cache_that_does_not_fit_is_one_line_and_leaves_no_engine_process(
    tmp_path: Path, tiny_model: Path
):
    # the session's tiny model where the default cache looks for it: the start fails at vLLM's
    # KV cache, not after a build of the model
    cache = tmp_path / ".rolloutd" / "cache"
    cache.mkdir(parents=True)
    (cache / tiny_model.name).symlink_to(tiny_model)
    mark = uuid.uuid4().hex
    env = newcomer_env(mark)
    too_big = 4 * psutil.virtual_memory().total / GIB
    env["ROLLOUTD_ENGINE__VLLM__KV_CACHE_MEMORY_GIB"] = f"{too_big:.0f}"
    env["ROLLOUTD_ENGINE__VLLM__ENFORCE_EAGER"] = "true"  # the compiled start is test_make_run's
    result = run_unstartable(tmp_path, env=env)
    assert_one_line_error(result, "engine.vllm.kv_cache_memory_gib", "vllm.log")
    log = (tmp_path / ".rolloutd" / "logs" / "vllm.log").read_text()
    assert "Traceback" in log  # the detail is kept, in vLLM's log
    assert wait_none_marked(mark) == []


def test_a_trainer_without_a_service_says_so_and_stops(tmp_path: Path):
    """The second shell of the quick start, when the first one's service exited."""
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = subprocess.run(
        [
            str(ServeProcess.python_bin("rolloutd")),
            "trainer",
            "--target",
            f"127.0.0.1:{port}",
            "--unreachable-timeout-s",
            "6",
        ],
        env=newcomer_env(uuid.uuid4().hex),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "is `rolloutd serve` running?" in result.stdout
    assert result.stdout.count("waiting for the service") <= 3
    (last,) = result.stderr.strip().splitlines()
    assert f"127.0.0.1:{port} has not answered" in last and "log" in last
