"""The reaper ends watched processes when its parent is SIGKILLed, and only then.

A stand-in "service" process starts the reaper and a stand-in "engine" (with a child of its own),
exactly as the vLLM engine does, so these run in seconds without vLLM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tests.waiting import until

SERVICE = textwrap.dedent(
    """
    import subprocess, sys, time
    mode, log = sys.argv[1], open(sys.argv[2], "w")
    reaper = subprocess.Popen(
        [sys.executable, "-m", "rolloutd.engines.reaper", str(__import__("os").getpid()),
         "--grace=1", "--log-level=DEBUG"],
        stdin=subprocess.PIPE, stderr=log, start_new_session=True)
    # The engine ignores SIGTERM when asked to, so only SIGKILL ends it; its child does not.
    engine = subprocess.Popen([sys.executable, "-c", '''
    import signal, subprocess, sys, time
    if sys.argv[1] == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    time.sleep(600)
    ''', mode])
    reaper.stdin.write(f"watch {engine.pid}\\n".encode())
    reaper.stdin.flush()
    if mode == "clean":
        reaper.stdin.write(b"exit\\n")
        reaper.stdin.flush()
        reaper.wait()
    print(reaper.pid, engine.pid, flush=True)
    time.sleep(600)
    """
)


def _start(mode: str, tmp_path: Path) -> tuple[subprocess.Popen[bytes], list[psutil.Process]]:
    log = tmp_path / "reaper.log"
    service = subprocess.Popen(
        [sys.executable, "-c", SERVICE, mode, str(log)], stdout=subprocess.PIPE
    )
    assert service.stdout is not None
    reaper_pid, engine_pid = map(int, service.stdout.readline().split())
    engine = psutil.Process(engine_pid)
    until("the engine started its child", lambda: engine.children(recursive=True))
    procs = [engine, *engine.children(recursive=True)]
    assert len(procs) == 2
    if mode != "clean":
        # the reaper has found the whole tree (the child may appear after the watch command)
        until("the reaper watches both", lambda: "watching 2 processes" in log.read_text())
        procs.append(psutil.Process(reaper_pid))
    return service, procs


def _running(procs: list[psutil.Process], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p.pid)
            except psutil.NoSuchProcess:
                continue
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _kill_all(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            continue


@pytest.mark.parametrize("mode", ["polite", "stubborn"])
def test_parent_sigkill_ends_the_watched_tree_and_the_reaper(mode: str, tmp_path: Path) -> None:
    service, procs = _start(mode, tmp_path)
    try:
        os.kill(service.pid, signal.SIGKILL)
        service.wait()
        assert _running(procs, timeout_s=10) == []
    finally:
        _kill_all(procs)


def test_exit_command_leaves_the_engine_alone(tmp_path: Path) -> None:
    """The stand-in service waited for the reaper to exit before it printed the pids, so no wait
    is needed to know that the reaper will end nothing."""
    service, procs = _start("clean", tmp_path)
    try:
        os.kill(service.pid, signal.SIGKILL)
        service.wait()
        assert sorted(_running(procs, timeout_s=0)) == sorted(p.pid for p in procs)
    finally:
        _kill_all(procs)
