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

import psutil
import pytest

SERVICE = textwrap.dedent(
    """
    import subprocess, sys, time
    mode = sys.argv[1]
    reaper = subprocess.Popen(
        [sys.executable, "-m", "rolloutd.engines.reaper", str(__import__("os").getpid()),
         "--grace=1"],
        stdin=subprocess.PIPE, start_new_session=True)
    # The engine ignores SIGTERM when asked to, so only SIGKILL ends it; its child does not.
    engine = subprocess.Popen([sys.executable, "-c", '''
    import signal, subprocess, sys, time
    if sys.argv[1] == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    time.sleep(600)
    ''', mode])
    time.sleep(0.5)
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


def _start(mode: str) -> tuple[subprocess.Popen[bytes], list[psutil.Process]]:
    service = subprocess.Popen([sys.executable, "-c", SERVICE, mode], stdout=subprocess.PIPE)
    assert service.stdout is not None
    reaper_pid, engine_pid = map(int, service.stdout.readline().split())
    time.sleep(0.5)  # the reaper has polled the engine's tree at least once
    engine = psutil.Process(engine_pid)
    procs = [engine, *engine.children(recursive=True)]
    assert len(procs) == 2
    if mode != "clean":
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
def test_parent_sigkill_ends_the_watched_tree_and_the_reaper(mode: str) -> None:
    service, procs = _start(mode)
    try:
        os.kill(service.pid, signal.SIGKILL)
        service.wait()
        assert _running(procs, timeout_s=10) == []
    finally:
        _kill_all(procs)


def test_exit_command_leaves_the_engine_alone() -> None:
    service, procs = _start("clean")
    try:
        os.kill(service.pid, signal.SIGKILL)
        service.wait()
        time.sleep(1.0)
        assert sorted(_running(procs, timeout_s=0)) == sorted(p.pid for p in procs)
    finally:
        _kill_all(procs)
