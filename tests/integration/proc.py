"""Runs the real ``rolloutd serve`` CLI as a subprocess and finds its addresses in its log."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

LISTENING = re.compile(r"\bgRPC (?P<grpc>[^\s,]+), dashboard (?:https?://(?P<http>[^/\s]+)/|off)")
"""The addresses in the ``ready`` line that ends a start (``rolloutd.startup.ready_line``)."""
OWN_LINE = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (?:INFO|WARNING|ERROR|CRITICAL) rolloutd[.\w]*: "
    r"|^rolloutd: "
)
"""A line ``rolloutd serve`` prints at the default log level: its log format, or a start-up
failure's one line."""


def foreign_lines(output: str) -> list[str]:
    """Lines of ``output`` that are not rolloutd's own: another library's log or noise."""
    return [line for line in output.splitlines() if line.strip() and not OWN_LINE.match(line)]


class ServeProcess:
    def __init__(
        self,
        args: list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
        log_path: Path | None = None,
        inherit_env: bool = True,
    ) -> None:
        """``inherit_env=False``: ``env`` is the whole environment (a newcomer's shell, say)."""
        full_env = {**(os.environ if inherit_env else {}), "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log_path = log_path
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rolloutd.cli", "serve", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=full_env,
            cwd=cwd,
            start_new_session=True,
        )
        self._listening = threading.Event()
        self.grpc: str | None = None
        self.http: str | None = None
        self._pumping = threading.Thread(target=self._pump, daemon=True)
        self._pumping.start()

    @classmethod
    def synthetic(cls, checkpoint_dir: str | Path, *args: str, **kw: Any) -> ServeProcess:
        """The synthetic engine on free ports, checkpointing to ``checkpoint_dir``."""
        return cls(
            [
                "--engine",
                "synthetic",
                "--grpc-port",
                "0",
                "--http-port",
                "0",
                "--checkpoint-dir",
                str(checkpoint_dir),
                *args,
            ],
            **kw,
        )

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        log = self.log_path.open("a") if self.log_path else None
        for line in self.proc.stdout:
            self.lines.append(line)
            if log:
                log.write(line)
                log.flush()
            m = LISTENING.search(line)
            if m:
                _host, port = m["grpc"].rsplit(":", 1)
                self.grpc = f"127.0.0.1:{port}"
                if m["http"]:
                    self.http = f"127.0.0.1:{m['http'].rsplit(':', 1)[1]}"
                self._listening.set()
        if log:
            log.close()

    def wait_listening(self, timeout: float = 120.0) -> str:
        """The gRPC address, once the service says it serves. A start that ends first or does
        not finish within ``timeout`` fails, and leaves nothing running: its process group is
        killed (a vLLM start left behind slowed every start after it on a 2-core machine)."""
        deadline = time.monotonic() + timeout
        while not self._listening.wait(0.1):
            code = self.proc.poll()
            if code is not None or time.monotonic() > deadline:
                self.kill()
                why = f"exit {code}" if code is not None else f"not serving after {timeout:.0f} s"
                raise RuntimeError(f"rolloutd did not start ({why}):\n{self.output}")
        assert self.grpc is not None
        return self.grpc

    @staticmethod
    def python_bin(name: str) -> Path:
        """A console script installed beside this interpreter (e.g. ``rolloutd``)."""
        return Path(sys.executable).parent / name

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM; the exit code once the process exited and its output was read to the end
        (the lines it wrote last, as it stopped, are in :attr:`output`)."""
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout)
        self._pumping.join(timeout)
        return code

    def kill(self) -> None:
        """SIGKILL the whole process group (the service and any engine process it started)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
