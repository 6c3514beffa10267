"""The service's end of :mod:`rolloutd.engines.reaper`, the watchdog that ends vLLM's engine
processes when the service is killed with SIGKILL (vLLM 0.32 leaves them running then)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import subprocess
import sys

logger = logging.getLogger(__name__)


class ReaperClient:
    """Starts the reaper and names processes for it to watch.

    Started before vLLM, and :meth:`watch_new_children` called every few tenths of a second while
    vLLM starts, so that an engine core is watched soon after its creation; every
    ``multiprocessing`` child that appears after that is watched (vLLM creates its engine cores
    with ``multiprocessing`` under both the fork and the spawn start method).
    """

    def __init__(self, grace_s: float) -> None:
        self._known = {p.pid for p in multiprocessing.active_children()}
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rolloutd.engines.reaper",
                str(os.getpid()),
                f"--grace={grace_s}",
                # the service's debug logging shows what the reaper watches, too
                *(["--log-level=DEBUG"] if logger.isEnabledFor(logging.DEBUG) else []),
            ],
            stdin=subprocess.PIPE,
            start_new_session=True,
        )
        self.watched: list[int] = []

    def watch_new_children(self) -> None:
        stdin = self._proc.stdin
        assert stdin is not None
        for child in multiprocessing.active_children():
            pid = child.pid
            if pid is None or pid in self._known:
                continue
            self._known.add(pid)
            self.watched.append(pid)
            stdin.write(f"watch {pid}\n".encode())
            stdin.flush()
            logger.debug("reaper %d watches %s (pid %d)", self._proc.pid, child.name, pid)

    def close(self) -> None:
        """Let the reaper exit without touching anything (the engine was shut down cleanly)."""
        self._last_word(b"exit\n")

    def reap(self) -> None:
        """End every engine process still running (a start that failed half-way), then exit."""
        self._last_word(b"reap\n")

    def _last_word(self, command: bytes) -> None:
        stdin = self._proc.stdin
        assert stdin is not None
        try:
            stdin.write(command)
            stdin.close()
        except BrokenPipeError:
            logger.warning("engine reaper %d had already exited", self._proc.pid)
        self._proc.wait(timeout=60)
